"""The real-GPU tests' fixtures (their helpers: tests/rigs/gpu.py)."""

from __future__ import annotations

import pytest

from ..rigs.gpu import mps_processes, skip_without_real_gpu_and_mps
from ..rigs.waits import poll


@pytest.fixture
def real_gpu_and_mps():
    """Skip without a driver or without NVIDIA's own MPS control; after the test, no MPS process
    left that was not there before it."""
    skip_without_real_gpu_and_mps("the GPU tests")
    before = set(mps_processes())
    yield
    poll(lambda: set(mps_processes()) <= before, 10.0, lambda: f"no MPS process left: {set(mps_processes()) - before}")
