"""The collective match split by (communicator, seq) key ranges and merged back
(issue 10 part 4, ``analyze --parallel``): the merge of K parts' matches is the
whole match, field by field (every group and member column with its dtype, the
:class:`GroupColumn` columns' group values and exceptions, the membership, the
repeated-row count and the run's warnings), for K = 1, 2, 3, 5 and more parts
than groups (empty parts).

Runs: every synth fault (16 ranks x 2,000 events) loaded in memory and streamed
(the collective rows kept apart, compact), aligned; a real 4-rank MPI job that
hangs in a Barrier and is killed (in-flight rows, missing ranks); a real 4-rank
MPI job on split sub-communicators; and rank files with five communicators,
op / size / root / datatype mismatches, in-flight rows of unequal sizes and a
repeated (comm, seq, rank) row.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
import numpy as np
import pytest

from distdiag.clocks import align
from distdiag.match import (
    Collectives,
    GroupColumn,
    MatchScope,
    group_keys,
    key_ranges,
    match_collectives,
    match_part,
    merge_collectives,
    split_match,
    warn_repeats,
)
from distdiag.run import STREAMED_KINDS, Run, load_run
from distdiag.schema import COMM_KINDS
from distdiag.synth import FAULTS, synth
from helpers import run_wrapped_mpi
from test_hang import _run_and_kill
from factories import coll, write_rank
from test_match_columns import _write_differing_run

#: Part counts: 1, a few, and (in :func:`_check`) more than the run has groups.
KS = (1, 2, 3, 5)


def _same(whole: Collectives, merged: Collectives) -> None:
    """Every field of the two matches equal, arrays with their dtypes."""
    for f in whole.__dataclass_fields__:
        a, b = getattr(whole, f), getattr(merged, f)
        if f == "strings":
            assert a is b or list(a) == list(b)
        elif isinstance(a, GroupColumn):
            assert isinstance(b, GroupColumn), f
            for part in ("group_values", "exc_rows", "exc_values", "m_group"):
                x, y = getattr(a, part), getattr(b, part)
                assert x.dtype == y.dtype and np.array_equal(x, y), (f, part)
        elif isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f
        elif f == "comm_members":
            assert list(a) == list(b), f
            for c in a:  # per communicator
                assert a[c].dtype == b[c].dtype and np.array_equal(a[c], b[c]), (f, c)
        else:
            assert a == b, f


def _split_and_merge(run: Run, k: int) -> tuple[Collectives, list[str]]:
    """The K-part match of ``run`` merged, and the warnings it adds to a copy of the run."""
    scope, parts = split_match(run, k)
    assert len(parts) == k
    merged = merge_collectives([match_part(p, scope, run.strings) for p in parts])
    out = run.replace()
    warn_repeats(out, merged)
    return merged, out.warnings[len(run.warnings) :]


def _check(run: Run) -> Collectives:
    """The merge equals the whole match for every K; returns the whole match."""
    probe = run.replace()
    whole = match_collectives(probe)
    warned = probe.warnings[len(run.warnings) :]
    for k in (*KS, len(whole) + 3):
        merged, w = _split_and_merge(run, k)
        _same(whole, merged)
        assert w == warned, k
    return whole


def _both_ways(d: Path) -> list[Collectives]:
    """``_check`` on ``d`` loaded in memory and streamed (collective rows kept apart), aligned."""
    out = []
    for kinds in ((), STREAMED_KINDS):
        run = align(load_run(d, streamed_kinds=kinds))
        assert (run.coll_rows is not None) == bool(kinds)
        out.append(_check(run))
    return out


@pytest.mark.parametrize("fault", FAULTS)
def test_a_split_match_merges_to_the_whole_match_for_every_synth_fault(tmp_path: Path, fault: str) -> None:
    synth(tmp_path / "run", ranks=16, events=2000, fault=fault)
    mem, streamed = _both_ways(tmp_path / "run")
    assert len(mem) >= 900 and mem.complete.all()
    _same(mem, streamed)


def test_in_flight_rows_of_a_real_hang_land_in_their_part(tmp_path: Path) -> None:
    """4 ranks under mpiexec, rank 2 never reaches the Barrier the others enter, all killed:
    the Barrier's three members are in-flight rows, and its group misses rank 2."""
    d = _run_and_kill(tmp_path, "kill")
    run = align(load_run(d))
    assert len(run.inflight) >= 3
    for c in _both_ways(d):
        stuck = np.flatnonzero(c.g_exit_ns < 0)
        assert len(stuck) == 1 and c.g_n_members[stuck[0]] == 3 and c.g_n_expected[stuck[0]] == 4
        assert 2 in c.missing_ranks(int(stuck[0]))


def test_repeats_mismatches_and_five_communicators_merge_exactly(tmp_path: Path) -> None:
    """Rank files with five communicators taken in turn, members that differ in op, size,
    root and datatype, two ranks ending inside a world collective with different sizes,
    and one repeated (comm, seq, rank) row: the warning comes once, with the total."""
    _write_differing_run(tmp_path / "run")
    for c in _both_ways(tmp_path / "run"):
        assert c.n_dup == 1 and len(c.comm_members) == 5
        assert len(c.m_op.exc_rows) and len(c.m_nbytes.exc_rows) and len(c.m_aux.exc_rows)  # type: ignore[union-attr]
        assert (c.g_exit_ns < 0).sum() == 1
    run = align(load_run(tmp_path / "run"))
    _, w = _split_and_merge(run, 3)
    assert w == ["1 collective rows repeat a (communicator, seq, rank): counted once"]


