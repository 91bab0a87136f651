"""A torchrun entry point for tests/test_shim_relaunch.py: ``python -m distdiag.wrap ARGS``,
with rank 0 starting ``$LATE_RANK0_S`` seconds (default 1) after the others, as on a slow node.

The wrapper replaces this process (``os.execv``): same pid, parent and environment, so the
ranks are torchrun's workers as they would be with ``torchrun -m distdiag.wrap ARGS``."""

import os
import sys
import time

if os.environ.get("RANK") == "0":
    time.sleep(float(os.environ.get("LATE_RANK0_S", "1.0")))
os.execv(sys.executable, [sys.executable, "-m", "distdiag.wrap", *sys.argv[1:]])
