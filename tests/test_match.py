"""Collective matching: by (communicator, seq), never by time; every MatchState on real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distdiag.clocks import align
from distdiag.match import Collectives, MatchState, collectives_of, match_collectives
from distdiag.run import load_run
from distdiag.schema import Kind
from factories import MS, coll, make_run, write_rank


def test_groups_follow_sequence_numbers_and_name_the_last_arriver(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=60, seed=5)
    c = match_collectives(align(load_run(tmp_path / "r")))
    assert len(c) == 60
    assert np.all(c.g_state == MatchState.COMPLETE)
    np.testing.assert_array_equal(c.g_seq, np.arange(60))
    assert np.all(c.g_n_members == 4) and np.all(c.g_n_expected == 4)
    np.testing.assert_array_equal(c.g_last_rank, t.last_rank)
    np.testing.assert_array_equal(c.g_last_ns - c.g_second_ns, t.wait_ns)
    # members are ordered by arrival inside each group
    assert np.all(np.diff(c.m_t0_ns)[np.diff(c.m_group) == 0] >= 0)
    assert c.op_name(0) == "Allreduce" and c.comm_name(0) == "world"
    assert list(c.comm_members) == [c.g_comm[0]] and list(c.comm_members[int(c.g_comm[0])]) == [0, 1, 2, 3]
    df = c.to_frame()
    assert list(df["state"].unique()) == ["COMPLETE"] and len(df) == 60


def test_matching_ignores_time_even_when_clocks_are_seconds_apart(tmp_path: Path) -> None:
    # Unaligned, rank 1's clock runs 3 s ahead: matching by time would pair the
    # wrong calls; by (comm, seq) every group still has its 4 members.
    make_run(tmp_path / "r", iters=30, clock_offsets_ms=[0, -3000, 0, 0])
    run = load_run(tmp_path / "r")
    c = match_collectives(run)
    assert len(c) == 30 and np.all(c.g_n_members == 4)
    assert np.all(c.g_last_rank == 1)  # nonsense timing, right grouping
    a = match_collectives(align(run))
    assert not np.all(a.g_last_rank == 1)


def _two_rank_run(tmp_path: Path, rows0: list, rows1: list, strings: list[str], **kw: object) -> Collectives:
    write_rank(tmp_path / "r", 0, 2, rows0, strings)
    write_rank(tmp_path / "r", 1, 2, rows1, strings, **kw)  # type: ignore[arg-type]
    c = match_collectives(align(load_run(tmp_path / "r")))
    return c


def test_a_rank_that_skips_a_collective_leaves_it_missing_ranks(tmp_path: Path) -> None:
    s = [""]
    r0 = [coll(1, 2, 0, s), coll(3, 4, 1, s), coll(5, 6, 2, s)]
    r1 = [coll(1, 2, 0, s), coll(5, 6, 2, s)]
    c = _two_rank_run(tmp_path, r0, r1, s)
    assert list(c.g_state) == [MatchState.COMPLETE, MatchState.MISSING_RANKS, MatchState.COMPLETE]
    assert list(c.missing_ranks(1)) == [1] and list(c.member_ranks(1)) == [0]
    assert MatchState.MISSING_RANKS.describe() == "some member ranks of the communicator never entered it"


def test_a_rank_killed_inside_a_collective_leaves_it_in_flight(tmp_path: Path) -> None:
    s = [""]
    r0 = [coll(1, 2, 0, s)]
    r1 = [coll(1, 2, 0, s)]
    stuck = [coll(3, -1, 1, s)]  # rank 1 entered seq 1 and never left; rank 0 never came
    c = _two_rank_run(tmp_path, r0, r1, s, inflight=stuck, closed_cleanly=False)
    assert list(c.g_state) == [MatchState.COMPLETE, MatchState.IN_FLIGHT]
    assert c.g_exit_ns[1] == -1 and list(c.member_ranks(1)) == [1]
    assert list(c.missing_ranks(1)) == [0]


@pytest.mark.parametrize(
    "second, state",
    [
        (dict(op="Bcast"), MatchState.OP_MISMATCH),
        (dict(nbytes=16), MatchState.SIZE_MISMATCH),
        (dict(op="Allgatherv", nbytes=16), MatchState.OP_MISMATCH),
    ],
)
def test_mismatched_calls_at_one_sequence_number(tmp_path: Path, second: dict, state: MatchState) -> None:
    s = [""]
    c = _two_rank_run(tmp_path, [coll(1, 2, 0, s)], [coll(1, 2, 0, s, **second)], s)
    assert list(c.g_state) == [state]
    assert state.describe()


def test_size_mismatch_only_where_sizes_must_agree(tmp_path: Path) -> None:
    s = [""]
    # Allgatherv legitimately passes different counts per rank.
    c = _two_rank_run(tmp_path, [coll(1, 2, 0, s, op="Allgatherv", nbytes=8)],
                      [coll(1, 2, 0, s, op="Allgatherv", nbytes=64)], s)  # fmt: skip
    assert list(c.g_state) == [MatchState.COMPLETE]


def test_rooted_collective_with_different_roots(tmp_path: Path) -> None:
    s = [""]
    c = _two_rank_run(tmp_path, [coll(1, 2, 0, s, op="Reduce", root=0), coll(3, 4, 1, s, op="Reduce", root=1)],
                      [coll(1, 2, 0, s, op="Reduce", root=1), coll(3, 4, 1, s, op="Reduce", root=1)], s)  # fmt: skip
    assert list(c.g_state) == [MatchState.ROOT_MISMATCH, MatchState.COMPLETE]


def test_communicators_are_matched_separately_with_their_own_members(tmp_path: Path) -> None:
    # world: ranks 0-3; "sub-a": ranks 0,1; "sub-b": ranks 2,3. Each numbers its own collectives.
    d = tmp_path / "r"
    for r in range(4):
        s = [""]
        sub = "sub-a" if r < 2 else "sub-b"
        rows = [coll(1 + r * 0.01, 5, 0, s), coll(6, 7 + r * 0.1, 0, s, comm=sub), coll(8, 9, 1, s, comm=sub),
                coll(10, 11, 1, s)]  # fmt: skip
        write_rank(d, r, 4, rows, s)
    c = collectives_of(align(load_run(d)))
    assert len(c) == 6 and np.all(c.g_state == MatchState.COMPLETE)
    n_by_comm = {c.comm_name(g): int(c.g_n_members[g]) for g in range(len(c))}
    assert n_by_comm == {"world": 4, "sub-a": 2, "sub-b": 2}
    w0 = [g for g in range(len(c)) if c.comm_name(g) == "world" and c.g_seq[g] == 0][0]
    assert c.g_last_rank[w0] == 3 and c.g_last_ns[w0] - c.g_second_ns[w0] == int(0.01 * MS)


def test_async_collectives_are_matched_too_and_point_to_point_is_not(tmp_path: Path) -> None:
    s = [""]
    r0 = [coll(1, 5, 0, s, op="Iallreduce", kind=Kind.COLL_ASYNC), coll(6, 7, -1, s, op="Send", kind=Kind.SEND)]
    r1 = [coll(2, 5, 0, s, op="Iallreduce", kind=Kind.COLL_ASYNC), coll(6, 7, -1, s, op="Recv", kind=Kind.RECV)]
    c = _two_rank_run(tmp_path, r0, r1, s)
    assert len(c) == 1 and c.op_name(0) == "Iallreduce" and c.g_last_rank[0] == 1


def test_no_collectives_gives_an_empty_match(tmp_path: Path) -> None:
    s = [""]
    c = _two_rank_run(tmp_path, [coll(1, 2, -1, s, op="Send", kind=Kind.SEND)], [], s)
    assert len(c) == 0 and len(c.g_start) == 1


def test_a_repeated_row_counts_once(tmp_path: Path) -> None:
    # A damaged file or a hook bug can repeat a (comm, seq, rank): one member, the earliest row.
    s = [""]
    c = _two_rank_run(tmp_path, [coll(1, 3, 0, s), coll(1.2, 3, 0, s)], [coll(2, 3, 0, s)], s)
    assert len(c) == 1 and c.g_n_members[0] == 2 and c.g_state[0] == MatchState.COMPLETE
    assert list(c.m_t0_ns) == [1 * MS, 2 * MS]


@pytest.mark.parametrize("block_rows", [1, 5, 64, 1 << 18])
def test_arrival_order_is_the_lexsort_of_group_key_then_arrival(block_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The packed-value sorts must give exactly the stable order (ties by row), whatever
    # the blocks, and fall back when arrivals spread too far to pack (the last cases).
    from distdiag import match

    monkeypatch.setattr(match, "_ORDER_ROWS", block_rows)
    rng = np.random.default_rng(block_rows)
    i64 = np.iinfo(np.int64)
    for trial in range(120):
        n = int(rng.integers(1, 2000))
        gkey = rng.integers(0, int(rng.integers(1, 60)), n) * int(rng.choice([1, 9, 1 << 20, 1 << 40]))
        t0 = rng.integers(0, int(rng.choice([2, 1000, 1 << 40, 1 << 60])), n) + int(rng.choice([0, -7, 1 << 61]))
        if trial % 10 == 0:
            t0 = rng.choice(np.array([i64.min + 1, 0, i64.max]), n)
        if trial % 10 == 5:  # keys too wide to pack with the row index: the stable argsort
            gkey = rng.choice(np.array([-(1 << 62), 0, (1 << 62) - 1]), n)
        order, starts = match.arrival_order(gkey, t0)
        ref = np.lexsort((t0, gkey))
        np.testing.assert_array_equal(order, ref)
        gk = gkey[ref]
        np.testing.assert_array_equal(starts, np.flatnonzero(np.r_[True, gk[1:] != gk[:-1]]))
        np.testing.assert_array_equal(match.stable_order(gkey), np.argsort(gkey, kind="stable"))
        o, sk = match._stable_order_keys(gkey)  # the sorted keys, decoded or gathered
        np.testing.assert_array_equal(sk, gkey[o])
        assert sk.dtype == gkey.dtype


def test_key_selector_by_blocks_equals_one_pass_and_is_taken_only_for_its_table(tmp_path: Path) -> None:
    # align selects the collective rows while it maps the table (KeySelector, fed by its
    # blocks): the same rows and keys as one pass, whatever the blocks; a selection
    # made on another table, or not fed to the end, is ignored by match_collectives.
    from distdiag import match

    s = [""]
    write_rank(tmp_path, 0, 2, [coll(2 * i, 2 * i + 1.5, i, s) for i in range(40)], strings=s)
    write_rank(tmp_path, 1, 2, [coll(2 * i + 0.5, 2 * i + 1.5, i, s) for i in range(40)], strings=s)
    run = load_run(tmp_path)
    ev = run.events
    want_idx, want = match.select_keys(ev)
    assert len(want_idx) == 80
    for cuts in ([0, 80], [0, 1, 2, 50, 80], [0, 7, 13, 80]):
        ks = match.KeySelector(len(ev), ev.dtype)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            ks.add(ev[lo:hi], lo)
        idx, got = ks.result()
        np.testing.assert_array_equal(idx, want_idx)
        for f in want:
            np.testing.assert_array_equal(got[f], want[f])
    with pytest.raises(ValueError):
        match.KeySelector(len(ev), ev.dtype).add(ev[5:9], 5)
    ref = match_collectives(run.replace())
    assert list(ref.m_rank[:2]) == [0, 1]
    # keys of another table (rank 1 arriving first): not used, unless given as this table's
    other = ev.copy()
    other["t0_ns"][other["rank"] == 1] -= MS
    ks = match.KeySelector(len(ev), ev.dtype)
    ks.add(other, 0)
    for pre in ((other, ks), (ev, match.KeySelector(len(ev), ev.dtype))):  # another table; unfinished
        probe = run.replace()
        probe.cache.selected_keys = pre
        c = match_collectives(probe)
        np.testing.assert_array_equal(c.m_rank, ref.m_rank)
        assert probe.cache.selected_keys is None  # taken
    probe = run.replace()
    probe.cache.selected_keys = (ev, ks)  # this table, fed to the end: its keys order the members
    assert list(match_collectives(probe).m_rank[:2]) == [1, 0]
