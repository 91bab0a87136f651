"""The analyzer's error types, in one module that imports nothing.

Two kinds of error, told apart by who reads the message:

* :class:`DistdiagError` reaches the user: a problem they must fix (a run dir
  with no rank files, a config file that does not parse). The CLI prints its
  one-line message and exits 2, without a traceback.
* The others say why one input of a run cannot be used (a rank's spill log, a
  profiler trace, the Slurm accounting). The reader that raised one catches
  it, names the file or the job, and the analysis goes on without that input:
  the reason becomes one line in ``run.warnings`` or the report, never an exit.

The shim has its own errors (:mod:`distdiag.shim.wrap`, :mod:`distdiag.shim.spill`):
it never imports the analyzer.
"""

from __future__ import annotations

#: the exit code of an expected mistake (a wrong path, a bad config, an unwritable output): one line, no traceback
EXIT_USAGE = 2


class DistdiagError(Exception):
    """A problem the user must fix; the message is one line meant for them (no traceback)."""


class SpillLogError(Exception):
    """A rank's spill log that cannot be used (the reason in one line)."""


class TraceError(Exception):
    """A trace file that cannot be used: the message is one line, the caller adds the file."""


class SlurmError(Exception):
    """Accounting could not be read; the message is one line for the user."""
