"""Huge pages for the engine's weights (specdec.engine.huge_pages): the same bytes at the same addresses,
the same outputs, and clear errors for bad settings."""

from __future__ import annotations

import pytest
import torch

from sampling.params import SamplingParams
from specdec import LLM
from specdec.engine.huge_pages import HUGE_PAGE, check_huge_pages, collapse_tensors, wanted
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
