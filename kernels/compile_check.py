"""Compile every kernel for NVIDIA GPUs on a machine without one: Triton's ahead-of-time path (Python →
TTIR → TTGIR → LLVM IR → PTX → cubin with the ptxas bundled in the triton wheel).

The interpreter checks what a kernel computes but not that it compiles: it accepts programs the
compiler rejects (a loop-carried variable that changes type, a ``tl.dot`` operand under 16 wide, an
argument that Triton specialises to a constant because it equals 1) and runs every operation in numpy.
This check compiles each kernel in the configurations the launchers use, including the specialisations
Triton applies at launch (integer arguments equal to 1 and unit strides become constants).

    python -m kernels.compile_check [--arch 90 80] [--quick]

Must run without ``TRITON_INTERPRET`` (the tests start it in a subprocess).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

# (name, kernel attribute path, signature, constexprs); built lazily, see _configs().
Config = tuple[str, Any, dict[str, str], dict[str, Any]]


def _attention_configs(quick: bool) -> list[Config]:
    from kernels.paged_attention import _merge_splits_kernel, _paged_attention_kernel

    out: list[Config] = []
    variants = [
        # dtype, group, head_dim, block_size, block_m, tile_n, has_mask, splits, num_seqs_is_1, window,
        # softcap
        ("bf16", 6, 128, 16, 32, 32, True, 1, False, False, False),  # Qwen2.5-1.5B verification of a tree
        ("bf16", 4, 128, 16, 64, 32, False, 4, True, True, False),  # Mistral long-context decode, batch 1
        ("fp32", 7, 64, 32, 16, 32, False, 1, False, False, False),
        ("fp32", 1, 128, 32, 64, 32, True, 1, False, False, False),
        ("bf16", 2, 16, 16, 16, 32, False, 1, False, True, True),  # tiny Gemma 2 (head_dim 16)
        ("bf16", 2, 256, 16, 16, 32, False, 1, False, True, True),  # Gemma 2 (head_dim 256)
        ("bf16", 2, 256, 16, 32, 32, True, 1, False, True, True),  # Gemma 2 verifying a token tree
    ]
    if quick:
        variants = variants[:2]
    for dtype, group, head_dim, bs, block_m, tile_n, has_mask, splits, one_seq, window, cap in variants:
        head_pad = max(16, 1 << (head_dim - 1).bit_length())
        ptr = f"*{dtype}"
        sig = {
            "out_ptr": ptr, "q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr,
            "qsl_ptr": "*i64", "seq_lens_ptr": "*i64", "block_table_ptr": "*i64",
            "mask_bits_ptr": "*i8", "mask_off_ptr": "*i32", "depth_ptr": "*i32", "depth_off_ptr": "*i32",
            "part_acc_ptr": "*fp32" if splits > 1 else ptr, "part_ml_ptr": "*fp32" if splits > 1 else ptr,
            "qk_scale": "fp32", "window": "i32", "softcap": "fp32", "num_seqs": "i32", "num_tokens": "i32",
            "stride_qt": "i32", "stride_qh": "i32", "stride_qd": "constexpr",
            "stride_ot": "i32", "stride_oh": "i32", "stride_od": "constexpr",
            "stride_kb": "i32", "stride_ko": "i32", "stride_kh": "i32", "stride_kd": "constexpr",
            "stride_vb": "i32", "stride_vo": "i32", "stride_vh": "i32", "stride_vd": "constexpr",
            "stride_bt": "i32",
        }  # fmt: skip
        consts: dict[str, Any] = {"stride_qd": 1, "stride_od": 1, "stride_kd": 1, "stride_vd": 1}
        if one_seq:
            sig["num_seqs"] = "constexpr"
            consts["num_seqs"] = 1
        consts.update(
            NUM_HEADS=2 * group, GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=bs,
            BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n, HAS_MASK=has_mask,
            HAS_WINDOW=window, HAS_SOFTCAP=cap, NUM_SPLITS=splits,
            DOT_FP32=False, DOT_PRECISION="ieee" if dtype == "fp32" else None,
        )  # fmt: skip
        for name in consts:
            sig.setdefault(name, "constexpr")
        label = f"paged_attention {dtype} G{group} D{head_dim} bs{bs} M{block_m} N{tile_n}"
        label += (" tree" if has_mask else "") + (f" splits{splits}" if splits > 1 else "")
        label += (" window" if window else "") + (" softcap" if cap else "")
        out.append((label + (" num_seqs=1" if one_seq else ""), _paged_attention_kernel, sig, consts))
        if splits > 1:
            msig = {
                "out_ptr": ptr, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "num_tokens": "i32",
                "stride_ot": "i32", "stride_oh": "i32", "stride_od": "constexpr",
            }  # fmt: skip
            mconsts = dict(
                stride_od=1, NUM_HEADS=2 * group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=splits,
                SPLITS_PAD=max(2, splits),
            )  # fmt: skip
            for name in mconsts:
                msig.setdefault(name, "constexpr")
            out.append(
                (f"merge_splits {dtype} D{head_dim} splits{splits}", _merge_splits_kernel, msig, mconsts)
            )
    return out


def _other_configs(quick: bool) -> list[Config]:
    from kernels.rejection_sample import _rejection_sample_kernel
    from kernels.reshape_and_cache import _reshape_and_cache_kernel
    from kernels.token_bitmask import _apply_token_bitmask_kernel

    out: list[Config] = []
    for dtype in ("bf16",) if quick else ("bf16", "fp32"):
        ptr = f"*{dtype}"
        sig = {
            "key_ptr": ptr, "value_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "slot_ptr": "*i64",
            "stride_kt": "i32", "stride_kh": "i32", "stride_kd": "constexpr",
            "stride_vt": "i32", "stride_vh": "i32", "stride_vd": "constexpr",
            "stride_cb": "i32", "stride_co": "i32", "stride_ch": "i32", "stride_cd": "constexpr",
        }  # fmt: skip
        consts = dict(
            stride_kd=1, stride_vd=1, stride_cd=1, NUM_KV_HEADS=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK=256
        )
        for name in consts:
            sig.setdefault(name, "constexpr")
        out.append((f"reshape_and_cache {dtype}", _reshape_and_cache_kernel, sig, consts))
        bsig = {"logits_ptr": ptr, "bitmask_ptr": "*i32", "vocab_size": "i32", "stride_lr": "i32",
                "stride_br": "i32", "BLOCK": "constexpr"}  # fmt: skip
        out.append((f"token_bitmask {dtype}", _apply_token_bitmask_kernel, bsig, {"BLOCK": 1024}))
    for has_dp in (True,) if quick else (True, False):
        sig = {
            "out_ptr": "*i64", "draft_ids_ptr": "*i64", "cu_ptr": "*i64", "draft_probs_ptr": "*fp32",
            "target_ptr": "*fp32", "uniforms_ptr": "*fp32", "noise_ptr": "*fp32", "greedy_ptr": "*i1",
            "vocab_size": "i32", "stride_out": "i32", "stride_dp": "i32", "stride_tp": "i32",
            "stride_noise": "i32", "tiny": "fp32",
        }  # fmt: skip
        consts = dict(HAS_DRAFT_PROBS=has_dp, OUT_COLS=5, OUT_PAD=8, BLOCK=1024)
        for name in consts:
            sig.setdefault(name, "constexpr")
        label = f"rejection_sample {'draft-probs' if has_dp else 'deterministic'}"
        out.append((label, _rejection_sample_kernel, sig, consts))
    return out


def compile_all(archs: list[int], quick: bool = False, verbose: bool = True) -> list[str]:
    """Compile every configuration for every ``sm_<arch>``; returns the failures (empty: all compiled).

    Raises:
        RuntimeError: run in interpreter mode (nothing would be compiled).
    """
    from kernels._triton import interpreting

    if interpreting():
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter compiles nothing")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for arch in archs:
        for label, kernel, sig, consts in _attention_configs(quick) + _other_configs(quick):
            t0 = time.perf_counter()
            try:
                src = ASTSource(fn=kernel.jitted, signature=sig, constexprs=consts)
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
                ok = "cubin" in compiled.asm
                status = f"ok ({len(compiled.asm['cubin'])} B cubin, {compiled.metadata.shared} B shared)"
            except Exception as e:  # report every failure, then fail
                ok, status = False, f"FAILED: {type(e).__name__}: {str(e)[:2000]}"
            if not ok:
                failures.append(f"sm_{arch} {label}")
            if verbose:
                print(f"sm_{arch} {label}: {status} [{time.perf_counter() - t0:.1f} s]", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities")
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    args = parser.parse_args(argv)
    failures = compile_all(args.arch, args.quick)
    print("all kernels compiled" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
