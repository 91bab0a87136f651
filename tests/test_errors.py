"""distdiag.errors: one module for the analyzer's error types, importable without the analyzer."""

from __future__ import annotations

import subprocess
import sys


def test_the_old_import_paths_name_the_same_classes() -> None:
    import distdiag.kineto
    import distdiag.run
    import distdiag.slurm
    from distdiag import errors

    # an `except DistdiagError` written against either module catches what the other raises
    assert distdiag.run.DistdiagError is errors.DistdiagError
    assert distdiag.kineto.TraceError is errors.TraceError
    assert distdiag.slurm.SlurmError is errors.SlurmError


def test_config_and_cli_import_no_loader() -> None:
    # config raised DistdiagError from distdiag.run, which pulled the loader (and numpy)
    # into every `distdiag --help`; the error type now costs one tiny module
    code = ("import sys, distdiag.cli, distdiag.config; "
            "print(sorted(m for m in ('numpy', 'distdiag.run') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

