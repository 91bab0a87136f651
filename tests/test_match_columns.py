"""The match's per-group member columns (``m_op``, ``m_nbytes``, ``m_peer``, ``m_site``,
``m_aux``: :class:`distdiag.match.GroupColumn`, one value per group plus the members that
differ) read exactly like the plain member arrays they replace, for every way the
detectors index them, on a run whose members differ within groups in op, byte count,
root, datatype and call site, with in-flight rows and a repeated row."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag import match
from distdiag.clocks import align
from distdiag.mismatch import mismatches
from distdiag.match import Collectives, GroupColumn, match_collectives
from distdiag.run import load_run
from distdiag.schema import Kind
from factories import MS, write_rank

COMMS = ("world", "c_op", "c_size", "c_root", "c_dtype")
STRINGS = ["", *COMMS, "Allreduce", "Bcast", "Reduce", "MPI_DOUBLE", "MPI_FLOAT", "a.py:1", "b.py:2", "c.py:3"]
SID = {s: i for i, s in enumerate(STRINGS)}
#: (rank, comm, seq) -> (op, nbytes, root, datatype, site) as written; the kept row's on a repeat
Truth = dict[tuple[int, str, int], tuple[str, int, int, str, str]]


def _write_differing_run(d: Path, n_rank: int = 12, n_calls: int = 150, repeat: bool = True) -> Truth:
    """Five communicators in turn; on each, from a third of the run on, some ranks pass another
    op, size, root or datatype; call sites differ on some ranks at every 13th call; ranks 4
    and 6 end inside a world collective with different sizes; rank 1 repeats one row."""
    rng = np.random.default_rng(11)
    truth: Truth = {}
    for r in range(n_rank):
        rows, inflight, seqs, t = [], [], dict.fromkeys(COMMS, 0), 1.0
        for q in range(n_calls):
            c = COMMS[q % 5]
            op, nb, root, dt, site = "Allreduce", 64, -1, "MPI_DOUBLE", "a.py:1"
            if q % 7 == 3:
                op, root = "Reduce", 0
            if q % 11 == 5:
                op, root, nb = "Bcast", 1, 8
            late = q > n_calls // 3
            if c == "c_op" and late and r == 3 and q % 2:
                op = "Bcast"
            if c == "c_size" and late and r == 5 and op != "Bcast":
                nb = 128 + q
            if c == "c_root" and late and r in (7, 8) and root >= 0:
                root = r
            if c == "c_dtype" and late and r % 3 == 1:
                dt = "MPI_FLOAT"
            if q % 13 == 0 and r % 4 == 2:
                site = "b.py:2"
            if q % 17 == 0 and r == n_rank - 1:
                site, dt = "c.py:3", ""  # no datatype recorded
            t0 = int((t + rng.uniform(0, 0.5)) * MS)
            rows.append((t0, int((t + 1) * MS), int(Kind.COLL), SID[op], SID[c], seqs[c], root, nb, SID[dt], SID[site], 0, 0.0))
            truth[(r, c, seqs[c])] = (op, nb, root, dt, site)
            if repeat and r == 1 and q == 40:  # a repeated (comm, seq, rank), later, other values: dropped
                rows.append((t0 + MS // 100, int((t + 1) * MS), int(Kind.COLL), SID["Bcast"], SID[c], seqs[c], 3, 99,
                             SID["MPI_FLOAT"], SID["c.py:3"], 0, 0.0))  # fmt: skip
            seqs[c] += 1
            t += 1.2
        if r in (4, 6):
            nb = 64 if r == 4 else 32
            inflight = [(int((t + 0.1) * MS), -1, int(Kind.COLL), SID["Allreduce"], SID["world"], seqs["world"], -1, nb,
                         SID["MPI_DOUBLE"], SID["a.py:1"], 0, 0.0)]  # fmt: skip
            truth[(r, "world", seqs["world"])] = ("Allreduce", nb, -1, "MPI_DOUBLE", "a.py:1")
        write_rank(d, r, n_rank, rows, list(STRINGS), inflight=inflight or None, closed_cleanly=not inflight)
    return truth


def _plain_columns(run: Any, c: Collectives, truth: Truth) -> dict[str, np.ndarray]:
    """The uncompressed member columns, from what was written (string ids of the run's table)."""
    vals = [truth[(int(r), c.comm_name(int(g)), int(c.g_seq[g]))] for r, g in zip(c.m_rank, c.m_group)]
    sid = {s: i for i, s in enumerate(run.strings)}
    return {
        "m_op": np.array([sid[v[0]] for v in vals], np.int32),
        "m_nbytes": np.array([v[1] for v in vals], np.int64),
        "m_peer": np.array([v[2] for v in vals], np.int32),
        "m_aux": np.array([sid[v[3]] if v[3] else 0 for v in vals], np.int64),
        "m_site": np.array([sid[v[4]] for v in vals], np.int32),
    }


def _assert_reads_like(col: GroupColumn, want: np.ndarray, starts: np.ndarray, seed: int) -> None:
    """Every indexing form the detectors use gives what numpy gives on the plain array."""
    rng = np.random.default_rng(seed)
    n = len(want)
    assert len(col) == n and col.shape == want.shape and col.dtype == want.dtype
    full = np.asarray(col)
    assert full.dtype == want.dtype
    np.testing.assert_array_equal(full, want)
    np.testing.assert_array_equal(col.astype(np.int64), want.astype(np.int64))
    for sl in (slice(None), slice(0, 0), slice(3, n - 2), slice(-7, None), slice(n // 3, n // 2), slice(None, None, 3),
               slice(n - 1, 2, -4), slice(n + 5, n + 9)):  # fmt: skip
        got = col[sl]
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want[sl])
    for i in (0, 1, n // 2, n - 1, -1, -n, np.int64(n // 3), np.int32(5)):
        assert col[i] == want[i] and col[i].dtype == want.dtype
    with pytest.raises(IndexError):
        col[n]
    with pytest.raises(IndexError):
        col[np.array([0, -n - 1])]
    for idx in (rng.integers(-n, n, 500), np.flatnonzero(want != want[0]), np.zeros(0, np.int64), starts,
                np.array([n - 1, 0, n - 1]), rng.integers(0, n, (7, 9)), [3, 1, 4], []):  # fmt: skip
        got = col[idx]
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want[np.asarray(idx, dtype=np.intp)])
    for mask in (rng.random(n) < 0.3, want != want[0], np.zeros(n, bool), np.ones(n, bool), np.arange(n) % 97 == 5):
        np.testing.assert_array_equal(col[mask], want[mask])
        np.testing.assert_array_equal(col[list(mask)], want[mask])
    with pytest.raises(IndexError):
        col[np.ones(n + 1, bool)]
    assert col.max() == want.max() and col.min() == want.min()
    np.testing.assert_array_equal(col.group_max(), np.maximum.reduceat(want, starts))
    np.testing.assert_array_equal(col.varies(), np.minimum.reduceat(want, starts) != np.maximum.reduceat(want, starts))
    # anything else: numpy on the materialized column
    np.testing.assert_array_equal(col == want[0], want == want[0])
    np.testing.assert_array_equal(col + 1, want + 1)
    np.testing.assert_array_equal(np.maximum.reduceat(col, starts), np.maximum.reduceat(want, starts))
    np.testing.assert_array_equal(np.unique(col), np.unique(want))
    np.testing.assert_array_equal(col[np.arange(n) < 3, ...], want[np.arange(n) < 3, ...])
    with pytest.raises(ValueError):
        np.asarray(col, copy=False)  # read-only and per group: there is no array to view
    np.testing.assert_array_equal(np.asarray(pickle.loads(pickle.dumps(col))), want)


@pytest.mark.parametrize("gather_rows", [1, 3, 64, 1 << 12])
def test_per_group_columns_read_exactly_like_the_plain_ones(
    tmp_path: Path, gather_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever the gather's blocks (a group across many blocks, or many groups a block),
    # the group values and the exceptions give back every member's own value (of the
    # earliest row where a rank repeated one: the later one's values are not in ``truth``).
    truth = _write_differing_run(tmp_path / "r")
    monkeypatch.setattr(match, "_GATHER_ROWS", gather_rows)
    monkeypatch.setattr(match, "_GAP_ROWS", gather_rows)  # the repeated-rank check's blocks of groups too
    run = align(load_run(tmp_path / "r"))
    c = match_collectives(run)
    assert c.n_dup == 1 and c.m_group.dtype == np.int32
    assert (c.m_t1_ns < 0).sum() == 2  # the two in-flight members
    want = _plain_columns(run, c, truth)
    starts = c.g_start[:-1]
    for k, name in enumerate(want):  # five
        col = getattr(c, name)
        assert isinstance(col, GroupColumn)
        assert 0 < len(col.exc_rows) < len(col) // 10, name  # the exceptions path is taken, and few
        _assert_reads_like(col, want[name], starts, seed=k)
    # the states the columns' per-group facts decide
    states = {match.MatchState(s).name for s in c.g_state}
    assert {"OP_MISMATCH", "SIZE_MISMATCH", "ROOT_MISMATCH"} <= states  # (the in-flight one: SIZE_MISMATCH)


def test_group_column_of_random_arrays(tmp_path: Path) -> None:
    # GroupColumn.from_array: random group sizes (one member to hundreds) and values that
    # differ from their group's first at random, including a group's every other member.
    rng = np.random.default_rng(5)
    for trial in range(30):
        sizes = rng.integers(1, 300 if trial % 2 else 4, int(rng.integers(1, 80)))
        g_start = np.r_[0, np.cumsum(sizes)].astype(np.int64)
        m_group = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        dt = (np.int32, np.int64)[trial % 2]
        want = rng.integers(-3, 50, len(sizes)).astype(dt)[m_group]
        flip = rng.random(len(want)) < (0.0, 0.01, 0.5)[trial % 3]
        want[flip] = rng.integers(-(1 << 30), 1 << 30, int(flip.sum()))
        col = GroupColumn.from_array(want, m_group, g_start)
        assert len(col.exc_rows) == np.count_nonzero(want != want[g_start[:-1]][m_group])  # unlike their first
        _assert_reads_like(col, want, g_start[:-1], seed=trial)


def test_an_empty_match_has_empty_columns(tmp_path: Path) -> None:
    s = ["", "Send", "world", "job.py:7"]
    write_rank(tmp_path / "r", 0, 1, [(MS, 2 * MS, int(Kind.SEND), 1, 2, -1, 1, 8, 0, 3, 0, 0.0)], s)
    c = match_collectives(load_run(tmp_path / "r"))
    assert len(c) == 0
    for name in ("m_op", "m_nbytes", "m_peer", "m_site", "m_aux"):
        col = getattr(c, name)
        assert len(col) == 0 and len(col[0:0]) == 0 and len(col[np.zeros(0, np.int64)]) == 0
        assert np.asarray(col).shape == (0,) and len(col.group_max()) == 0


def test_datatype_mismatch_from_the_group_column_equals_the_member_array(tmp_path: Path) -> None:
    # collective_mismatch judges datatypes from m_aux's group values and exceptions; the
    # same verdicts as from the member array found again in the event table.
    _write_differing_run(tmp_path / "r", repeat=False)
    run = align(load_run(tmp_path / "r"))
    c = match_collectives(run)
    assert c.n_dup == 0 and isinstance(c.m_aux, GroupColumn)
    got = mismatches(run, c)
    ref = mismatches(run, replace(c, m_aux=None))
    assert isinstance(got[3], GroupColumn) and isinstance(ref[3], np.ndarray)
    for a, b in zip(got[:3], ref[:3]):  # bad, dtype_bad, skipped
        np.testing.assert_array_equal(a, b)
    assert got[1].sum() == len([g for g in range(len(c)) if c.comm_name(g) == "c_dtype" and got[1][g]]) > 0
    np.testing.assert_array_equal(np.asarray(got[3]), ref[3])


def test_sequence_numbers_too_large_to_decode_still_group_each_call(tmp_path: Path) -> None:
    # A damaged seq near 2^62 makes (comm, seq) keys overflow: the groups' comm and seq
    # are then read from their first rows, not decoded from the keys (the other path).
    s = ["", "world", "Allreduce", "job.py:7"]
    seqs = [0, 1, 1 << 62]
    for r in range(2):
        rows = [(int((i + 1 + 0.1 * r) * MS), int((i + 1.5) * MS), int(Kind.COLL), 2, 1, q, -1, 8 * (i + 1), 0, 3, 0, 0.0)
                for i, q in enumerate(seqs)]  # fmt: skip
        write_rank(tmp_path / "r", r, 2, rows, s)
    c = match_collectives(load_run(tmp_path / "r"))
    assert len(c) == 3 and sorted(int(q) for q in c.g_seq) == seqs
    assert all(c.comm_name(g) == "world" and c.g_n_members[g] == 2 for g in range(3))
    by_seq = {int(c.g_seq[g]): g for g in range(3)}
    assert [int(c.m_nbytes.group_values[by_seq[q]]) for q in seqs] == [8, 16, 24]
    assert np.all(c.g_state == match.MatchState.COMPLETE)


@pytest.mark.parametrize("block_rows", [1, 5, 64, 1 << 16])
def test_arrival_order_in_the_keys_own_array(block_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The match sorts its keys in their own array (consume=True, the array is overwritten):
    # the same order, group starts and group keys as the lexsort, whatever the blocks.
    monkeypatch.setattr(match, "_ORDER_ROWS", block_rows)
    rng = np.random.default_rng(block_rows)
    for trial in range(60):
        n = int(rng.integers(1, 1500))
        gkey = rng.integers(0, int(rng.integers(1, 40)), n) * int(rng.choice([1, 7, 1 << 30]))
        if trial % 10 == 9:  # too wide to pack with the row index: the stable argsort
            gkey = rng.choice(np.array([-(1 << 62), 0, (1 << 62) - 1]), n)
        t0 = rng.integers(0, int(rng.choice([3, 1 << 20, 1 << 40])), n)
        ref = np.lexsort((t0, gkey))
        gk = gkey[ref]
        want_starts = np.flatnonzero(np.r_[True, gk[1:] != gk[:-1]])
        mine = gkey.copy()
        order, starts, keys = match._arrival_order(mine, t0, consume=True)
        np.testing.assert_array_equal(order, ref)
        np.testing.assert_array_equal(starts, want_starts)
        np.testing.assert_array_equal(keys, gk[want_starts])
