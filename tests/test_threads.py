"""The engine's CPU thread policy (:mod:`specdec.engine.threads`): the count it picks for a measured load,
its sampling of ``/proc`` (faked here: the numbers are exact), the fixed and untouched modes, the
recovery when the other process ends, validation, and the wiring through ``LLM`` (greedy output equal
under every setting)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import threads as threads_mod
from specdec.engine.threads import ThreadPolicy, check_threads
from specdec.errors import ConfigError


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
    threads_mod._last_set = None


@pytest.fixture
def fake_proc(monkeypatch):
    """A 2-core machine whose /proc counters the test advances: ``state`` = busy ticks of all
    processes, our own ticks, and the monotonic clock (100 ticks per second)."""
    state = {"busy": 0, "own": 0, "now": 1000.0}
    monkeypatch.setattr(threads_mod, "_allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads_mod, "_busy_ticks", lambda cpus: state["busy"])
    monkeypatch.setattr(threads_mod, "_own_ticks", lambda: state["own"])
    monkeypatch.setattr(threads_mod.time, "monotonic", lambda: state["now"])
    monkeypatch.setattr(threads_mod.os, "sysconf", lambda name: 100)

    def advance(seconds: float, ours: float, others: float) -> None:
        """``seconds`` pass with ``ours`` and ``others`` cores busy."""
        state["now"] += seconds
        state["own"] += round(ours * seconds * 100)
        state["busy"] += round((ours + others) * seconds * 100)

    return advance


def test_threads_for_load(fake_proc, restore_threads):
    policy = ThreadPolicy("auto", max_threads=2)
    assert [policy.threads_for(x) for x in (0.0, 0.4, 0.6, 1.0, 1.4, 1.6, 2.0, 3.0)] == [
        2,
        2,
        1,
        1,
        1,
        1,
        1,
        1,
    ]
    capped = ThreadPolicy("auto", max_threads=1)
    assert capped.threads_for(0.0) == 1


def test_auto_follows_the_other_process_and_recovers(fake_proc, restore_threads):
    torch.set_num_threads(2)
    policy = ThreadPolicy("auto", interval_s=0.5)
    assert policy.max_threads == 2
    fake_proc(0.6, ours=2.0, others=0.0)  # idle machine: stays at 2
    policy.step()
    assert torch.get_num_threads() == 2 and policy.history == []
    fake_proc(0.6, ours=1.0, others=1.0)  # one busy sample between idle ones: no change
    policy.step()
    fake_proc(0.6, ours=2.0, others=0.0)
    policy.step()
    assert torch.get_num_threads() == 2 and policy.history == []
    fake_proc(0.6, ours=1.0, others=1.0)  # a competitor takes a core: one sample is not enough...
    policy.step()
    assert torch.get_num_threads() == 2
    fake_proc(0.6, ours=1.0, others=1.0)  # ...two in a row are: down to 1
    policy.step()
    assert torch.get_num_threads() == 1 and policy.history == [1]
    fake_proc(0.2, ours=1.0, others=0.0)  # within interval_s: no new sample
    policy.step()
    assert policy.history == [1]
    fake_proc(0.6, ours=1.0, others=0.0)  # the competitor ended: back to 2
    policy.step()
    assert torch.get_num_threads() == 2 and policy.history == [1, 2]
    # A later engine in this process starts from the original maximum even after a lowered count.
    for _ in range(2):
        fake_proc(0.6, ours=1.0, others=1.0)
        policy.step()
    assert torch.get_num_threads() == 1
    assert ThreadPolicy("auto").max_threads == 2


def test_fixed_and_untouched(fake_proc, restore_threads):
    torch.set_num_threads(2)
    fixed = ThreadPolicy(1)
    assert torch.get_num_threads() == 1 and fixed.history == [1]
    fake_proc(1.0, ours=0.0, others=0.0)
    fixed.step()
    assert torch.get_num_threads() == 1  # a fixed count never changes
    torch.set_num_threads(2)
    untouched = ThreadPolicy(None)
    fake_proc(1.0, ours=0.0, others=2.0)
    untouched.step()
    assert torch.get_num_threads() == 2


def test_without_proc_auto_keeps_the_count(monkeypatch, restore_threads):
    monkeypatch.setattr(threads_mod, "_busy_ticks", lambda cpus: None)
    torch.set_num_threads(2)
    policy = ThreadPolicy("auto", interval_s=0.0)
    policy.step()
    assert torch.get_num_threads() == 2 and policy.history == []


def test_real_proc_sample_is_sane(restore_threads):
    policy = ThreadPolicy("auto", interval_s=0.0)
    sum(i * i for i in range(200_000))  # some CPU time of our own, which must not count as "others"
    others = policy._sample(threads_mod.time.monotonic())
    if others is None:
        pytest.skip("no /proc here")
    assert 0.0 <= others <= len(threads_mod._allowed_cpus()) + 0.5


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "fast", [2]])
def test_bad_values(bad):
    with pytest.raises(ConfigError, match="cpu_threads"):
        check_threads(bad)


def test_llm_wiring(tiny_model_dirs, restore_threads):
    tiny_llama_dir = tiny_model_dirs["llama-gqa3-tied"]
    from specdec import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = {"prompt_token_ids": [1, 5, 9, 13]}
    outs = []
    for setting in ("auto", 1, None):
        llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, cpu_threads=setting)
        assert (llm.engine.threads is None) == (setting is None)
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(ConfigError, match="cpu_threads"):
        LLM(tiny_llama_dir, skip_tokenizer_init=True, cpu_threads=0)
