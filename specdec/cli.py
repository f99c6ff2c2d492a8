"""Command line: ``python -m specdec generate --model smollm2-135m-instruct --prompt "..."``.

Sub-commands:
    generate   generate from a zoo model or HF directory, through the chat template by default;
               ``--json-schema``/``--regex``/``--choice`` constrain the output.
    zoo        list the zoo and which models are already converted in the cache.

The default dtype is float32, as for ``LLM()`` and ``python -m experiments.run``: in float32 greedy
decoding equals transformers' token for token; bfloat16 is faster, but its rounding depends on the batch
shape, which can change greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sampling.params import SamplingParams


def _json_schema_arg(value: str) -> dict:
    """``--json-schema``: a JSON string, or ``@FILE`` holding one (parsed here, so that a typo is an
    argument error naming the flag)."""
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {e.strerror}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"a JSON schema is an object, got {type(schema).__name__}")
    return schema


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The :class:`SamplingParams` of ``specdec generate``'s arguments (``--json-schema``, ``--regex``
    and ``--choice`` map onto ``json_schema=``, ``regex=`` and ``choice=``; at most one may be given).

    Raises:
        InvalidRequestError: more than one constraint, or an invalid one.
    """
    from sampling.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        seed=args.seed,
        max_tokens=args.max_tokens,
        json_schema=args.json_schema,
        regex=args.regex,
        choice=args.choice,
    )


def _generate(args: argparse.Namespace) -> int:
    from specdec.llm import LLM

    spec: dict[str, object] | None = None
    if args.drafter is not None:
        spec = {"method": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
        if args.draft_model is not None:
            spec["model"] = args.draft_model
        if args.tree is not None:
            spec["tree"] = args.tree
        if args.draft_quantization is not None:
            spec["quantization"] = args.draft_quantization
        if args.spec_policy != "static":
            spec["policy"] = args.spec_policy
        if args.grammar_forced_drafts:
            spec["grammar_forced_drafts"] = True
        if args.max_forced_drafts is not None:
            spec["max_forced_drafts"] = args.max_forced_drafts
        if args.suffix_share_across_requests:
            spec["suffix_share_across_requests"] = True
        if args.hybrid_union:
            spec["hybrid_union"] = True
    if args.suffix_share_across_requests and args.drafter not in ("suffix", "hybrid"):
        raise SystemExit("--suffix-share-across-requests applies to --drafter suffix or hybrid")
    if args.hybrid_union and args.drafter != "hybrid":
        raise SystemExit("--hybrid-union applies to --drafter hybrid")
    if args.max_forced_drafts is not None and not args.grammar_forced_drafts:
        raise SystemExit("--max-forced-drafts needs --grammar-forced-drafts")
    if args.grammar_forced_drafts and args.drafter is None:
        raise SystemExit(
            "--grammar-forced-drafts extends a drafter's chains: give --drafter too "
            "(--drafter grammar drafts the forced tokens alone)"
        )
    params = sampling_params_from_args(args)  # before loading the model: a bad constraint fails fast
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        speculative_config=spec,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        cpu_threads=args.cpu_threads,
        grammar_backend=args.grammar_backend,
        huge_pages="auto" if args.huge_pages else False,
    )
    prompts = args.prompt or ["Write a haiku about speculative decoding."]
    t0 = time.perf_counter()
    if args.raw:
        outs = llm.generate(prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        num_tokens += len(c.token_ids)
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "finish_reason": c.finish_reason,
                        "metrics": out.metrics,
                    }
                )
            )
        else:
            print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]\n")
    print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from specdec.zoo import ZOO, cache_dir, is_converted

    print(f"cache: {cache_dir()}")
    for name, entry in ZOO.items():
        state = "converted" if is_converted(name) else "not fetched"
        print(f"{name:32s} {state:12s} {entry.packages[0]}{' ...' if len(entry.packages) > 1 else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` argument parser (every option's ``--help`` shows its default)."""
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a model")
    g.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="zoo name or HF-format directory (default: %(default)s)",
    )
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument(
        "--max-tokens", type=int, default=64, help="tokens per prompt at most (default: %(default)s)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 = greedy (default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights, activations and KV cache (default: %(default)s, like LLM(); greedy output then "
        "equals transformers'; bfloat16 is faster but its rounding can change greedy tokens)",
    )
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the forward, one graph per token bucket (slower start, faster steps; "
        "default: eager, the reference)",
    )
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="on CUDA, replay decode and verification steps from CUDA graphs (default: off)",
    )
    g.add_argument(
        "--cpu-threads",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="intra-op threads on the CPU: auto (the cores other processes leave free) or a count",
    )
    g.add_argument(
        "--no-huge-pages",
        dest="huge_pages",
        action="store_false",
        help="CPU: leave the weights on the pages they have (default: moved onto 2 MiB pages at start-up)",
    )
    c = g.add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema",
        type=_json_schema_arg,
        default=None,
        metavar="SCHEMA",
        help="constrain the output to JSON valid under this schema: a JSON string or @FILE",
    )
    c.add_argument("--regex", default=None, help="constrain the output to a full match of this regex")
    from grammars.registry import GRAMMAR_BACKENDS

    g.add_argument(
        "--grammar-backend",
        choices=sorted(GRAMMAR_BACKENDS),
        default="auto",
        help="what compiles --json-schema/--regex/--choice (default: %(default)s: per schema, the backend "
        "that enforces the most of it)",
    )
    c.add_argument(
        "--choice", action="append", default=None, help="constrain the output to one of these (repeat)"
    )
    from specdec.drafters.registry import drafter_names

    g.add_argument(
        "--drafter", choices=drafter_names(), default=None, help="speculative decoding method (default: none)"
    )
    g.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="k, drafts per step (default: %(default)s)"
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="draft model (draft_model) or heads (medusa, eagle) (default: none)",
    )
    g.add_argument(
        "--tree",
        default=None,
        choices=["static", "dynamic"],
        help="token tree (medusa: static; eagle, suffix, hybrid: dynamic) (default: chain)",
    )
    g.add_argument(
        "--draft-quantization",
        default=None,
        choices=["int8", "int4"],
        help="quantized_self's draft weights (default: the drafter's own)",
    )
    from specdec.policies import policy_names

    g.add_argument(
        "--spec-policy",
        choices=policy_names(),
        default="static",
        help="speculation policy: draft depth per request and step (default: %(default)s)",
    )
    g.add_argument(
        "--grammar-forced-drafts",
        action="store_true",
        help="append the tokens a constrained request's grammar forces to the drafter's chains",
    )
    g.add_argument(
        "--max-forced-drafts",
        type=int,
        default=None,
        metavar="N",
        help="with --grammar-forced-drafts: draft positions beyond k for them (default: k)",
    )
    g.add_argument(
        "--suffix-share-across-requests",
        action="store_true",
        help="suffix, hybrid: draft from earlier requests' prompts and outputs too (off by default: a "
        "request's speed could reveal what another request wrote)",
    )
    g.add_argument(
        "--hybrid-union",
        action="store_true",
        help="hybrid: verify the union of the members' proposals as one token tree (more rows a step, "
        "each step accepts its best member's drafts) instead of the best proposal alone",
    )
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=_generate)
    z = sub.add_parser("zoo", help="list zoo models")
    z.set_defaults(func=_zoo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specdec.errors import SpecdecError

    try:
        return int(args.func(args))
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
