"""Per-rank clock skew for tests: ``clock_launch.py SPEC0 SPEC1 ... -- cmd args...``.

Run by a launcher (``mpiexec -n 4 python clock_launch.py ...``, or one process
per rank with ``RANK`` set); finds its rank in the environment and replaces
itself with ``cmd args...`` under libfaketime with ``FAKETIME=SPEC[rank]``
(as ``faketime -f SPEC`` would: every clock the process reads, perf_counter_ns
included, is shifted and scaled). An empty spec (``""``) runs ``cmd`` with the
true clock.
"""

from __future__ import annotations

import os
import sys

#: where Debian's libfaketime puts the library the faketime tool preloads
LIBFAKETIME = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)


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
        lib = next((p for p in LIBFAKETIME if os.path.exists(p)), None)
        if lib is not None:
            # What the faketime tool does, minus its fork: the command keeps our parent
            # (the launcher's proxy), so every rank still derives one launch id from it.
            os.environ["LD_PRELOAD"] = ":".join(filter(None, [lib, os.environ.get("LD_PRELOAD", "")]))
            os.environ["FAKETIME"] = spec
        else:
            cmd = ["faketime", "-f", spec, *cmd]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
