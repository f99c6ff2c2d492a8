"""The CPU GEMV kernel (``kernels/csrc/cpu_gemv.cpp``) against its reference, ``F.linear``.

Every row count from 1 to ``MAX_ROWS``, float32 and bfloat16 weights and inputs, with and without bias,
``K`` a multiple of the 16-wide vector loop and not (the scalar tail), odd ``N`` (the thread split);
then the dispatch rules and the op under ``torch.compile``. Skipped where the kernel does not build
(no compiler or ``ninja``): the reference then serves, which the last test checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemv

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason="the CPU GEMV kernel does not build here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (37, 576), (130, 45), (300, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_reference(dtype, n, k, with_bias):
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    assert cpu_gemv.cpu_gemv(torch.empty(0, k).to(dtype), w, b).shape == (0, n)  # no rows
    for m in range(1, cpu_gemv.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g).to(dtype)
        got = cpu_gemv.cpu_gemv(x, w, b)
        assert got.dtype == dtype and got.shape == (m, n)
        # float32 accumulation in both, in another order: float32 to rounding; bfloat16 outputs are the
        # float32 result rounded once, so within one bfloat16 step of F.linear's float32 result.
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("bf16_dot", [False, True], ids=["avx2", "avx512-bf16"])
@pytest.mark.parametrize("k", [45, 100, 576])
def test_bfloat16_paths_equal_reference(bf16_dot, k):
    """Both bfloat16 x bfloat16 paths (the AVX-512 BF16 dot-product kernel where this CPU has it, the AVX2
    one always) against F.linear in float32: K with a masked tail, rows 1-17, 25 and 40 (passes), inputs
    with a row stride wider than K (a view), bias in bfloat16."""
    if bf16_dot and not cpu_gemv.bf16_dot():
        pytest.skip("this CPU has no AVX512_BF16 (or the extension was built without it)")
    built = cpu_gemv.bf16_dot()
    try:
        assert cpu_gemv.bf16_dot(bf16_dot) == bf16_dot
        g = torch.Generator().manual_seed(k)
        w = (torch.randn(37, k, generator=g) * 0.05).bfloat16()
        b = torch.randn(37, generator=g).bfloat16()
        for m in [*range(1, 18), 25, 40]:
            x = torch.randn(m, k + 7, generator=g).bfloat16()[:, 3 : 3 + k]  # row stride k + 7
            got = cpu_gemv.cpu_gemv(x, w, b)
            want = F.linear(x.float(), w.float(), b.float())
            assert got.dtype == torch.bfloat16 and got.shape == (m, 37)
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)
    finally:
        cpu_gemv.bf16_dot(built)


@needs_kernel
def test_dispatch_rules():
    w = torch.randn(8, 32)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_gemv.gemv(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        wide = torch.randn(cpu_gemv.MAX_ROWS + 1, 32)
        assert torch.equal(cpu_gemv.gemv(wide, w), F.linear(wide, w))  # wider float32 inputs: the reference
        wide_bf16, w_bf16 = torch.randn(40, 32).bfloat16(), w.bfloat16()
        if cpu_gemv.max_rows(torch.bfloat16) > 40:  # no oneDNN bfloat16 here: the kernel at any width
            want = F.linear(wide_bf16.float(), w_bf16.float())
            torch.testing.assert_close(cpu_gemv.gemv(wide_bf16, w_bf16).float(), want, rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(cpu_gemv.gemv(wide_bf16, w_bf16), F.linear(wide_bf16, w_bf16))
        rows17 = torch.randn(17, 32).bfloat16()  # a 16-node tree and its root
        if cpu_gemv.bf16_dot():  # the AVX-512 BF16 kernel takes trees of 16 nodes and their root
            assert cpu_gemv.max_rows(torch.bfloat16) >= 17
            assert torch.equal(cpu_gemv.gemv(rows17, w_bf16), cpu_gemv.cpu_gemv(rows17, w_bf16, None))
        batched = torch.randn(2, 3, 32)  # leading dimensions are flattened and restored
        assert cpu_gemv.gemv(batched, w).shape == (2, 3, 8)
    x.requires_grad_(True)
    y = cpu_gemv.gemv(x, w)  # autograd on: the reference, so gradients flow
    y.sum().backward()
    assert x.grad is not None


@needs_kernel
def test_op_under_torch_compile():
    w = torch.randn(24, 48)
    cpu_gemv.cpu_gemv(torch.randn(1, 48), w, None)  # builds / loads the kernel (outside the trace)
    op = torch.ops.specdec_cpu.gemv
    f = torch.compile(lambda x: torch.relu(op(x, w, None)), backend="eager", fullgraph=True)
    x = torch.randn(4, 48)
    torch.testing.assert_close(f(x), torch.relu(F.linear(x, w)), rtol=1e-5, atol=1e-5)


def test_disabled_kernel_falls_back_to_the_reference(monkeypatch):
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    with torch.inference_mode():
        assert torch.equal(cpu_gemv.gemv(x, w, use_kernel=False), F.linear(x, w))
    monkeypatch.setenv("SPECDEC_FORCE_REFERENCE", "1")
    assert not cpu_gemv.available()


@needs_kernel
@pytest.mark.parametrize("name", ["llama-gqa3-tied", "qwen2-gqa2-untied"])
def test_engine_tokens_unchanged_by_the_kernel(name, tiny_model_dirs, monkeypatch, fast_cpu_settings):
    """float32 greedy tokens and logprobs (1e-4) with :class:`GemvLinear` equal plain ``nn.Linear``."""
    from sampling import SamplingParams
    from specdec import LLM
    from specdec.models.cpu_linear import GemvLinear

    prompts = [{"prompt_token_ids": [5, 9, 11 + i, 40, 7][: 3 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)

    def run(kernel: bool):
        monkeypatch.setenv("SPECDEC_CPU_GEMV", "1" if kernel else "0")
        llm = LLM(tiny_model_dirs[name], dtype="float32", skip_tokenizer_init=True)
        n = sum(isinstance(m, GemvLinear) for m in llm.engine.model.modules())
        assert n == (4 * llm.engine.model.cfg.num_layers + 1 if kernel else 0)
        return [o.outputs[0] for o in llm.generate(prompts, params)]

    for got, want in zip(run(True), run(False)):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            for t in a.keys() & b.keys():
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    # torch's extension builder waits forever on a lock left by a killed build (seen in CI here).
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory

    from kernels.cpu_ext import STALE_LOCK_S, clear_stale_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory("specdec_lock_test", verbose=False)) / "lock"
    lock.write_text("")
    assert not clear_stale_lock("specdec_lock_test") and lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock("specdec_lock_test") and not lock.exists()


@pytest.fixture(params=["onednn", "amx", "tiles"])
def packing(request):
    """Packed weights of one kind: oneDNN's layout and GEMM, the AMX kernel's tile order, or the AVX-512
    BF16 kernel's pair-major tile order (each skipped where the CPU or the build lacks it); the process's
    choice is restored afterwards."""
    from kernels.cpu_ext import require_extension

    if not cpu_gemv.available():
        pytest.skip("the CPU GEMV kernel does not build here")
    ext = require_extension()
    was_amx, was_tiles = ext.has_amx(), ext.has_tiles()
    amx_on = ext.set_amx(request.param == "amx")
    tiles_on = ext.set_tiles(request.param != "onednn")
    try:
        if request.param == "amx" and not amx_on:
            pytest.skip("no AMX on this CPU (or the kernels were built without it)")
        if request.param == "tiles" and not tiles_on:
            pytest.skip("no AVX512_BF16 on this CPU (or the kernels were built without it)")
        if request.param == "onednn" and tiles_on:
            pytest.skip("the tile order cannot be switched off here")
        yield request.param
    finally:
        ext.set_amx(was_amx)
        ext.set_tiles(was_tiles)


def test_packed_rule_and_packed_linear_layers(packing):
    """The rows rule (C++, shared with the layer stack): oneDNN's packed GEMM from 12 rows and from 5 on
    wide matrices, the tile kernels (AMX, AVX-512 BF16) for every row count; a bfloat16 GemvLinear with a
    packed copy takes the path the rule names, within one bfloat16 rounding of F.linear in float32, with and
    without bias, and beyond the kernel's rows (a prefill chunk); float32 layers get no packed copy."""
    from specdec.models.cpu_linear import GemvLinear, use_packed_weights

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bfloat16 path on this CPU")
    onednn = cpu_gemv.onednn_rows
    assert not any(onednn(m, 4096, 4096) for m in range(1, 5))
    assert onednn(5, 2048, 64) and onednn(5, 64, 1024) and not onednn(11, 960, 576) and onednn(12, 960, 576)
    rule = cpu_gemv.packed_rows
    for m, n, k in [(1, 960, 576), (2, 576, 576), (5, 960, 576), (5, 2048, 64), (11, 960, 576), (12, 8, 8)]:
        assert rule(m, n, k) == (True if packing != "onednn" else onednn(m, n, k))
    assert cpu_gemv.amx() == (packing == "amx")
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(1024, 2048, bias=bias).bfloat16()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(2048, 1024, generator=g) * 0.03)
        model = torch.nn.Sequential(GemvLinear(lin))
        assert use_packed_weights(model) == 1 and model[0].packed is not None
        assert (model[0].packed.dim() == 5) == (packing != "onednn")  # tile order [G, KB, 4 | 16, 16 | 4, 32]
        for m in (1, 2, 4, 5, 12, 40):
            x = torch.randn(m, 1024, generator=g).bfloat16()
            with torch.inference_mode():
                got = model[0](x)
            assert model[0]._use_packed[m] == (m > cpu_gemv.max_rows(torch.bfloat16) or rule(m, 2048, 1024))
            want = torch.nn.functional.linear(
                x.float(), lin.weight.float(), None if not bias else lin.bias.float()
            )
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2e-3)
    assert use_packed_weights(torch.nn.Sequential(GemvLinear(torch.nn.Linear(8, 8)))) == 0


