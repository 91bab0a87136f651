"""``python -m distdiag.wrap script.py args...``: the wrapper as a module.

For launchers that run ``python -m <module>``, e.g.
``torchrun --nproc-per-node 4 -m distdiag.wrap train.py``. Same options and
behaviour as ``distdiag-wrap`` (see :mod:`distdiag.shim.wrap`); ``python`` may
be left out before the script.
"""

from __future__ import annotations

import sys

from distdiag.shim.wrap import main

if __name__ == "__main__":
    sys.exit(main())
