"""The replay's share of the analysis: ``replay.price`` timed inside one whole ``distdiag analyze``.

    python benchmarks/bench_replay.py [--ranks 1024] [--events 10000] [--fault straggler]
    python benchmarks/bench_replay.py --ddp [--ranks 1024] [--events 3000]

A synthetic run (``distdiag.synth``) is analyzed once as ``distdiag analyze``
does it (load, align, match, detect, replay, rank); ``replay.price`` (the model
built from the matched collectives, then one replay per finding that states a
counterfactual) and the ranking's cumulative replay (``ranking._price_by_replay``:
the causes removed one after another, and the overlaps of a finding explained in
part), and the model and the point-to-point exchanges where a detector asks for them first
(``replay.model_of``, ``replay.p2p_work``: ``load_imbalance``), are timed where the pipeline calls them, in the same process and the same
run, so the ratio holds on a loaded machine. Issue 20's target: the
replay at most 20% of the analysis. numpy's huge-page advice is off, as ``distdiag
analyze`` has it (``cli._no_huge_page_advice``); ``NUMPY_MADVISE_HUGEPAGE=1`` measures with it.

``--p2p PATTERN``: instead, a point-to-point job of ``tests/factories.simulate_p2p`` (``ring``,
``nonblocking``, ``halo2``, ...: each rank computes 1.0-1.2 ms a step, rank 1 0.3 ms more, then
exchanges with its neighbours; an all-reduce every other step), ``events / 3`` steps a rank: the
shape where the replay's batches of point-to-point events (three a step) weigh most.

``--ddp``: instead of ``distdiag.synth``, a DDP-shaped run whose every step is a BACKWARD
row and two gradient buckets (``COLL_ASYNC``; the first done behind the backward's
compute, the second waited for by DDP's finalize), ``events / 3`` steps a rank: the
shape where the replay's waits (one per rank and step) weigh most against the rest of
the analysis, since the run holds nothing else.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from distdiag import ranking, replay
from distdiag.cli import _no_huge_page_advice
from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.synth import synth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--events", type=int, default=10_000, help="per rank")
    ap.add_argument("--fault", default="straggler")
    ap.add_argument("--ddp", action="store_true", help="a DDP-shaped run (see the docstring) instead of synth's")
    ap.add_argument("--p2p", metavar="PATTERN", help="a point-to-point job (see the docstring) instead of synth's")
    ns = ap.parse_args(argv)
    _no_huge_page_advice()
    spent: list[float] = []
    depth = [0]

    def timed(mod: Any, name: str) -> None:
        """``mod.name`` timed where it is called, once however deeply the timed ones call each other."""
        real = getattr(mod, name)

        def wrapper(*a: Any) -> Any:
            depth[0] += 1
            t = time.perf_counter()
            try:
                return real(*a)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent.append(time.perf_counter() - t)

        setattr(mod, name, wrapper)

    # the model (made where first asked: load_imbalance's point-to-point exchanges read it before the
    # pricing), the exchanges' segments, the pricing and the ranking's cumulative replay
    for mod, name in ((replay, "model_of"), (replay, "p2p_work"), (replay, "price"), (ranking, "_price_by_replay")):
        timed(mod, name)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "run"
        if ns.ddp:
            _ddp_run(d, ns.ranks, max(1, ns.events // 3))
        elif ns.p2p:
            _p2p_run(d, ns.ranks, max(1, ns.events // 3), ns.p2p)
        else:
            synth(d, ranks=ns.ranks, events=ns.events, fault=ns.fault)
        t = time.perf_counter()
        rep = analyze(d, Config())
        total = time.perf_counter() - t
    priced = [f.kind for f in rep.findings if "replay" in f.evidence]
    shape = "DDP-shaped" if ns.ddp else f"point-to-point {ns.p2p}" if ns.p2p else ns.fault
    print(f"{ns.ranks} ranks x {ns.events} events ({shape}): analysis {total:.2f} s, "
          f"replay {sum(spent):.2f} s = {sum(spent) / total:.1%} of it; replayed: {', '.join(priced) or 'none'}")
    return 0


def _p2p_run(d: Path, ranks: int, steps: int, pattern: str) -> None:
    """The point-to-point job of ``--p2p``: ``tests/factories.simulate_p2p``, rank 1 a straggler."""
    import sys

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from factories import simulate_p2p

    compute = np.random.default_rng(0).uniform(1.0, 1.2, (steps, ranks))
    compute[:, 1] += 0.3
    simulate_p2p(d, ranks, compute, pattern, big=False)


def _ddp_run(d: Path, ranks: int, steps: int) -> None:
    """The DDP-shaped run of ``--ddp``: per step of 20 ms, a BACKWARD row from 2 to 15 ms, bucket 1
    launched at 4 (+ up to 0.2 ms of jitter) and done at 7, bucket 2 launched at 8 and done at 15."""
    import numpy as np

    from distdiag.schema import EVENT_DTYPE, Kind
    from distdiag.shim.writer import write_rank_file

    ms = 1_000_000
    rng = np.random.default_rng(0)
    strings = ["", "ddp_bucket_allreduce", "ddp0:default", "train.py:7", "Tensor.backward"]
    d.mkdir(parents=True)
    t = np.arange(steps, dtype=np.int64) * 20 * ms
    for r in range(ranks):  # one file per rank, numpy over its rows
        ev = np.zeros(3 * steps, EVENT_DTYPE)
        ev["peer"] = -1
        ev["t0_ns"][0::3], ev["t1_ns"][0::3] = t + 2 * ms, t + 15 * ms
        ev["kind"][0::3], ev["name_id"][0::3], ev["seq"][0::3] = Kind.BACKWARD, 4, -1
        jitter = rng.integers(0, ms // 5, steps)
        for b, (a, c) in enumerate([(4 * ms, 7 * ms), (8 * ms, 15 * ms)]):
            sl = slice(1 + b, None, 3)
            ev["t0_ns"][sl], ev["t1_ns"][sl], ev["kind"][sl] = t + a + jitter, t + c, Kind.COLL_ASYNC
            ev["name_id"][sl], ev["comm_id"][sl], ev["site_id"][sl] = 1, 2, 3
            ev["seq"][sl], ev["nbytes"][sl] = 2 * np.arange(steps) + b, 1 << 20
        attrs = dict(rank=r, world_size=ranks, host=f"node{r // 8}", job_id="ddp", launch_id="ddp",
                     wall_ns_at_start=1_700_000_000 * 10**9, mono_ns_at_start=0)  # fmt: skip
        write_rank_file(d / f"rank-{r:05d}.h5", attrs, ev, strings)


if __name__ == "__main__":
    raise SystemExit(main())
