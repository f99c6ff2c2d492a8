"""Kernel tests run the Triton kernels themselves: compiled on a CUDA device, else in Triton's CPU
interpreter. Without CUDA this conftest sets ``TRITON_INTERPRET=1`` when pytest collects this package,
before any test imports triton (triton reads the variable when it jits, and jits its own ``tl`` helpers
at import). The variable stays set for the rest of the session; nothing else launches Triton kernels on
a CPU (every dispatcher picks the torch reference for CPU tensors).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels._triton import interpreter_active, triton_available

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="package", autouse=True)
def triton_mode() -> str:
    """ "cuda" or "interpreter"; skips the package where triton is missing."""
    if not triton_available():
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    if not interpreter_active():
        pytest.fail(
            "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set: "
            "run `TRITON_INTERPRET=1 pytest tests/kernels`"
        )
    return "interpreter"


@pytest.fixture(scope="package")
def device(triton_mode) -> torch.device:
    return torch.device("cuda" if triton_mode == "cuda" else "cpu")
