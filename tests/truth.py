"""Ground truth measured in the test: the wall-clock a job loses to its fault.

A detector's cost is "the wall-clock the job would save" without the fault.
With more ranks than cores an injected ``sleep`` is not that saving: while the
slow rank sleeps, the others get its core (4 ranks on 2 cores lost 1.2-2.3 s
to 2.0 s of injected sleep, issue 16). So a test that prices a fault runs the
same job with and without it, alternating (faulty, healthy, faulty, ...), reads
the wall-clock each run reports of itself, and compares the analyzer's cost
of one faulty run with what that run lost:
``its wall-clock - the median healthy wall-clock``.

The margin is the noise measured in the same test (the healthy runs' spread)
and a relative slack written at each assertion; nothing is assumed about the
machine.

A job reports its wall-clock on stdout as ``loop <seconds> s`` (see
:data:`LOOP_RE`): the span from the first synchronization to the last, taken
on one rank, so interpreter start-up (seconds of noise on 2 loaded cores)
stays out of it.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

LOOP_RE = re.compile(r"\bloop ([0-9]+(?:\.[0-9]+)?) s\b")
SCHED_RE = re.compile(r"\brank ([0-9]+) sched_delay ([0-9]+(?:\.[0-9]+)?) s\b")


def loop_s(stdout: str) -> float:
    """The wall-clock a job printed of itself (``loop <seconds> s``)."""
    m = LOOP_RE.search(stdout)
    assert m, f"the job printed no 'loop <seconds> s' line:\n{stdout[-2000:]}"
    return float(m.group(1))


def mpi_loop_s(d: Path, job: Path, *args: str, n: int = 4) -> float:
    """Run ``job`` on ``n`` ranks under ``mpiexec ... distdiag.wrap --dir d/run`` from ``d`` (made
    here) and return the loop's wall-clock it printed (:func:`loop_s`)."""
    import shutil
    import sys

    import pytest

    from helpers import run_in_session

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    d.mkdir(parents=True, exist_ok=True)
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "distdiag.wrap", "--dir", str(d / "run"), sys.executable,
           str(job), *args]  # fmt: skip
    return loop_s(run_in_session(cmd, 120, cwd=d, check=True).stdout)


def sched_imbalance_s(stdout: str) -> float:
    """How much longer one rank's main thread waited for a core than another's in the job's loop.

    A job that prints ``rank <r> sched_delay <seconds> s`` per rank (the thread's ``run_delay`` from
    ``/proc/thread-self/schedstat`` over the loop) says how long the machine kept each rank from
    running while it was ready to. Beside a busy core one rank of a healthy job can lose a tenth
    of a second more than the other: a real straggler, made by the machine, not the job. The
    largest difference is what a healthy twin's check allows for it (0 when no rank printed one)."""
    d = [float(m.group(2)) for m in SCHED_RE.finditer(stdout)]
    return max(d) - min(d) if d else 0.0


@dataclass(frozen=True)
class Saving:
    """The wall-clock of runs of one job with its fault (``faulty_s``) and without it (``healthy_s``)."""

    faulty_s: tuple[float, ...]
    healthy_s: tuple[float, ...]

    @property
    def healthy_median_s(self) -> float:
        return float(statistics.median(self.healthy_s))

    @property
    def median_s(self) -> float:
        """What the fault costs the job, run for run: the medians' difference."""
        return float(statistics.median(self.faulty_s)) - self.healthy_median_s

    def of_run(self, i: int) -> float:
        """What faulty run ``i`` lost to its fault."""
        return self.faulty_s[i] - self.healthy_median_s

    @property
    def noise_s(self) -> float:
        """How far the job's healthy part strays from run to run, measured: the healthy runs' spread.

        A faulty run's loss is its wall-clock less the healthy median; the analyzer prices that
        very run, so its own wall-clock is no error, but the healthy part it stands on is."""
        return max(self.healthy_s) - min(self.healthy_s) if len(self.healthy_s) > 1 else 0.0

    def assert_prices(self, cost_s: float, i: int, rel: float, what: str = "cost") -> None:
        """``cost_s`` (the analyzer's price of faulty run ``i``) is what that run lost, within
        ``rel`` of it plus the measured noise."""
        self.assert_within(cost_s, self.of_run(i), rel, f"{what} {cost_s:.3f} s, but faulty run {i}")

    def assert_within(self, cost_s: float, lost_s: float, rel: float, said: str) -> None:
        """``cost_s`` is ``lost_s`` within ``rel`` of it plus the healthy runs' spread."""
        margin = rel * abs(lost_s) + self.noise_s
        assert abs(cost_s - lost_s) <= margin, (
            f"{said} lost {lost_s:.3f} s to its fault (margin {margin:.3f} s); {self}"
        )

    def __str__(self) -> str:
        f = ", ".join(f"{x:.3f}" for x in self.faulty_s)
        h = ", ".join(f"{x:.3f}" for x in self.healthy_s)
        return f"faulty runs [{f}] s, healthy runs [{h}] s, saving {self.median_s:.3f} s, noise {self.noise_s:.3f} s"


