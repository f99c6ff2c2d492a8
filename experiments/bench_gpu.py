"""The prepared GPU check of the kernels (issue 7), in one call.

    python -m experiments.bench_gpu --out $OUT/bench_gpu.json  # a CUDA machine: a few minutes
    python -m experiments.bench_gpu --smoke  # tiny sizes; on a CPU via Triton's interpreter

1. Ceilings: device-to-device copy bandwidth (bytes read + written per second) and the bf16 matrix
   product rate (8192³).
2. Correctness: every kernel against its reference on the device (mixed varlen batches, GQA 1/3/6/7,
   head sizes 64/128, block sizes 16/32, tree masks, KV splits; bitmask and rejection sampling at the
   real vocabularies); the Triton backend against ReferenceAttention through ``forward``.
3. Kernel timings (CUDA only; ``--smoke`` runs each once at tiny sizes to exercise the code): Triton
   against the torch path the engine used before and, for attention, against dense (unpaged)
   ``scaled_dot_product_attention``; achieved bandwidth as a fraction of the measured copy bandwidth,
   prefill as a fraction of the matrix rate.
4. Engine decode step (``ModelRunner``: build the inputs, forward, greedy pick, copy to host) at batch 1
   and 32 with random weights in the SmolLM2-135M and Qwen2.5-1.5B configurations, each request with a
   512-token context, Triton attention with CUDA graphs off and on, and the reference attention; against
   the floor weight bytes ÷ copy bandwidth.
5. The whole engine (``specdec.LLM``) on a random SmolLM2-135M: plain, n-gram and EAGLE chains, 1 and 32
   requests, CUDA graphs off and on (tokens per second, τ, fraction of the copy bandwidth).
6. The peer: transformers ``generate`` on the same model and prompts, eager and with its static cache
   (compiled on CUDA).
7. A profile of the eager decode step: kernels per step, their summed device time, the largest.

A short table is printed last; ``--out`` also writes every figure as JSON. Exit status 1 when a
correctness check fails. Needs torch and triton (sections 1-4) and transformers (section 5, which saves a
random model in its layout); no weights.

It lives in ``experiments`` (it was ``kernels/bench_gpu.py``) because section 4 runs the engine's
``ModelRunner`` and attention backends from ``specdec``, which ``kernels`` may not import (see
``docs/layers.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

# Public configurations (the models' config.json), built without transformers.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie=True, max_pos=8192,
    ),
    "Qwen2.5-1.5B": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0, tie=True, max_pos=32768,
    ),
    # --smoke only
    "tiny": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie=True, max_pos=512,
    ),
}  # fmt: skip

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Report:
    """Collects rows: ``section, case, figures...``; prints the table; dumps JSON."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.failures: list[str] = []

    def add(self, section: str, case: str, **figures: Any) -> None:
        row = {"section": section, "case": case, **figures}
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def check(self, case: str, err: float, tol: float, exact: bool = False) -> None:
        ok = err == 0.0 if exact else err <= tol
        if not ok:
            self.failures.append(case)
        self.add("check", case, max_err=err, tol=0.0 if exact else tol, ok=ok)

    def table(self) -> str:
        def fmt(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:.3g}"
            return str(v)

        lines = []
        for section in ("ceiling", "check", "kernel", "engine", "llm", "profile"):
            rows = [r for r in self.rows if r["section"] == section]
            if not rows:
                continue
            keys = [k for k in rows[0] if k != "section"]
            for r in rows[1:]:
                keys += [k for k in r if k not in keys and k != "section"]
            lines.append(f"\n## {section}")
            lines.append("| " + " | ".join(keys) + " |")
            lines.append("|" + "---|" * len(keys))
            for r in rows:
                lines.append("| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |")
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, smoke: bool) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench, L2 flushed between runs) on CUDA; one timed
    call otherwise (``--smoke``: the figure only proves the path runs)."""
    if device.type == "cuda" and not smoke:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t) * 1e3


# ------------------------------------------------------------------------------------------ 1. ceilings
def ceilings(report: Report, device: torch.device, smoke: bool) -> tuple[float, float]:
    """Copy bandwidth (bytes/s, read + written) and bf16 matmul rate (FLOP/s)."""
    n_bytes = (8 << 20) if smoke else (1 << 30)
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(partial(dst.copy_, src), device, smoke)
    bw = 2 * n_bytes / (ms * 1e-3)
    report.add("ceiling", "copy bandwidth", bytes=2 * n_bytes, ms=ms, GBps=bw / 1e9)
    n = 256 if smoke else 8192
    dtype = torch.float32 if smoke and device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(partial(torch.matmul, a, b), device, smoke)
    flops = 2 * n**3 / (ms * 1e-3)
    report.add("ceiling", f"{str(dtype)[6:]} matmul {n}^3", ms=ms, TFLOPs=flops / 1e12)
    return bw, flops


# ------------------------------------------------------------------------------------------ 2. correctness
def check_kernels(report: Report, device: torch.device, smoke: bool) -> None:
    from grammars.bitmask import pack_bitmask
    from kernels.paged_attention import pack_new_token_masks, paged_attention_ref, paged_attention_triton
    from kernels.rejection_sample import rejection_sample_ref, rejection_sample_triton
    from kernels.reshape_and_cache import reshape_and_cache_ref, reshape_and_cache_triton
    from kernels.testing import make_paged_batch, make_rejection_batch, random_tree_mask
    from kernels.token_bitmask import apply_token_bitmask_inplace_triton, apply_token_bitmask_torch
    from specdec.attention.reference import ReferenceAttention
    from specdec.attention.triton_backend import TritonAttention

    g = torch.Generator().manual_seed(0)
    if smoke:
        seqs = [(9, 0), (3, 20), (1, 17), (4, 5)]
    else:
        seqs = [(300, 0), (37, 500), (1, 1000), (5, 777), (9, 64), (1, 1), (130, 31)]
    tree_masks = [None] * (len(seqs) - 2) + [random_tree_mask(q, g) for q, _ in seqs[-2:]]
    cases = [
        # heads, kv_heads, head_dim, block_size, dtype, tree, splits
        (4, 4, 64, 16, torch.float32, False, 1),
        (6, 2, 128, 32, torch.bfloat16, False, 1),
        (12, 2, 128, 16, torch.bfloat16, True, 4),
        (7, 1, 64, 32, torch.float32, True, 1),
    ]
    if smoke:
        cases = [cases[0], cases[2]]
    for heads, kv_heads, head_dim, bs, dtype, tree, splits in cases:
        masks = tree_masks if tree else None
        b = make_paged_batch(
            seqs, heads, kv_heads, head_dim, bs, dtype, device, seed=heads, new_token_masks=masks
        )
        scale = head_dim**-0.5
        ref = paged_attention_ref(
            b.query,
            b.k_cache,
            b.v_cache,
            b.query_start_loc,
            b.seq_lens,
            b.block_table,
            scale,
            b.new_token_masks,
        )
        out = torch.full_like(b.query, float("nan"))
        packed = pack_new_token_masks(b.new_token_masks, b.query_lens, device)
        paged_attention_triton(
            b.query,
            b.k_cache,
            b.v_cache,
            b.query_start_loc,
            b.seq_lens,
            b.block_table,
            scale,
            packed,
            max_query_len=max(b.query_lens),
            num_splits=splits,
            out=out,
        )
        err = float((out.float() - ref.float()).abs().max())
        name = f"paged_attention H{heads}/KV{kv_heads} D{head_dim} bs{bs} {str(dtype)[6:]}"
        report.check(
            name + (" tree" if tree else "") + (f" splits{splits}" if splits > 1 else ""), err, TOL[dtype]
        )
        # The backend (writes K/V, then attends) against ReferenceAttention.
        b = make_paged_batch(
            seqs,
            heads,
            kv_heads,
            head_dim,
            bs,
            dtype,
            device,
            seed=heads,
            new_token_masks=masks,
            write_new=False,
            poison=3e3,
        )
        outs, caches = [], []
        for backend in (ReferenceAttention(), TritonAttention()):
            kc, vc = b.k_cache.clone(), b.v_cache.clone()
            outs.append(backend.forward(b.query, b.key, b.value, kc, vc, b.metadata(), scale))
            caches.append(kc)
        report.check(name + " backend", float((outs[1].float() - outs[0].float()).abs().max()), TOL[dtype])
        report.check(
            name + " reshape_and_cache (backend)", float((caches[1] - caches[0]).abs().max()), 0, True
        )

    for dtype in (torch.float32, torch.bfloat16):
        key = torch.randn(257, 2, 128, generator=g).to(device=device, dtype=dtype)
        slots = torch.randperm(64 * 16, generator=g)[:257].to(device)
        slots[::7] = -1
        written = []
        for fn in (reshape_and_cache_ref, reshape_and_cache_triton):
            kc = torch.full((64, 16, 2, 128), float("nan"), device=device, dtype=dtype)
            vc = kc.clone()
            fn(key, key * 2, kc, vc, slots)
            written.append((kc, vc))
        same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(*written))
        report.check(f"reshape_and_cache {str(dtype)[6:]}", 0.0 if same else 1.0, 0, True)

    for vocab in (1000,) if smoke else (49152, 151936, 151936 + 17):
        allowed = torch.rand(8, vocab, generator=g) < 0.3
        allowed[0] = False
        allowed[0, vocab - 1] = True
        bitmask = pack_bitmask(allowed).to(device)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(8, vocab, generator=g).to(device=device, dtype=dtype)
            ref = apply_token_bitmask_torch(logits, bitmask)
            apply_token_bitmask_inplace_triton(logits, bitmask)
            report.check(
                f"token_bitmask V{vocab} {str(dtype)[6:]}", 0.0 if torch.equal(logits, ref) else 1.0, 0, True
            )

    counts = [4, 0, 4, 2, 4, 1, 3, 4, 0, 4] * (1 if smoke else 4)
    for vocab in (300,) if smoke else (49152, 151936):
        for with_dp in (True, False):
            batch = make_rejection_batch(counts, vocab, seed=vocab, with_draft_probs=with_dp, max_spec_len=5)
            ref = rejection_sample_ref(*batch.args())
            got = rejection_sample_triton(*batch.args(device)).cpu()
            name = f"rejection_sample V{vocab} {'draft-probs' if with_dp else 'deterministic'}"
            report.check(name, 0.0 if torch.equal(got, ref) else 1.0, 0, True)


# ------------------------------------------------------------------------------------------ 3. kernel timings
def time_kernels(report: Report, device: torch.device, smoke: bool, bw: float, flops: float) -> None:
    import torch.nn.functional as F

    from grammars.bitmask import pack_bitmask
    from kernels.rejection_sample import rejection_sample_ref, rejection_sample_triton
    from kernels.reshape_and_cache import reshape_and_cache_ref, reshape_and_cache_triton
    from kernels.testing import make_paged_batch, make_rejection_batch, random_tree_mask
    from kernels.token_bitmask import apply_token_bitmask_inplace_ref, apply_token_bitmask_inplace_triton
    from specdec.attention.reference import ReferenceAttention
    from specdec.attention.triton_backend import TritonAttention

    heads, kv_heads, head_dim, bs = 12, 2, 128, 16  # Qwen2.5-1.5B's attention
    dtype = torch.bfloat16
    el = 2
    g = torch.Generator().manual_seed(1)
    scenarios = (
        [("decode b2 ctx64", [(1, 64)] * 2, None), ("prefill 1x32", [(32, 0)], None)]
        if smoke
        else [
            ("decode b1 ctx8192", [(1, 8192)], None),
            ("decode b32 ctx2048", [(1, 2048)] * 32, None),
            ("verify k4 b32 ctx1024", [(5, 1024)] * 32, None),
            ("verify tree8 b32 ctx1024", [(8, 1024)] * 32, "tree"),
            ("prefill 4x1024", [(1024, 0)] * 4, None),
        ]
    )
    for name, seqs, tree in scenarios:
        q_len, ctx = seqs[0]
        new = random_tree_mask(q_len, g) if tree else torch.ones(q_len, q_len, dtype=torch.bool).tril()
        masks: list[torch.Tensor | None] | None = [new] * len(seqs) if tree else None
        b = make_paged_batch(
            seqs,
            heads,
            kv_heads,
            head_dim,
            bs,
            dtype,
            device,
            seed=3,
            new_token_masks=masks,
            write_new=False,
            poison=0.5,
        )
        scale = head_dim**-0.5
        row: dict[str, Any] = {}
        for label, backend in (("triton_ms", TritonAttention()), ("reference_ms", ReferenceAttention())):
            fwd = partial(backend.forward, b.query, b.key, b.value, b.k_cache, b.v_cache, b.metadata(), scale)
            row[label] = time_ms(fwd, device, smoke)
        # Dense SDPA over the same lengths (no paging): K/V [B, KVH, L, D] contiguous.
        nreq, seq_len = len(seqs), q_len + ctx
        q = b.query.view(nreq, q_len, heads, head_dim).transpose(1, 2)
        k = torch.randn(nreq, kv_heads, seq_len, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        attn_mask = None
        causal = ctx == 0 and q_len > 1
        if ctx and q_len > 1:
            attn_mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
            attn_mask[:, ctx:] = new.to(device)
        sdpa = partial(
            F.scaled_dot_product_attention,
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        row["sdpa_ms"] = time_ms(sdpa, device, smoke)
        kv_bytes = 2 * nreq * seq_len * kv_heads * head_dim * el + 2 * b.query.numel() * el
        row["triton_GBps"] = kv_bytes / (row["triton_ms"] * 1e-3) / 1e9
        row["bw_fraction"] = kv_bytes / (row["triton_ms"] * 1e-3) / bw
        if ctx == 0:
            f = 4 * nreq * heads * head_dim * q_len * q_len / 2
            row["TFLOPs"] = f / (row["triton_ms"] * 1e-3) / 1e12
            row["flop_fraction"] = f / (row["triton_ms"] * 1e-3) / flops
        report.add("kernel", f"attention {name}", **row)

    n_tok = 64 if smoke else 4096
    key = torch.randn(n_tok, kv_heads, head_dim, device=device, dtype=dtype)
    kc = torch.zeros(n_tok // bs + 4, bs, kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * bs, device=device)[:n_tok]
    row = {
        "triton_ms": time_ms(lambda: reshape_and_cache_triton(key, key, kc, vc, slots), device, smoke),
        "reference_ms": time_ms(lambda: reshape_and_cache_ref(key, key, kc, vc, slots), device, smoke),
    }
    moved = 4 * key.numel() * el  # read k, v; write k, v
    row["triton_GBps"] = moved / (row["triton_ms"] * 1e-3) / 1e9
    row["bw_fraction"] = moved / (row["triton_ms"] * 1e-3) / bw
    report.add("kernel", f"reshape_and_cache T{n_tok}", **row)

    rows, vocab = (4, 1000) if smoke else (64, 151936)
    logits = torch.randn(rows, vocab, device=device)
    bitmask = pack_bitmask(torch.rand(rows, vocab, generator=g) < 0.5).to(device)
    row = {
        "triton_ms": time_ms(lambda: apply_token_bitmask_inplace_triton(logits, bitmask), device, smoke),
        "reference_ms": time_ms(lambda: apply_token_bitmask_inplace_ref(logits, bitmask), device, smoke),
    }
    moved = logits.numel() * 4 * 3 // 2 + bitmask.numel() * 4  # read all, write the masked half
    row["triton_GBps"] = moved / (row["triton_ms"] * 1e-3) / 1e9
    row["bw_fraction"] = moved / (row["triton_ms"] * 1e-3) / bw
    report.add("kernel", f"token_bitmask {rows}x{vocab} fp32", **row)

    counts = [2, 4] if smoke else [4] * 32
    vocab = 300 if smoke else 151936
    batch = make_rejection_batch(counts, vocab, seed=5, max_spec_len=max(counts))
    args_dev = batch.args(device)
    row = {
        "triton_ms": time_ms(lambda: rejection_sample_triton(*args_dev), device, smoke),
        "reference_ms": time_ms(lambda: rejection_sample_ref(*args_dev), device, smoke),
    }
    n_d, n_r = sum(counts), len(counts)
    moved = (2 * n_d + 2 * n_r) * vocab * 4  # target rows + draft rows + final rows (+noise), about
    row["triton_GBps"] = moved / (row["triton_ms"] * 1e-3) / 1e9
    row["bw_fraction"] = moved / (row["triton_ms"] * 1e-3) / bw
    report.add("kernel", f"rejection_sample b{n_r} k{max(counts)} V{vocab}", **row)


# ------------------------------------------------------------------------------------------ 4. engine step
def build_model(name: str, device: torch.device, dtype: torch.dtype):
    from specdec.models.config import ModelArchConfig
    from specdec.models.decoder import DecoderLM

    c = MODEL_CONFIGS[name]
    inv_freq = 1.0 / (
        c["rope_theta"] ** (torch.arange(0, c["head_dim"], 2, dtype=torch.float) / c["head_dim"])
    )
    cfg = ModelArchConfig(
        model_type=c["model_type"],
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_layers"],
        num_heads=c["num_heads"],
        num_kv_heads=c["num_kv_heads"],
        head_dim=c["head_dim"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=c["tie"],
        qkv_bias=c["model_type"] == "qwen2",
        o_bias=False,
        mlp_bias=False,
        max_position_embeddings=c["max_pos"],
        inv_freq=tuple(inv_freq.tolist()),
        rope_attention_scaling=1.0,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(dtype).eval()


def time_engine(report: Report, device: torch.device, smoke: bool, bw: float) -> None:
    from specdec.config import CompilationConfig
    from specdec.model_runner import ModelRunner, Segment, build_inputs

    dtype = torch.float32 if smoke and device.type == "cpu" else torch.bfloat16
    bs, ctx = 16, (20 if smoke else 512)
    for name in ("tiny",) if smoke else ("SmolLM2-135M", "Qwen2.5-1.5B"):
        model = build_model(name, device, dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for batch in (1, 2) if smoke else (1, 32):
            per_req = -(-(ctx + 1) // bs)
            logits: dict[str, torch.Tensor] = {}
            for backend in ("triton", "triton+graphs", "reference"):
                graphs = backend.endswith("+graphs")
                compilation = CompilationConfig(enabled=False, cuda_graphs=True) if graphs else None
                if graphs and device.type != "cuda":
                    continue
                attention = backend.removesuffix("+graphs")
                runner = ModelRunner(
                    model, batch * per_req + 1, bs, attention=attention, compilation=compilation
                )
                segs = [
                    Segment(list(range(1 + i * per_req, 1 + (i + 1) * per_req)), ctx, [5 + i], 1)
                    for i in range(batch)
                ]

                def step(runner=runner, segs=segs, backend=backend, logits=logits) -> list[int]:
                    inputs = build_inputs(segs, bs, device)
                    out = runner.execute(inputs)
                    logits[backend] = out
                    return out.argmax(dim=-1).tolist()

                ms = time_ms(step, device, smoke)
                floor_ms = weight_bytes / bw * 1e3
                case = f"{name} decode b{batch} ctx{ctx} {backend}"
                tok_s, frac = batch * 1e3 / ms, floor_ms / ms
                report.add("engine", case, ms=ms, tok_s=tok_s, floor_ms=floor_ms, floor_fraction=frac)
                del runner
            diff = float((logits["triton"] - logits["reference"]).abs().max())
            report.add("engine", f"{name} b{batch} logits, triton vs reference", max_err=diff)
            if "triton+graphs" in logits:
                diff = float((logits["triton+graphs"] - logits["triton"]).abs().max())
                same = logits["triton+graphs"].argmax(-1).equal(logits["triton"].argmax(-1))
                report.add(
                    "engine", f"{name} b{batch} logits, graphs vs eager", max_err=diff, greedy_equal=same
                )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ 5. engine
def save_random_hf_model(name: str, directory: str, dtype: torch.dtype) -> str:
    """A random model of ``name``'s configuration in transformers' layout (the zoo's weights are not
    on a GPU machine; the step's cost does not depend on the values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = MODEL_CONFIGS[name]
    fields: dict[str, Any] = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"], head_dim=c["head_dim"], rope_theta=c["rope_theta"],
        tie_word_embeddings=c["tie"], max_position_embeddings=c["max_pos"], bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(LlamaConfig(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.to(dtype).save_pretrained(directory)
    return directory


def save_random_eagle_head(target_dir: str, directory: str) -> str:
    from specdec.drafters.heads import HeadConfig, arch_fields, build_heads, save_heads
    from specdec.models.config import ModelArchConfig

    arch = ModelArchConfig.from_pretrained(target_dir)
    cfg = HeadConfig(
        method="eagle", target="random", hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
        arch=arch_fields(arch),
    )  # fmt: skip
    torch.manual_seed(1)
    head = build_heads(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02)
    save_heads(head, cfg, directory)
    return directory


def time_llm(report: Report, device: torch.device, smoke: bool, bw: float) -> None:
    """The whole engine (``specdec.LLM``: scheduling, drafting, verification, sampling) on a random
    SmolLM2-135M: plain decoding, n-gram and EAGLE chains of 4, 1 and 32 requests, CUDA graphs off and
    on (and, for plain decoding, graphs of the ``torch.compile``d forward); greedy, ``ignore_eos``.
    Reports tokens per second, τ, target forwards per second and the fraction of the copy bandwidth
    those forwards' weight bytes take; and whether the greedy tokens with graphs equal those without
    (they may differ where bf16 products round differently at another row count)."""
    import tempfile

    from specdec import LLM, SamplingParams

    name = "tiny" if smoke else "SmolLM2-135M"
    dtype = "float32" if smoke and device.type == "cpu" else "bfloat16"
    tmp = tempfile.mkdtemp(prefix="specdec_bench_gpu_")
    target = save_random_hf_model(name, os.path.join(tmp, "target"), getattr(torch, dtype))
    head = save_random_eagle_head(target, os.path.join(tmp, "eagle"))
    weight_bytes = sum(
        os.path.getsize(os.path.join(target, f)) for f in os.listdir(target) if f.endswith(".safetensors")
    )
    specs: dict[str, dict | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "eagle": {"method": "eagle", "model": head, "num_speculative_tokens": 4},
    }
    max_tokens = 8 if smoke else 128
    for batch in (1, 2) if smoke else (1, 32):
        prompts = [{"prompt_token_ids": p} for p in llm_prompts(name, batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for method, spec in specs.items():
            tokens: dict[str, list[list[int]]] = {}
            modes = ["graphs=off"]
            if device.type == "cuda":
                # torch.compile of the dense work (fused norms, RoPE, activations) inside the graphs:
                # plain decoding only (each token bucket compiles once, tens of seconds).
                modes += ["graphs=on"] + (["compile+graphs"] if method == "plain" else [])
            for mode in modes:
                case = f"{name} {method} b{batch} {mode}"
                compile_arg = {"buckets": [1, 2, 4, 8, 16, 32, 64]} if mode == "compile+graphs" else False
                try:
                    llm = LLM(
                        target, dtype=dtype, device=str(device), skip_tokenizer_init=True,
                        speculative_config=spec, cuda_graphs=mode != "graphs=off", compile=compile_arg,
                        max_num_seqs=max(batch, 1), max_num_batched_tokens=max(512, batch * 64),
                    )  # fmt: skip
                    llm.generate(prompts, params)  # warm-up: Triton compilations, graph captures
                    _sync(device)
                    engine = llm.engine
                    steps0 = engine.num_steps
                    engine.reset_spec_stats()
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    _sync(device)
                    elapsed = time.perf_counter() - t0
                except Exception as e:  # one failing row must not lose the others
                    report.failures.append(case)
                    report.add("llm", case, error=f"{type(e).__name__}: {e}"[:300])
                    continue
                steps = engine.num_steps - steps0
                tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
                n_tokens = sum(len(t) for t in tokens[mode])
                stats = engine.spec_stats
                tau = stats.mean_acceptance_length if stats is not None and stats.num_drafts else 1.0
                graph_stats = engine.runner.cuda_graph_stats
                report.add(
                    "llm", case, tok_s=n_tokens / elapsed, tau=tau, steps=steps,
                    ms_per_step=elapsed / steps * 1e3,
                    floor_fraction=weight_bytes * steps / elapsed / bw,
                    graph_share=(
                        graph_stats.graph_calls / max(1, graph_stats.graph_calls + graph_stats.eager_calls)
                        if graph_stats is not None else 0.0
                    ),
                )  # fmt: skip
                del llm, engine
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for mode in modes[1:]:
                if mode in tokens and "graphs=off" in tokens:
                    report.add(
                        "llm",
                        f"{name} {method} b{batch} greedy, {mode} vs eager",
                        equal=tokens[mode] == tokens["graphs=off"],
                    )


def llm_prompts(name: str, batch: int) -> list[list[int]]:
    """``batch`` prompts of 64 tokens, each a 16-token motif repeated (n-gram lookup finds drafts)."""
    gen = torch.Generator().manual_seed(batch)
    vocab = MODEL_CONFIGS[name]["vocab_size"]
    return [(torch.randint(3, vocab, (16,), generator=gen).tolist() * 4)[:64] for _ in range(batch)]


# ------------------------------------------------------------------------------------------ 6. peers
def time_peers(report: Report, device: torch.device, smoke: bool, bw: float) -> None:
    """transformers on the same random SmolLM2-135M and prompts as section 5: ``generate`` greedy,
    eager (dynamic cache), and with its static cache, which transformers compiles (``torch.compile``,
    CUDA graphs through inductor's ``reduce-overhead``) on CUDA; 1 and 32 requests, 128 new tokens
    (``min_new_tokens``: no early stop). The second of two calls is timed (the first compiles)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    name = "tiny" if smoke else "SmolLM2-135M"
    dtype = torch.float32 if smoke and device.type == "cpu" else torch.bfloat16
    target = save_random_hf_model(name, os.path.join(tempfile.mkdtemp(prefix="specdec_peer_"), "t"), dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    model = model.to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    max_tokens = 8 if smoke else 128
    modes = ("eager",) if smoke else ("eager", "static")
    for batch in (1, 2) if smoke else (1, 32):
        ids = torch.tensor(llm_prompts(name, batch), device=device)
        for mode in modes:
            kwargs: dict[str, Any] = dict(
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
            if mode == "static":
                kwargs["cache_implementation"] = "static"
            case = f"transformers {name} {mode} b{batch}"
            try:
                with torch.no_grad():
                    model.generate(ids, **kwargs)
                    _sync(device)
                    t0 = time.perf_counter()
                    out = model.generate(ids, **kwargs)
                    _sync(device)
                elapsed = time.perf_counter() - t0
            except Exception as e:
                report.add("llm", case, error=f"{type(e).__name__}: {e}"[:300])
                continue
            n = (out.shape[1] - ids.shape[1]) * batch
            steps = out.shape[1] - ids.shape[1]
            report.add(
                "llm", case, tok_s=n / elapsed, tau=1.0, steps=steps, ms_per_step=elapsed / steps * 1e3,
                floor_fraction=weight_bytes * steps / elapsed / bw,
            )  # fmt: skip


# ------------------------------------------------------------------------------------------ 7. profile
def profile_step(report: Report, device: torch.device, smoke: bool) -> None:
    """Where an eager decode step's device time goes (``torch.profiler``): kernels launched per step,
    their summed device time, and the kernels that take the most, for SmolLM2-135M at 1 and 32 requests
    (512-token contexts, Triton attention). With CUDA graphs the step costs about the summed kernel time;
    eagerly, the launches' host time."""
    from torch.profiler import ProfilerActivity, profile

    from specdec.model_runner import ModelRunner, Segment, build_inputs

    name = "tiny" if smoke else "SmolLM2-135M"
    dtype = torch.float32 if smoke and device.type == "cpu" else torch.bfloat16
    model = build_model(name, device, dtype)
    bs, ctx = 16, (20 if smoke else 512)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    for batch in (1, 2) if smoke else (1, 32):
        per_req = -(-(ctx + 1) // bs)
        runner = ModelRunner(model, batch * per_req + 1, bs)
        segs = [
            Segment(list(range(1 + i * per_req, 1 + (i + 1) * per_req)), ctx, [5 + i], 1)
            for i in range(batch)
        ]
        inputs = build_inputs(segs, bs, device)
        for _ in range(3):
            runner.execute(inputs)
        _sync(device)
        steps = 5
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                runner.execute(inputs)
            _sync(device)
        events = [
            e for e in prof.key_averages()
            if (e.device_type.name == "CUDA" if device.type == "cuda" else e.key.startswith("aten::"))
        ]  # fmt: skip

        def total_us(e: Any) -> float:
            return float(getattr(e, "device_time_total", 0.0) or getattr(e, "self_cpu_time_total", 0.0))

        kernels = sum(e.count for e in events) / steps
        busy_ms = sum(total_us(e) for e in events) / steps / 1e3
        top = sorted(events, key=total_us, reverse=True)[:8]
        report.add(
            "profile", f"{name} eager decode b{batch} ctx{ctx}", kernels_per_step=kernels, kernel_ms=busy_ms,
            top="; ".join(f"{e.key[:48]} x{e.count // steps} {total_us(e) / steps / 1e3:.3f}ms" for e in top),
        )  # fmt: skip
        del runner


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, one timed call each (CPU: interpreter)"
    )
    parser.add_argument("--out", default=None, help="write every figure as JSON here")
    parser.add_argument("--skip-engine", action="store_true", help="skip sections 4 to 7")
    parser.add_argument(
        "--sections",
        default="checks,kernels,engine,llm,peers,profile",
        help="comma-separated sections to run after the ceilings (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    unknown = sections - {"checks", "kernels", "engine", "llm", "peers", "profile"}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    if args.skip_engine:
        sections -= {"engine", "llm", "peers", "profile"}
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            parser.error("no CUDA device: only --smoke runs here (in Triton's interpreter)")
        # Must precede the first `import triton` (the kernels modules are imported below).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    report = Report()
    t0 = time.perf_counter()
    bw, flops = ceilings(report, device, args.smoke)
    if "checks" in sections:
        check_kernels(report, device, args.smoke)
    if "kernels" in sections:
        time_kernels(report, device, args.smoke, bw, flops)
    if "engine" in sections:
        time_engine(report, device, args.smoke, bw)
    if "llm" in sections:
        time_llm(report, device, args.smoke, bw)
    if "peers" in sections:
        time_peers(report, device, args.smoke, bw)
    if "profile" in sections:
        profile_step(report, device, args.smoke)
    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    summary = {
        "device": name,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "seconds": time.perf_counter() - t0,
        "failures": report.failures,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": report.rows}, f, indent=1)
    print(report.table())
    status = "all checks passed" if not report.failures else f"FAILED: {report.failures}"
    print(f"\n{name}, torch {torch.__version__}, {summary['seconds']:.0f} s: {status}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