@pytest.mark.parametrize(("n", "k"), [(5, 7), (70, 40), (130, 576), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tile_kernels_equal_reference(packing, n, k, with_bias):
    """The AMX kernel (``csrc/cpu_gemv_amx.h``) and the AVX-512 BF16 one on the pair-major tile order
    (``csrc/cpu_gemv_bf16tiles.h``): the C++ packing equals the torch reference of the tile layout element
    for element (zero padding past N and K included), and its products equal F.linear's float32 result
    within one bfloat16 rounding for 1-64 rows (one tile of rows, several, a ragged last one read from its
    padded copy), N and K off the tile sizes, with and without bias; at least 99 % of outputs are exactly
    the float32 result rounded once (the rest straddle a rounding boundary: the sums' order differs)."""
    from kernels.cpu_ext import require_extension

    if packing == "onednn":
        pytest.skip("the tile kernels only")
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = cpu_gemv.pack_weight(w)
    pair_major = packing == "tiles"
    ref_packed = cpu_gemv.pack_tiles_reference(w, pair_major)
    tile = (16, 4) if pair_major else (4, 16)
    assert packed.shape == (-(-n // 64), -(-k // 32), *tile, 32) and torch.equal(packed, ref_packed)
    assert torch.equal(require_extension().pack_tiles(w), packed)
    for m in (1, 2, 3, 5, 16, 17, 32, 40, 48, 53, 64):
        x = torch.randn(m, k, generator=g).bfloat16()
        got = cpu_gemv.linear_packed(x, w, packed, b)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)
        assert (got == want.bfloat16()).float().mean() >= 0.99
    assert cpu_gemv.linear_packed(torch.empty(0, k).bfloat16(), w, packed, b).shape == (0, n)  # no rows
    with pytest.raises(RuntimeError, match="linear_packed"):
        cpu_gemv.linear_packed(torch.randn(2, k + 32).bfloat16(), torch.empty(n, k + 32).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="pack_tiles"):
        require_extension().pack_tiles(w.float())


def test_packed_logits_equal_the_widened_bfloat16_product(packing):
    """``linear_packed_logits`` (an LM head's float32 logits; on AMX the kernel widens as it stores) equals
    ``linear_packed(...).float()`` bit for bit: 1-53 rows (one block of 16, several, a ragged last one), N
    off the tile size, with and without bias, for every packing (tile orders and oneDNN's); and a packed
    ``GemvLinear``'s ``forward_float32`` equals its ``forward`` widened, as the LM head's logits use it."""
    from specdec.models.cpu_linear import GemvLinear, use_packed_weights

    if packing == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bfloat16 path on this CPU")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(1000, 576, generator=g) * 0.05).bfloat16()
    b = torch.randn(1000, generator=g).bfloat16()
    packed = cpu_gemv.pack_weight(w)
    for m in (0, 1, 5, 16, 17, 40, 53):
        x = torch.randn(m, 576, generator=g).bfloat16()
        for bias in (None, b):
            got = cpu_gemv.linear_packed_logits(x, w, packed, bias)
            assert got.dtype == torch.float32 and got.shape == (m, 1000)
            assert torch.equal(got, cpu_gemv.linear_packed(x, w, packed, bias).float())
    lin = torch.nn.Linear(576, 1000, bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(w)
    head = GemvLinear(lin)
    assert use_packed_weights(torch.nn.Sequential(head)) == 1
    for m in (1, 5, 40):
        x = torch.randn(m, 576, generator=g).bfloat16()
        with torch.inference_mode():
            assert torch.equal(head.forward_float32(x), head(x).float())


def test_tile_kernel_rows_are_batch_invariant(packing):
    """Each output row of the tile kernels (AMX, AVX-512 BF16) is summed in an order that does not depend on
    the other rows: a row multiplied among 1-70 rows (one block of 16, several, a ragged last one) equals
    the same row multiplied alone, bit for bit (so a verification row gets a decode row's logits, and
    greedy speculative decoding equals greedy plain decoding in bfloat16)."""
    if packing == "onednn":
        pytest.skip("the tile kernels only")
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(300, 576, generator=g) * 0.05).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    packed = cpu_gemv.pack_weight(w)
    x = torch.randn(70, 576, generator=g).bfloat16()
    alone = torch.cat([cpu_gemv.linear_packed(x[i : i + 1], w, packed, b) for i in range(70)])
    for m in (2, 5, 16, 17, 32, 40, 48, 53, 70):
        assert torch.equal(cpu_gemv.linear_packed(x[:m], w, packed, b), alone[:m])


def test_the_extension_loads_once_per_process(monkeypatch):
    """Every kernel call asks for the extension (``enabled`` / ``require_extension``): it must come from a
    cache, not from ``torch.utils.cpp_extension.load`` again (which re-imports the module, ~0.26 ms a call:
    a lost ``functools.cache`` once doubled EAGLE-3's draft step)."""
    import torch.utils.cpp_extension as cpp_extension

    from kernels import cpu_ext

    first = cpu_ext.load_extension()
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: calls.append(a))
    for _ in range(3):
        assert cpu_ext.load_extension() is first
        cpu_ext.enabled("SPECDEC_CPU_GEMV")
    assert calls == []