_SPLIT_JOB = textwrap.dedent(
    """
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    half = world.Split(rank % 2, rank)  # two sub-communicators of 2 ranks each
    pair = world.Split(rank // 2, rank)
    x = np.ones(64)
    y = np.empty_like(x)
    for i in range(30):
        world.Allreduce(x, y)
        half.Allreduce(x, y)
        if i % 3 == 0:
            pair.Bcast(x, root=0)
        if i % 4 == 0:
            half.allreduce(rank)
    world.Barrier()
    """
)


def test_a_real_job_on_split_sub_communicators_merges_exactly(tmp_path: Path) -> None:
    d = run_wrapped_mpi(tmp_path, _SPLIT_JOB, n=4)
    mem, _ = _both_ways(d)
    sizes = {len(m) for m in mem.comm_members.values()}
    assert len([m for m in mem.comm_members.values() if len(m) == 2]) >= 4 and 4 in sizes  # world + 4 halves/pairs
    assert mem.complete.all()


def test_the_ranges_split_rows_evenly_and_cut_between_keys(tmp_path: Path) -> None:
    """The cuts from the rows and from gathered per-block histograms are the same; no key
    is in two parts; each part holds n/K rows give or take its largest group."""
    _write_differing_run(tmp_path / "run")
    run = align(load_run(tmp_path / "run"))
    ev = run.events[np.isin(run.events["kind"], list(COMM_KINDS)) & (run.events["seq"] >= 0)]
    scope = MatchScope.of_rows(ev["comm_id"], ev["seq"], ev["rank"])
    keys = group_keys(ev["comm_id"], ev["seq"], scope.n_seq)
    for k in (2, 3, 7):
        r = key_ranges(keys, k, scope.n_seq)
        blocks = [np.unique(b, return_counts=True) for b in np.array_split(keys, 5)]  # five "analysis ranks"
        hist = key_ranges(np.concatenate([b[0] for b in blocks]), k, scope.n_seq,
                          counts=np.concatenate([b[1] for b in blocks]))  # fmt: skip
        assert np.array_equal(r.cuts, hist.cuts) and len(r) == k
        part = r.part_of(ev["comm_id"], ev["seq"])
        u, inv = np.unique(keys, return_inverse=True)
        per_key = np.zeros(len(u), np.int64)
        np.maximum.at(per_key, inv, part)
        low = np.full(len(u), k, np.int64)
        np.minimum.at(low, inv, part)
        assert np.array_equal(per_key, low)  # every key in one part
        biggest = int(np.bincount(inv).max())
        assert np.all(np.abs(np.bincount(part, minlength=k) - len(keys) / k) <= biggest)
    # a cut position on a group boundary (equal groups, K dividing them): both forms take the later key
    eq = np.repeat(np.arange(12, dtype=np.int64), 5)[::-1].copy()
    for k in (2, 3, 4, 6):
        u, c = np.unique(eq, return_counts=True)
        want = np.arange(1, k, dtype=np.int64) * 12 // k
        assert np.array_equal(key_ranges(eq, k, 1).cuts, want), k
        assert np.array_equal(key_ranges(u, k, 1, counts=c).cuts, want), k
    union = MatchScope.union([MatchScope.of_rows(b["comm_id"], b["seq"], b["rank"]) for b in np.array_split(ev, 4)])
    assert np.array_equal(union.pairs, scope.pairs) and union.n_seq == scope.n_seq


def test_a_part_needs_the_runs_scope(tmp_path: Path) -> None:
    """A part matched with its own membership would call its groups complete when the run's
    communicator is larger; a scope too small for its seqs is refused."""
    synth(tmp_path / "run", ranks=4, events=200, fault="none")
    run = align(load_run(tmp_path / "run"))
    scope, parts = split_match(run, 2)
    small = MatchScope(scope.pairs, 1)
    with pytest.raises(ValueError, match="radix"):
        match_part(parts[1], small, run.strings)
    only0 = MatchScope(scope.pairs[(scope.pairs & 0xFFFFFFFF) == 0], scope.n_seq)
    c = match_part(parts[0], only0, run.strings)
    assert (c.g_n_expected == 1).all()  # the scope, not the rows, says who belongs


def test_ties_fall_in_row_order_in_every_part(tmp_path: Path) -> None:
    """Members arriving at the same instant are ordered by row (rank order in the table, the
    in-flight rows after the table's), and of a repeated (comm, seq, rank) at one instant
    the first row is kept: a part's rows must keep that order for its match to be exact."""
    s = [""]
    for r in range(4):
        rows = []
        for i in range(12):  # every rank arrives at the same instant, on two communicators in turn
            rows.append(coll(10.0 * i, 10.0 * i + 2, i // 2, s, comm="world" if i % 2 else f"sub{r % 2}", nbytes=8))
            if r == 1 and i == 7:  # the same (comm, seq, rank) again at the same instant, another size
                rows.append(coll(10.0 * i, 10.0 * i + 3, i // 2, s, comm="world", nbytes=99))
        inf = [coll(120.0, -1, 6, s, comm="world", nbytes=16)] if r in (0, 2) else None
        rows += [] if inf else [coll(120.0, 121.0, 6, s, comm="world", nbytes=16)]
        write_rank(tmp_path / "run", r, 4, rows, s, inflight=inf, closed_cleanly=inf is None)
    for c in _both_ways(tmp_path / "run"):
        assert c.n_dup == 1 and (c.g_exit_ns < 0).sum() == 1
        g = next(g for g in range(len(c)) if c.comm_name(g) == "world" and c.g_seq[g] == 6)
        assert list(c.m_rank[c.members(g)]) == [1, 3, 0, 2]  # tied: the table's rows first, in rank order
