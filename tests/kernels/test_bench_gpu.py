"""The prepared GPU script runs end to end in ``--smoke`` mode (tiny sizes; on a CPU in Triton's
interpreter), with every correctness check passing and every section reported."""

from __future__ import annotations

import json

from experiments.bench_gpu import main


def test_smoke_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["failures"] == []
    sections = {r["section"] for r in data["rows"]}
    assert sections == {"ceiling", "check", "kernel", "engine", "llm", "profile"}
    llm = {r["case"]: r for r in data["rows"] if r["section"] == "llm"}
    # The engine's rows and the peer's (transformers, eager) all ran, and n-gram lookup found drafts in
    # the repeated prompts (its tau above 1).
    assert {"tiny plain b1 graphs=off", "tiny eagle b2 graphs=off", "transformers tiny eager b2"} <= set(llm)
    assert all("error" not in r for r in llm.values())
    assert llm["tiny ngram b1 graphs=off"]["tau"] > 1.0
    checks = [r for r in data["rows"] if r["section"] == "check"]
    assert len(checks) >= 10 and all(r["ok"] for r in checks)
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("all checks passed") and "## engine" in printed and "## llm" in printed
