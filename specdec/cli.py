"""Command line: ``python -m specdec generate --model smollm2-135m-instruct --prompt "..."``.

Sub-commands:
    generate   generate from a zoo model or HF directory, through the chat template by default.
    zoo        list the zoo and which models are already converted in the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from sampling.params import SamplingParams
    from specdec.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a model")
    g.add_argument("--model", default="smollm2-135m-instruct", help="zoo name or HF-format directory")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    g.add_argument("--device", default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=_generate)
    z = sub.add_parser("zoo", help="list zoo models")
    z.set_defaults(func=_zoo)
    args = parser.parse_args(argv)
    from specdec.errors import SpecdecError

    try:
        return int(args.func(args))
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
