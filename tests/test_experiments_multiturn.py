"""The multi-turn workload (experiments/multiturn.py): deterministic conversations from HumanEval whose
follow-ups quote earlier answers, and the benchmark's table. No model."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.bench_multiturn import format_table
from experiments.multiturn import DEFAULT_HUMANEVAL, load_multiturn, next_messages

HUMANEVAL = Path(__file__).resolve().parents[1] / DEFAULT_HUMANEVAL


@pytest.mark.skipif(not HUMANEVAL.exists(), reason="the shared HumanEval file is absent")
def test_conversations_are_deterministic_and_quote_earlier_answers():
    convs = load_multiturn(str(HUMANEVAL), limit=2, turns=3)
    assert [c.category for c in convs] == ["code_edit", "agent", "code_edit", "agent"]
    assert convs == load_multiturn(str(HUMANEVAL), limit=2, turns=3)
    assert all(c.num_turns == 3 for c in convs)
    agent = convs[1]
    messages = next_messages(agent, ["def f():\n    return 1"])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert "     2\t    return 1" in messages[-1]["content"]  # the tool output repeats the answer
    assert next_messages(agent, ["x"]) == next_messages(agent, ["x"])
    edit = next_messages(convs[0], ["a", "b"])
    assert len(edit) == 5 and edit[2]["content"] != edit[4]["content"]  # two different edits


def test_missing_humaneval_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no HumanEval file"):
        load_multiturn(str(tmp_path / "missing.jsonl.gz"))


def test_table_lists_tau_per_turn_and_the_oracle():
    row = {"tokens_per_s": 10.0, "speedup": 1.0, "tau": 2.0, "tau/agent": 2.5, "exact": True}
    results = {
        "plain": {**row, "tau": None, "tau/agent": None, "per_turn": {}},
        "hybrid": {
            **row,
            "per_turn": {"agent/turn1": 1.5, "agent/turn2": 2.5},
            "hybrid": {
                "members": {"suffix": {"num_chosen": 3, "num_accepted_tokens": 4, "num_draft_tokens": 9,
                                       "hindsight_accepted": 5}},
                "oracle_steps": 4, "oracle_accepted_tokens": 6, "oracle_mean_acceptance_length": 2.5,
            },
        },
    }  # fmt: skip
    table = format_table(results)
    assert "agent/turn1, agent/turn2" in table and "1.50 2.50" in table
    assert "oracle tau 2.50" in table and "alone (hindsight) tau 2.25" in table


def test_benchmarks_take_typed_configs_and_run_without_a_model(tmp_path):
    """Both scripts are harness benchmarks (Hydra overrides, ``ConfigError`` naming the key); the cost
    benchmark runs in-process on a short context: every drafter indexed the prompt and drafted."""
    from experiments import bench_multiturn, bench_suffix_cost
    from specdec.errors import ConfigError

    cfg = bench_multiturn.main.config(["limit=1", "turns=2"])
    assert (cfg.limit, cfg.turns, cfg.methods[0]) == (1, 2, "plain")
    with pytest.raises(ConfigError, match="methods must start with plain"):
        bench_multiturn.main.config(["methods=[ngram,plain]"])
    with pytest.raises(ConfigError, match="methods"):
        bench_multiturn.main.config(["methods=[plain,eagle9]"])
    with pytest.raises(ConfigError, match="turns must be >= 1"):
        bench_multiturn.main.config(["turns=0"])
    # Rows of your own (another k): named, checked before any work, a clash with a built-in name refused.
    k16 = "+extra_methods.suffix16={method: suffix, num_speculative_tokens: 16}"
    cfg = bench_multiturn.main.config(["methods=[plain,ngram,suffix16]", k16])
    assert cfg.extra_methods == {"suffix16": {"method": "suffix", "num_speculative_tokens": 16}}
    with pytest.raises(ConfigError, match="'ngram' is already a method"):
        bench_multiturn.main.config(["+extra_methods.ngram={method: ngram}"])
    bad = "+extra_methods.bad={method: suffix, num_speculative_tokens: 0}"
    with pytest.raises(ConfigError, match="num_speculative_tokens"):  # before HumanEval is looked for
        bench_multiturn.main(["methods=[plain,bad]", bad, f"humaneval={tmp_path / 'absent.jsonl.gz'}"])
    skipped = bench_multiturn.main([f"humaneval={tmp_path / 'absent.jsonl.gz'}"])
    assert {k for k in skipped if k != "run_info"} == set()  # a missing file: nothing run
    with pytest.raises(ConfigError, match="accept must be >= 0"):
        bench_suffix_cost.main.config(["accept=-1"])
    result = bench_suffix_cost.main(["context=512", "steps=5"])
    rows = {k: v for k, v in result.items() if k not in ("run_info", "suffix_index")}
    assert set(rows) == {"ngram", "suffix", "suffix suffix_max_match=8", "hybrid"}
    assert result["suffix_index"] in ("c++", "python")
    assert (
        rows["suffix"]["nodes"] > 512 and rows["suffix suffix_max_match=8"]["nodes"] < rows["suffix"]["nodes"]
    )
    assert all(r["step_ms"] > 0 for r in rows.values())
