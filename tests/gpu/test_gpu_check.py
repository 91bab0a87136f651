"""The device check of issue 22 (benchmarks/gpu_check.py) as a test: only where a CUDA GPU answers.

Skipped on machines without one (every CI machine of this project so far). On a
GPU it runs the whole check once (~3-5 minutes on an H200) and fails with the
script's own numbers when a check fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "gpu_check.py"


def test_device_check_passes() -> None:
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