def measure_saving(run: Callable[[bool, int], float], pairs: int) -> Saving:
    """Run the job ``pairs`` times with its fault and as often without, alternating, starting with the
    fault; ``run(faulty, i)`` runs it (the i-th time of that kind) and returns its wall-clock in s."""
    faulty: list[float] = []
    healthy: list[float] = []
    for i in range(pairs):
        faulty.append(run(True, i))
        healthy.append(run(False, i))
    return Saving(tuple(faulty), tuple(healthy))


T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Twins(Generic[T]):
    """What a fault costs (:class:`Saving`) and, in the order they ran, what each faulty run and
    each healthy twin left (their run dirs, or the reports :meth:`map` made of them)."""

    saving: Saving
    faulty: list[T]
    healthy: list[T]

    def map(self, f: Callable[[T], U]) -> Twins[U]:
        return Twins(self.saving, [f(x) for x in self.faulty], [f(x) for x in self.healthy])


def measure_twins(tmp: Path, run: Callable[[Path, bool], float], pairs: int,
                  names: tuple[str, str] = ("faulty", "healthy")) -> Twins[Path]:
    """:func:`measure_saving` with each launch in a directory of its own, ``tmp/<name><i>`` (``names``:
    the faulty job's and its healthy twin's); ``run(d, faulty)`` launches into ``d`` and returns the
    job's wall-clock in s. The directories come back for the tests to analyze."""
    dirs: dict[bool, list[Path]] = {True: [], False: []}

    def one(faulty: bool, i: int) -> float:
        d = tmp / f"{names[0] if faulty else names[1]}{i}"
        dirs[faulty].append(d)
        return run(d, faulty)

    return Twins(measure_saving(one, pairs), dirs[True], dirs[False])


def mpi_twins(tmp: Path, job: Path, faulty: Sequence[str], healthy: Sequence[str], pairs: int = 2) -> Twins[Any]:
    """An MPI job launched with the fault's arguments and with its healthy twin's, by turns
    (:func:`measure_twins`, :func:`mpi_loop_s`), each run analyzed (its ``Report``)."""
    from distdiag.config import Config
    from distdiag.pipeline import analyze

    def run(d: Path, is_faulty: bool) -> float:
        return mpi_loop_s(d, job, *(faulty if is_faulty else healthy))

    return measure_twins(tmp, run, pairs).map(lambda d: analyze(d / "run", Config()))


def measure_savings(run: Callable[[str, int], float], twins: Sequence[str], rounds: int) -> dict[str, Saving]:
    """A job with several faults, each priced by itself: what the job saves without one of them.

    Each round runs the faulty job (``run("faulty", i)``), then each twin in turn
    (``run(twin, i)``: the same job without one of its faults), ``rounds`` times,
    so every kind of run sees the same load; returns, per twin, the faulty runs'
    :class:`Saving` against that twin's runs (the faulty runs are shared)."""
    faulty: list[float] = []
    twin_s: dict[str, list[float]] = {t: [] for t in twins}
    for i in range(rounds):
        faulty.append(run("faulty", i))
        for t in twins:
            twin_s[t].append(run(t, i))
    return {t: Saving(tuple(faulty), tuple(xs)) for t, xs in twin_s.items()}


def verdict_prices(reports: Sequence[Any], kind: str) -> list[float]:
    """Per report (a :class:`distdiag.pipeline.Report` of a faulty run): its verdict is a finding of
    ``kind`` priced by the replay (its ``cost_s`` the replay's saving); returns their ``cost_s``."""
    import pytest

    costs = []
    for rep in reports:
        top = rep.verdict
        assert top is not None and top.kind == kind, [(f.kind, f.cost_s) for f in rep.findings]
        assert top.evidence["replay"]["saving_s"] == pytest.approx(top.cost_s)  # priced by the replay
        costs.append(float(top.cost_s))
    return costs


def assert_silent_twin(reports: Sequence[Any], category: str) -> None:
    """Each healthy twin's report (:class:`distdiag.pipeline.Report`) has no finding above 2% of its
    wall-clock, and its breakdown ``category`` (``comm_wait_s``, ...), if it holds 10% of a rank's
    run, is explained: no ``binds:`` line for it."""
    for rep in reports:
        wall = float(rep.run.wall_s)
        assert [(f.kind, f.cost_s) for f in rep.findings if f.cost_s > 0.02 * wall] == []
        cov = {c["category"]: c for c in rep.coverage}
        assert category not in cov or cov[category]["binds"] is None, cov


def assert_prices_median(saving: Saving, costs_s: Sequence[float], rel: float, what: str = "cost") -> None:
    """For a fault of one size in every run (a fixed sleep): the median of the analyzer's prices of the
    faulty runs (``costs_s[i]`` of faulty run ``i``) is the saving (:attr:`Saving.median_s`, the
    medians' difference), within ``rel`` of it plus the healthy runs' spread.

    The medians, not one run: a faulty run that the machine slowed elsewhere (a load spike in the
    part of the job the fault does not touch, which no price should include) lost more than its
    fault, and one such run must not decide. (Where the fault's own size varies from run to run, a
    metadata storm on a loaded server, check each run with :meth:`Saving.assert_prices`.)"""
    assert len(costs_s) == len(saving.faulty_s), (costs_s, saving)
    cost = float(statistics.median(costs_s))
    said = f"{what}: median price {cost:.3f} s (of {', '.join(f'{c:.3f}' for c in costs_s)}), but the job"
    saving.assert_within(cost, saving.median_s, rel, said)
