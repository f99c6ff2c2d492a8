"""Every kernel compiles for sm_90 (Hopper) without a GPU, in the configurations the launchers use and
with Triton's launch-time specialisations: the interpreter alone would not catch a kernel that the
compiler rejects. Runs in a subprocess, without ``TRITON_INTERPRET``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_kernel_compiles_for_sm90():
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all kernels compiled" in proc.stdout
