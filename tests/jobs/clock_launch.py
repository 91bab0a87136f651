"""Per-rank clock skew for tests: ``clock_launch.py SPEC0 SPEC1 ... -- cmd args...``.

Run by a launcher (``mpiexec -n 4 python clock_launch.py ...``, or one process
per rank with ``RANK`` set); finds its rank in the environment and replaces
itself with ``faketime -f SPEC[rank] cmd args...`` (libfaketime shifts and
scales every clock the process reads: perf_counter_ns included). An empty
spec (``""``) runs ``cmd`` with the true clock.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("usage: clock_launch.py SPEC... -- cmd args...")
    cut = argv.index("--")
    specs, cmd = argv[:cut], argv[cut + 1 :]
    rank = -1
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").strip().isdigit():
            rank = int(os.environ[name])
            break
    spec = specs[rank % len(specs)] if rank >= 0 and specs else ""
    if spec:
        # faketime forks the command and waits: file descriptors (PMI_FD) and the environment pass through
        os.execvp("faketime", ["faketime", "-f", spec, *cmd])
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
