"""Huge pages for the engine's weights (specdec.engine.huge_pages): the same bytes at the same addresses,
the same outputs, and clear errors for bad settings."""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.engine import huge_pages
from specdec.engine.huge_pages import HUGE_PAGE, check_huge_pages, collapse_engine, collapse_tensors, wanted
from specdec.errors import ConfigError
from tests.conftest import make_tiny_hf_model


def test_collapse_keeps_every_byte_and_address():
    t = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.float32)  # 6 MiB: at least two whole windows
    before, ptr = t.clone(), t.data_ptr()
    small = torch.ones(16)  # under MIN_STORAGE: not visited
    stats = collapse_tensors([t, t[5:], small])
    assert t.data_ptr() == ptr and torch.equal(t, before)
    if stats.reason:
        pytest.skip(f"huge pages not available here: {stats.reason}")
    assert stats.storages == 1  # a view of the same storage is visited once
    # Every 2 MiB window the storage touches is asked for once: collapsed, or refused by the kernel.
    first = ptr // HUGE_PAGE * HUGE_PAGE
    windows = len(range(first, ptr + t.untyped_storage().nbytes(), HUGE_PAGE))
    assert stats.collapsed_bytes + stats.refused_bytes == windows * HUGE_PAGE


def _huge_kib_at(addr: int) -> int | None:
    """``AnonHugePages`` (KiB) of the mapping holding ``addr`` in ``/proc/self/smaps``; None off Linux."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def test_zeros_on_huge_pages_are_zeros_faulted_onto_huge_pages():
    shape = (3 * HUGE_PAGE // 64, 32)  # 6 MiB of bfloat16: at least two whole windows
    small = huge_pages.zeros_on_huge_pages((3, 5), torch.float32)  # under a huge page: torch.zeros
    assert small.shape == (3, 5) and not small.any()
    lazy = huge_pages.zeros_on_huge_pages(shape, torch.bfloat16, populate=False)
    assert lazy.data_ptr() % HUGE_PAGE == 0 or huge_pages._unavailable()  # from a 2 MiB boundary
    checkable = not huge_pages._unavailable() and _huge_kib_at(lazy.data_ptr()) is not None
    if checkable:
        with open(huge_pages._THP + "enabled") as f:
            checkable = "[madvise]" in f.read()  # else nothing to ask for
    if checkable:
        assert _huge_kib_at(lazy.data_ptr()) == 0  # nothing written yet: nothing resident
        lazy.fill_(1)  # the first write faults it in (a fragmented host may refuse some: at least one)
        assert _huge_kib_at(lazy.data_ptr()) * 1024 >= HUGE_PAGE
    del lazy  # unmapped: its pages are not counted with the next mapping's (adjacent mappings merge)
    t = huge_pages.zeros_on_huge_pages(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16
    assert t.data_ptr() % HUGE_PAGE == 0 or huge_pages._unavailable()
    if not checkable:
        assert not t.any()
        pytest.skip("huge pages (madvise mode) or /proc/self/smaps not available here")
    # Populated at allocation: resident on huge pages now, not when a step first writes it.
    assert _huge_kib_at(t.data_ptr()) * 1024 >= HUGE_PAGE
    assert not t.any()


def test_the_kv_pool_goes_on_huge_pages_with_the_weights(tmp_path, monkeypatch):
    calls = []

    def zeros(shape, dtype):
        calls.append((tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr("specdec.engine.build.zeros_on_huge_pages", zeros)
    make_tiny_hf_model("llama", 4, 2, False, vocab_size=256).save_pretrained(tmp_path / "m")
    on = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, huge_pages=True, num_kv_blocks=8)
    layers = on.engine.model_cfg.num_layers
    assert len(calls) == 2 * layers  # each layer's K and V
    assert calls[0] == (tuple(on.engine.runner.kv_caches[0][0].shape), on.engine.runner.kv_caches[0][0].dtype)
    LLM(str(tmp_path / "m"), skip_tokenizer_init=True, huge_pages=False, num_kv_blocks=8)
    assert len(calls) == 2 * layers  # huge_pages=False: torch.zeros
    monkeypatch.undo()  # the real allocation: a pool of 4 MiB a cache, decoding as on 4 KiB pages
    prompts = [{"prompt_token_ids": [1, 5 + i, 30 + 7 * i, 200 - i]} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for on in (True, False):
        llm = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, huge_pages=on, num_kv_blocks=4096)
        k_cache = llm.engine.runner.kv_caches[0][0]
        assert k_cache.untyped_storage().nbytes() >= 2 * HUGE_PAGE
        if on and not huge_pages._unavailable():
            assert k_cache.data_ptr() % HUGE_PAGE == 0  # our mapping, from a 2 MiB boundary
            with open(huge_pages._THP + "enabled") as f:
                madvise_mode = "[madvise]" in f.read()
            huge = _huge_kib_at(k_cache.data_ptr())
            if madvise_mode and huge is not None:  # written at build: resident before any step
                assert huge * 1024 >= HUGE_PAGE
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])
    with pytest.raises(ConfigError, match="kv_huge_pages must be a bool"):
        from specdec.config import CacheConfig

        CacheConfig(kv_huge_pages="yes")


def test_opaque_and_small_tensors_are_skipped_without_error():
    opaque = torch.randn(1024, 1024).to_mkldnn()  # oneDNN's own layout: no plain storage to ask for
    stats = collapse_tensors([opaque, torch.ones(16)])
    assert stats.storages == 0 and stats.collapsed_bytes == 0 and stats.refused_bytes == 0


def test_it_never_raises_and_says_why(monkeypatch):
    t = torch.ones(HUGE_PAGE // 2)  # 2 huge pages of float32 at least partly
    monkeypatch.setattr(huge_pages, "_unavailable", lambda: "")
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)  # a C library without madvise
    assert collapse_tensors([t]).reason == "no madvise in the C library"
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda addr, n, advice: -1)
    monkeypatch.setattr(huge_pages, "_errno", lambda: 22)  # EINVAL: a kernel before 6.1
    stats = collapse_tensors([t])
    assert "MADV_COLLAPSE" in stats.reason and stats.collapsed_bytes == 0
    monkeypatch.setattr(huge_pages, "_errno", lambda: 11)  # EAGAIN: memory it cannot compact now
    stats = collapse_tensors([t])
    assert stats.reason == "" and stats.refused_bytes >= HUGE_PAGE and stats.collapsed_bytes == 0
    assert "AttributeError" in collapse_engine(object()).reason  # anything unexpected: reported, not raised


def test_the_walk_takes_weights_and_packed_copies_not_kv_caches():
    from types import SimpleNamespace

    linear = torch.nn.Linear(4, 4)
    linear.packed = torch.zeros(4, 4)  # a packed copy held as a plain attribute
    kv = (torch.zeros(8), torch.zeros(8))
    draft_runner = SimpleNamespace(model=torch.nn.Linear(2, 2), kv_caches=[(torch.zeros(8), torch.zeros(8))])
    drafter = SimpleNamespace(head=linear, kv_cache=kv, runner=draft_runner, states={"r": torch.zeros(3)})
    found = {id(t) for t in huge_pages._tensors_in(drafter, set(), 4)}
    assert {id(linear.weight), id(linear.bias), id(linear.packed), id(draft_runner.model.weight)} <= found
    assert not found & {id(t) for t in (*kv, *draft_runner.kv_caches[0])}


@pytest.mark.parametrize("bad", ["yes", 1, None, "on"])
def test_a_bad_setting_is_a_config_error_naming_the_field(bad, tmp_path):
    with pytest.raises(ConfigError, match="huge_pages"):
        check_huge_pages(bad)
    with pytest.raises(ConfigError, match="huge_pages"):  # before anything loads: the path does not exist
        LLM(str(tmp_path / "missing"), huge_pages=bad)


def test_auto_follows_the_environment_and_the_device(monkeypatch):
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    assert not wanted("auto", torch.device("cpu"))
    assert wanted(True, torch.device("cpu"))
    for off in ("false", "OFF", "no"):
        monkeypatch.setenv("SPECDEC_HUGE_PAGES", off)
        assert not wanted("auto", torch.device("cpu"))
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "1")
    assert wanted("auto", torch.device("cpu"))
    assert not wanted(False, torch.device("cpu"))
    assert not wanted(True, torch.device("cuda"))


def test_an_engine_on_huge_pages_decodes_the_same_tokens(tmp_path):
    model = make_tiny_hf_model("llama", 4, 2, False, vocab_size=8192)  # 2 MiB embedding and LM head
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    prompts = [{"prompt_token_ids": [1, 17 + i, 300 + 7 * i, 4000 - i]} for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for on in (False, True):
        llm = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, huge_pages=on, num_kv_blocks=64)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        if not on:
            assert llm.huge_pages is None
        elif not llm.huge_pages.reason:
            assert llm.huge_pages.storages >= 2  # the embedding and the LM head at least
            assert llm.huge_pages.collapsed_bytes + llm.huge_pages.refused_bytes >= 2 * HUGE_PAGE
    assert outs[True] == outs[False]
    assert all(len(o) == 16 for o in outs[True])


def test_the_cli_and_hydra_turn_it_off_by_name():
    from experiments.config import EngineConfig, ModelConfig
    from specdec.cli import build_parser

    assert build_parser().parse_args(["generate"]).huge_pages is True
    assert build_parser().parse_args(["generate", "--no-huge-pages"]).huge_pages is False
    model = ModelConfig("m")
    assert EngineConfig().llm_kwargs(model)["huge_pages"] == "auto"
    assert EngineConfig(huge_pages=False).llm_kwargs(model)["huge_pages"] is False
