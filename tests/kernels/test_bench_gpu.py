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
    assert sections == {"ceiling", "check", "kernel", "engine"}
    checks = [r for r in data["rows"] if r["section"] == "check"]
    assert len(checks) >= 10 and all(r["ok"] for r in checks)
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("all checks passed") and "## engine" in printed
