"""distdiag.replay on small hand-built runs whose counterfactual exits are worked out by hand.

Every run is written as real rank files (tests/factories.write_rank, one true
clock) and goes through the analyzer's own load, align and match; the replay
model is then asked what-if questions whose answers are computed in the
comments. The MPI jobs that check the replay's prices against measured savings
are in tests/test_serial_section.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag import replay
from distdiag.clocks import align
from distdiag.findings import Finding
from distdiag.match import collectives_of
from distdiag.replay import Change
from distdiag.run import load_run
from distdiag.schema import Kind
from factories import MS, XFER_MS, coll, make_run, p2p_row, simulate_p2p, write_rank


def phase(t0_ms: float, t1_ms: float, strings: list[str], name: str = "work") -> tuple[Any, ...]:
    if name not in strings:
        strings.append(name)
    return (int(t0_ms * MS), int(t1_ms * MS), int(Kind.PHASE), strings.index(name), 0, -1, -1, 0, 0, 0, 0, 0.0)


def model_of(run_dir: Path) -> replay.Model:
    run = align(load_run(run_dir))
    return replay.model(run, collectives_of(run))


def ms(x: Any) -> Any:
    return np.asarray(x) / MS


def drop(what: str, rank: int, t0_ms: float, t1_ms: float) -> Change:
    """``rank``'s time [t0_ms, t1_ms) taken out of its run."""
    return Change(what, drop_rank=np.array([rank]), drop_t0=np.array([int(t0_ms * MS)]), drop_t1=np.array([int(t1_ms * MS)]))


def test_the_recorded_durations_replay_the_recorded_exits(tmp_path: Path) -> None:
    """16 ranks x 200 all-reduces with jitter and a straggler: every rank's replayed end is its recorded
    end to the nanosecond, and a change that changes nothing saves nothing."""
    make_run(tmp_path, world_size=16, iters=200, slow_rank=5, slow_ms=2.0, slow_every=3, seed=4)
    m = model_of(tmp_path)
    assert m.reason == "" and len(m.order) == 200
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
    np.testing.assert_array_equal(m.replay(Change("nothing"))[m.present], m.end_ns[m.present])
    assert m.saving_s(Change("nothing")) == 0.0


def test_a_straggler_at_its_peers_median_saves_what_it_cost(tmp_path: Path) -> None:
    """Rank 2 computes 3 ms longer every iteration: at the others' median it saves about the truth's
    cost (the simulation's last-minus-second-to-last arrivals); its healthy twin saves under 1%."""
    t = make_run(tmp_path / "slow", world_size=8, iters=80, slow_rank=2, slow_ms=3.0, jitter_ms=0.2, seed=1)
    m = model_of(tmp_path / "slow")
    saving = m.saving_s(Change("rank 2 at the median", median_ranks=np.array([2])))
    assert saving == pytest.approx(t.straggler_cost_s(2), rel=0.1)
    assert m.saving_s(Change("rank 4 at the median", median_ranks=np.array([4]))) < 0.01 * saving
    make_run(tmp_path / "ok", world_size=8, iters=80, jitter_ms=0.2, seed=1)
    h = model_of(tmp_path / "ok")
    wall = h.wall_ns / 1e9
    for r in range(8):
        assert h.saving_s(Change(f"rank {r} at the median", median_ranks=np.array([r]))) < 0.01 * wall


def _rooted(tmp_path: Path, op: str, root: int, t: dict[int, tuple[float, float]],
            then: tuple[float, ...] = (12.0, 13.0, 14.0)) -> replay.Model:  # fmt: skip
    """3 ranks: a rooted collective ``op`` (arrival, exit per rank, ms), then an all-reduce whose
    arrivals are ``then`` and whose exits are 15 ms; every rank ends at 15 ms."""
    s: list[str] = [""]
    for r in range(3):
        rows = [phase(0.0, 0.5, s), coll(*t[r], 0, s, op=op, root=root), coll(then[r], 15.0, 1, s)]
        write_rank(tmp_path, r, 3, rows, s)
    m = model_of(tmp_path)
    assert m.reason == ""
    np.testing.assert_array_equal(ms(m.start_ns), [0, 0, 0])
    np.testing.assert_array_equal(ms(m.end_ns), [15, 15, 15])
    np.testing.assert_array_equal(m.replay(None), m.end_ns)
    return m


def test_a_bcast_waits_for_its_root_only(tmp_path: Path) -> None:
    """Bcast from rank 0, which arrives at 10 ms (the others at 1 ms, waiting for it). 6 ms cut from
    the root's work: root exit' 4 + 1 = 5; rank 1 max(1, 4) + (11.5 - 10) = 5.5; rank 2 4 + 1.2 = 5.2.
    All-reduce: arrivals' 5 + 1 = 6, 5.5 + 1.5 = 7, 5.2 + 2.8 = 8; exits' 8 + 1 = 9: 6 ms saved."""
    m = _rooted(tmp_path, "Bcast", 0, {0: (10.0, 11.0), 1: (1.0, 11.5), 2: (1.0, 11.2)})
    cut = drop("root's work 6 ms shorter", 0, 2.0, 8.0)
    np.testing.assert_array_equal(ms(m.replay(cut)), [9, 9, 9])
    assert m.saving_s(cut) == pytest.approx(0.006, abs=1e-9)
    # a waiting non-root's work before it (all of it: 1 ms) taken out changes nothing: the bcast waits for the root
    idle = drop("rank 1's work taken out", 1, 0.0, 1.0)
    assert m.saving_s(idle) == 0.0


def test_a_non_root_that_comes_after_the_root_does_not_hold_it(tmp_path: Path) -> None:
    """Bcast from rank 0 (arrives 10 ms); rank 2 comes after it (10.5, leaves 10.8 without waiting).
    6 ms cut from the root: exits' 5, 5.5 and 10.8 (rank 2 still its own arrival + 0.3); the
    all-reduce (arrivals 12, 13, 11.5; exits 15: transfer 2) gets 6, 7, 11.5: exits' 13.5, 1.5 ms
    saved. Were the bcast waited on by every member, rank 2's 10.5 would hold all: nothing saved."""
    m = _rooted(tmp_path / "b", "Bcast", 0, {0: (10.0, 11.0), 1: (1.0, 11.5), 2: (10.5, 10.8)}, then=(12.0, 13.0, 11.5))
    cut = drop("root's work 6 ms shorter", 0, 2.0, 8.0)
    np.testing.assert_allclose(ms(m.replay(cut)), [13.5, 13.5, 13.5])


def test_launch_skew_is_not_a_stragglers(tmp_path: Path) -> None:
    """Rank 3 reaches its first all-reduce 45 ms after the others (it started late: startup's to
    price), then keeps pace for 5 more: at its peers' median it saves nothing; a rank 3 that is
    also 2 ms slow before every later one saves 5 x 1.8 ms (down to its slowest peer, rank 2 at +0.2)."""
    for d, extra in (("skew", 0.0), ("slow", 2.0)):
        s: list[str] = [""]
        for r in range(4):
            rows = [phase(0.0, 0.5, s), coll(50.0 if r == 3 else 5.0, 51.0, 0, s)]
            for i in range(1, 6):
                t = 51.0 + 5.0 * i
                rows.append(coll(t + (extra if r == 3 else 0.1 * r), t + extra + 1.0, i, s))
            write_rank(tmp_path / d, r, 4, rows, s)
        m = model_of(tmp_path / d)
        assert m.saving_s(Change("rank 3 at the median", median_ranks=np.array([3]))) == pytest.approx(
            0.005 * extra - (0.0002 * 5 if extra else 0.0), abs=1e-9)


def test_a_reduce_keeps_its_non_roots_free(tmp_path: Path) -> None:
    """Reduce to rank 0; rank 2 arrives at 10 ms, rank 1 leaves at 1.2 ms without waiting. 8 ms cut
    from rank 2: root exit' max(1, 1, 2) + 0.5 = 2.5, rank 1 1 + 0.2 = 1.2 (never waited), rank 2
    2 + 0.3 = 2.3; all-reduce arrivals' 2.5 + 1.5 = 4, 1.2 + 11.8 = 13, 2.3 + 3.7 = 6: exits' 13 + 1 = 14.
    Rank 1's own work before the all-reduce binds now: 1 ms saved, not 8."""
    m = _rooted(tmp_path, "Reduce", 0, {0: (1.0, 10.5), 1: (1.0, 1.2), 2: (10.0, 10.3)})
    cut = drop("rank 2's work 8 ms shorter", 2, 1.0, 9.0)
    np.testing.assert_allclose(ms(m.replay(cut)), [14, 14, 14])
    assert m.saving_s(cut) == pytest.approx(0.001, abs=1e-9)


def _two_ranks(tmp_path: Path) -> replay.Model:
    """2 ranks, all-reduce A (arrivals 4, 9 ms; exits 10), all-reduce B (arrivals 12, 15; exits 16);
    then rank 0 works until 20 ms, rank 1 until 30 ms."""
    s: list[str] = [""]
    write_rank(tmp_path, 0, 2, [phase(0.0, 1.0, s), coll(4.0, 10.0, 0, s), coll(12.0, 16.0, 1, s), phase(16.0, 20.0, s)], s)
    write_rank(tmp_path, 1, 2, [phase(0.0, 1.0, s), coll(9.0, 10.0, 0, s), coll(15.0, 16.0, 1, s), phase(16.0, 30.0, s)], s)
    m = model_of(tmp_path)
    np.testing.assert_array_equal(ms(m.end_ns), [20, 30])
    np.testing.assert_array_equal(m.replay(None), m.end_ns)
    return m


def test_dropped_time_leaves_segments_and_the_tail_and_counts_once(tmp_path: Path) -> None:
    """Rank 1's [2, 4) and [3, 6) (4 ms of union, before A), [9.5, 11) (0.5 ms inside A: kept; 1 ms
    before B) and [25, 28) (3 ms of its tail) dropped. A: arrivals' 4, 9 - 4 = 5, exits' 5 + 1 = 6;
    B: 6 + 2 = 8, 6 + (5 - 1) = 10, exits' 11; ends' 11 + 4 = 15 and 11 + (14 - 3) = 22: 8 ms saved."""
    m = _two_ranks(tmp_path)
    drop = Change(
        "rank 1's waits removed",
        drop_rank=np.array([1, 1, 1, 1]),
        drop_t0=np.array([2, 3, 9.5, 25]) * MS,
        drop_t1=np.array([4, 6, 11, 28]) * MS,
    )
    np.testing.assert_array_equal(ms(m.replay(drop)), [15, 22])
    assert m.saving_s(drop) == pytest.approx(0.008, abs=1e-9)
    # rank 0's time (it waits in A anyway): dropping 2 ms of its work before A saves nothing
    mine = Change("rank 0's", drop_rank=np.array([0]), drop_t0=np.array([1 * MS]), drop_t1=np.array([3 * MS]))
    assert m.saving_s(mine) == 0.0


def test_two_changes_together(tmp_path: Path) -> None:
    """``plus``: rank 1's 4 ms before A and its 3 ms of tail, each alone and together (4 + 3 ms: the
    tail binds the end either way); two transfer cuts of one group take the larger."""
    m = _two_ranks(tmp_path)
    early = Change("early", drop_rank=np.array([1]), drop_t0=np.array([2 * MS]), drop_t1=np.array([6 * MS]))
    late = Change("late", drop_rank=np.array([1]), drop_t0=np.array([25 * MS]), drop_t1=np.array([28 * MS]))
    both = early.plus(late)
    assert both.what == "early; late"
    assert m.saving_s(early) == pytest.approx(0.004, abs=1e-9)
    assert m.saving_s(late) == pytest.approx(0.003, abs=1e-9)
    assert m.saving_s(both) == pytest.approx(0.007, abs=1e-9)
    n = len(m.colls)
    b = group_of_seq(m, 1)
    one, two = np.zeros(n, np.int64), np.zeros(n, np.int64)
    one[b], two[b] = MS // 2, MS // 4
    fast = Change("B 0.5 ms faster", transfer_cut_ns=one).plus(Change("B 0.25 ms faster", transfer_cut_ns=two))
    assert fast.transfer_cut_ns is not None and int(fast.transfer_cut_ns[b]) == MS // 2
    np.testing.assert_array_equal(ms(m.replay(fast)), [19.5, 29.5])
    assert m.saving_s(Change("B no transfer", transfer_cut_ns=one * 10)) == pytest.approx(0.001, abs=1e-9)


def test_a_proportional_transfer_cut_takes_the_members_spread_with_it(tmp_path: Path) -> None:
    """3 ranks, all-reduce A (every arrival at 1 ms; exits 9, 11, 13: transfers 8, 10, 12, the
    median member's 10), 1 ms of work each, all-reduce B (arrivals 10, 12, 14; exits 15), 1 ms
    more. A's transfer 5 ms shorter, by seconds: 3, 5, 7 -> exits 4, 6, 8, B's arrivals 5, 7, 9,
    exits 10, ends 11: 5 ms saved, the 4 ms spread kept. By the same share (5 of the median's 10:
    each member keeps half): 4, 5, 6 -> exits 5, 6, 7, arrivals 6, 7, 8, exits 9, ends 10: 6 ms
    (a slow ring's last members lose their excess too, replay.Change.transfer_ref_ns)."""
    s: list[str] = [""]
    for r, a_exit in enumerate((9.0, 11.0, 13.0)):
        write_rank(tmp_path, r, 3, [phase(0.0, 1.0, s), coll(1.0, a_exit, 0, s), phase(a_exit, a_exit + 1, s),
                                    coll(a_exit + 1, 15.0, 1, s), phase(15.0, 16.0, s)], s)  # fmt: skip
    run = load_run(tmp_path)  # the files' one true clock: align would read A's spread as clock offsets
    m = replay.model(run, collectives_of(run))
    np.testing.assert_array_equal(ms(m.end_ns), [16, 16, 16])
    np.testing.assert_array_equal(m.replay(None), m.end_ns)
    a = group_of_seq(m, 0)
    cut, ref = np.zeros(len(m.colls), np.int64), np.zeros(len(m.colls), np.int64)
    cut[a], ref[a] = 5 * MS, 10 * MS
    by_seconds = Change("A 5 ms faster", transfer_cut_ns=cut)
    by_share = Change("A at half its transfer", transfer_cut_ns=cut, transfer_ref_ns=ref)
    np.testing.assert_array_equal(ms(m.replay(by_seconds)), [11, 11, 11])
    np.testing.assert_array_equal(ms(m.replay(by_share)), [10, 10, 10])
    assert m.saving_s(by_share) == pytest.approx(0.006, abs=1e-9)
    # a cut past the ref takes all of it, never more; two causes of one transfer: the larger
    # (exits 1, arrivals 2, exits 3, ends 4: 12 ms)
    assert m.saving_s(Change("A no transfer", transfer_cut_ns=cut * 3, transfer_ref_ns=ref)) == pytest.approx(0.012, abs=1e-9)
    both = by_seconds.plus(by_share)
    assert both.transfer_ref_ns is not None and m.saving_s(both) == pytest.approx(0.006, abs=1e-9)


def group_of_seq(m: replay.Model, seq: int) -> int:
    c = m.colls
    ids = [g for g in m.order.tolist() if int(c.g_seq[g]) == seq]
    assert len(ids) == 1
    return ids[0]


def test_what_the_replay_cannot_see_is_said_not_priced_zero(tmp_path: Path) -> None:
    """A faster transfer of a non-blocking all-reduce (inside a segment, as recorded): evidence.replay says why
    not, with no saving; a straggler change on the same run is priced (one non-blocking collective
    among 200 blocking ones: under ASYNC_SHARE, the run is not coupled through them)."""
    s: list[str] = [""]
    for r in range(2):
        rows = [phase(0.0, 1.0, s), coll(2.0, 3.0, 0, s, op="Iallreduce", kind=Kind.COLL_ASYNC)]
        rows += [coll(5.0 + 5 * i + r, 8.0 + 5 * i, 1 + i, s) for i in range(200)]
        write_rank(tmp_path, r, 2, rows, s)
    run = align(load_run(tmp_path))
    colls = collectives_of(run)
    m = replay.model(run, colls)
    i = [g for g in range(len(colls)) if colls.strings[int(colls.g_op[g])] == "Iallreduce"]
    assert len(i) == 1 and i[0] not in m.order.tolist()
    fast = np.zeros(len(colls), np.int64)
    fast[i] = MS
    async_cut = Change("the Iallreduce's", transfer_cut_ns=fast)
    assert not async_cut.touches(m)
    assert Change("rank 1", median_ranks=np.array([1])).touches(m)
    f = Finding("slow_link", 0.001, "x", change=async_cut)
    g = Finding("straggler", 0.001, "y", change=Change("rank 1 at the median", median_ranks=np.array([1])))
    replay.price([f, g], run, colls)
    assert f.evidence["replay"] == {"saving_s": None, "counterfactual": "the Iallreduce's", "why_not": replay.NOT_REPLAYED}
    assert g.evidence["replay"]["counterfactual"] == "rank 1 at the median" and "why_not" not in g.evidence["replay"]


def test_a_run_whose_order_breaks_is_not_replayed(tmp_path: Path) -> None:
    """Rank 0 bcasts (root, leaves at 1.1 ms) and then all-reduces with rank 2 on "sub" (last arrival
    3.5 ms) while rank 1 reaches the bcast at 20 ms: by last arrival the all-reduce comes first,
    against rank 0's own order. The model says so, and a finding's replay says why not."""
    s: list[str] = [""]
    write_rank(tmp_path, 0, 3, [phase(0.0, 0.5, s), coll(1.0, 1.1, 0, s, op="Bcast", root=0),
                                coll(3.0, 4.0, 0, s, comm="sub")], s)  # fmt: skip
    write_rank(tmp_path, 1, 3, [phase(0.0, 0.5, s), coll(20.0, 20.1, 0, s, op="Bcast", root=0)], s)
    write_rank(tmp_path, 2, 3, [phase(0.0, 0.5, s), coll(2.0, 2.1, 0, s, op="Bcast", root=0),
                                coll(3.5, 4.0, 0, s, comm="sub")], s)  # fmt: skip
    run = align(load_run(tmp_path))
    colls = collectives_of(run)
    m = replay.model(run, colls)
    assert "out of its own order" in m.reason
    f = Finding("straggler", 0.001, "y", change=Change("rank 1 at the median", median_ranks=np.array([1])))
    replay.price([f], run, colls)
    assert f.evidence["replay"]["saving_s"] is None and f.evidence["replay"]["why_not"] == m.reason


def test_a_network_bound_run_replayed_with_a_network_that_takes_no_time(tmp_path: Path) -> None:
    """4 ranks, 60 all-reduces whose transfers take 4 ms after 2 ms of compute: the network_bound
    finding's replay (every such transfer at 0) saves 60 x 4 ms; with 0.3 ms transfers, no finding."""
    from distdiag.config import Config
    from distdiag.pipeline import analyze

    make_run(tmp_path / "slow", world_size=4, iters=60, compute_ms=2.0, jitter_ms=0.05, transfer_ms=4.0)
    got = [f for f in analyze(tmp_path / "slow", Config()).findings if f.kind == "network_bound"]
    assert len(got) == 1
    rp = got[0].evidence["replay"]
    assert rp["saving_s"] == pytest.approx(60 * 0.004, rel=0.02) and "no time" in rp["counterfactual"]
    make_run(tmp_path / "ok", world_size=4, iters=60, compute_ms=2.0, jitter_ms=0.05, transfer_ms=0.3)
    assert analyze(tmp_path / "ok", Config()).findings == []


@pytest.mark.parametrize("fabric_MB_per_s, saved_ms", [(0.0, 4.0), (6.144, 2.0), (12.288, 3.0), (3.0, None)])
def test_a_network_bound_run_priced_at_the_fabrics_bandwidth(tmp_path: Path, fabric_MB_per_s: float,
                                                             saved_ms: float | None) -> None:
    """The same 60 all-reduces of 8 KiB on 4 ranks (bus bytes 12,288: 2(n-1)/n of the buffer) whose
    transfers take 4 ms (3.07 MB/s): at a fabric of 6.144 MB/s each would take 2 ms, at 12.288 MB/s
    1 ms; unknown, the network taking no time is the upper bound; a fabric slower than the run
    achieved leaves nothing to save: no finding."""
    from distdiag.config import Config
    from distdiag.pipeline import analyze

    make_run(tmp_path / "r", world_size=4, iters=60, compute_ms=2.0, jitter_ms=0.05, transfer_ms=4.0)
    cfg = Config()
    cfg.sections["network_bound"] = {"fabric_MB_per_s": fabric_MB_per_s}
    got = [f for f in analyze(tmp_path / "r", cfg).findings if f.kind == "network_bound"]
    if saved_ms is None:
        assert got == []
        return
    (f,) = got
    assert f.cost_s == pytest.approx(60 * saved_ms * 1e-3, rel=0.03)
    assert f.evidence["detector_cost_s"] == pytest.approx(60 * saved_ms * 1e-3, rel=0.03)
    assert f.evidence["fabric_MB_per_s"] == (fabric_MB_per_s or None)


def test_causes_removed_one_after_another_count_each_second_once(tmp_path: Path) -> None:
    """``cumulate`` in the ranking's order: rank 1's 4 ms before A (saves 4), the same rank-time
    claimed again by a second finding (adds 0: the union), its 3 ms of tail (adds 3); a finding the
    replay cannot see is left out of the sum."""
    m = _two_ranks(tmp_path)

    def f(kind: str, ch: Change | None) -> Finding:
        x = Finding(kind, 0.0, kind, change=ch)
        if ch is not None:
            x.evidence["replay"] = {"saving_s": m.saving_s(ch), "counterfactual": ch.what}
        return x

    early = Change("early", drop_rank=np.array([1]), drop_t0=np.array([2 * MS]), drop_t1=np.array([6 * MS]))
    again = Change("again", drop_rank=np.array([1, 1]), drop_t0=np.array([2, 4]) * MS, drop_t1=np.array([4, 6]) * MS)
    late = Change("late", drop_rank=np.array([1]), drop_t0=np.array([25 * MS]), drop_t1=np.array([28 * MS]))
    ranked = [f("input_bound", early), f("io_bound", again), f("hang", None), f("startup", late)]
    replay.cumulate(ranked, m)
    got = [(x.evidence["replay"]["together_s"], x.evidence["replay"]["after_above_s"]) for x in ranked if x.change]
    assert got == [(0.004, 0.004), (0.004, 0.0), (0.007, 0.003)]
    assert "replay" not in ranked[2].evidence


def test_a_run_coupled_through_non_blocking_collectives_is_replayed_only_before_them(tmp_path: Path) -> None:
    """A blocking all-reduce at 5-6 ms, then 20 Iallreduces (DDP's buckets: how the ranks wait for
    each other from then on, which the replay keeps as recorded). Rank 1's 3 ms before the
    all-reduce are priced; its time after the first Iallreduce, and a straggler's pace, are not."""
    s: list[str] = [""]
    for r in range(2):
        rows = [phase(0.0, 1.0, s), coll(5.0 + r, 7.0, 0, s)]
        rows += [coll(10.0 + 2 * i, 11.0 + 2 * i, 1 + i, s, op="Iallreduce", kind=Kind.COLL_ASYNC) for i in range(20)]
        rows.append(phase(50.0, 60.0, s))
        write_rank(tmp_path, r, 2, rows, s)
    run = align(load_run(tmp_path))
    colls = collectives_of(run)
    m = replay.model(run, colls)
    assert m.reason == "" and m.coupled_from_ns == 10 * MS and "20 non-blocking" in m.coupled_why
    early = Finding("input_bound", 0.0, "a", change=Change("early", drop_rank=np.array([1]),
                                                            drop_t0=np.array([2 * MS]), drop_t1=np.array([5 * MS])))  # fmt: skip
    late = Finding("input_bound", 0.0, "b", change=Change("late", drop_rank=np.array([1]),
                                                           drop_t0=np.array([52 * MS]), drop_t1=np.array([55 * MS])))  # fmt: skip
    pace = Finding("straggler", 0.0, "c", change=Change("pace", median_ranks=np.array([1])))
    replay.price([early, late, pace], run, colls)
    assert early.evidence["replay"]["saving_s"] == pytest.approx(0.001, abs=1e-6)  # rank 0 arrives at 5, rank 1 at 6 - 3
    for f in (late, pace):
        assert f.evidence["replay"]["saving_s"] is None and f.evidence["replay"]["why_not"] == m.coupled_why


def test_point_to_point_waits_couple_the_run_from_the_first(tmp_path: Path) -> None:
    """Rank 1 receives from rank 0 for 20 ms of a 70 ms run (a halo exchange the replay keeps as
    recorded): a change after the first receive is not replayed; 1 ms of receives would not count."""
    for d, recv_ms in (("p2p", 20.0), ("little", 1.0)):
        s: list[str] = [""]
        for r in range(2):
            rows = [phase(0.0, 1.0, s), coll(5.0 + r, 7.0, 0, s)]
            if r == 1:
                rows.append((int(10 * MS), int((10 + recv_ms) * MS), int(Kind.RECV), 0, 0, -1, 0, 1024, 0, 0, 0, 0.0))
            rows.append(phase(40.0, 60.0 + 10 * r, s))  # rank 1 ends last, at 70 ms
            write_rank(tmp_path / d, r, 2, rows, s)
        m = model_of(tmp_path / d)
        late = Change("late", drop_rank=np.array([1]), drop_t0=np.array([45 * MS]), drop_t1=np.array([48 * MS]))
        if recv_ms > 1.0:
            assert m.coupled_from_ns == 10 * MS and "point-to-point" in m.coupled_why and late.reaches(m, m.coupled_from_ns)
        else:
            assert m.coupled_why == "" and m.saving_s(late) == pytest.approx(0.003, abs=1e-6)


def _ddp_steps(tmp_path: Path, n_steps: int = 5) -> replay.Model:
    """Two ranks, ``n_steps`` DDP steps of 20 ms (t in ms from T = 20 i): a BACKWARD row from 2 to 15;
    bucket 1 launched at 4 and done at 7 (behind the backward's compute); bucket 2 launched at
    8 by rank 0 and at 10 by rank 1 (2 ms more compute), done at 15: DDP's finalize waits from
    the last launch to 15. No WAIT rows: the waits are the BACKWARD rows'."""
    s: list[str] = [""]
    for r in range(2):
        rows = []
        for i in range(n_steps):
            t = 20.0 * i
            rows.append((int((t + 2) * MS), int((t + 15) * MS), int(Kind.BACKWARD), 0, 0, -1, -1, 0, 0, 0, 0, 0.0))
            for k, (a, b) in enumerate([(4.0, 7.0), (8.0 + 2.0 * r, 15.0)]):
                rows.append(coll(t + a, t + b, 2 * i + k, s, op="ddp_bucket_allreduce", comm="ddp0:default",
                                 kind=Kind.COLL_ASYNC, nbytes=1 << 20))  # fmt: skip
        rows.append(phase(20.0 * n_steps - 1, 20.0 * n_steps, s))
        write_rank(tmp_path, r, 2, rows, s)
    return model_of(tmp_path)


def _cut_on(m: replay.Model, bucket: int, ns: int) -> Change:
    c = m.colls
    cut = np.zeros(len(c), np.int64)
    cut[(c.g_seq % 2) == bucket] = ns
    return Change(f"bucket {bucket + 1} faster", transfer_cut_ns=cut)


def test_ddp_buckets_are_replayed_through_the_finalize_that_waits_for_them(tmp_path: Path) -> None:
    """The buckets are rendezvous (no coupling left); the recorded run replays exactly; the network
    taking no time saves the 5 ms a step waited after the last launch; rank 1 at rank 0's pace
    saves its 2 ms a step (at a typical peer's excess over it, what that leaves); bucket 1's
    transfer, hidden behind compute, saves nothing."""
    n = 5
    m = _ddp_steps(tmp_path, n)
    assert m.reason == "" and m.coupled_why == "" and len(m.order) == 2 * n
    assert m.waits is not None and int((~m.waits.launch).sum()) == 2 * n  # one finalize per rank and step
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
    assert m.saving_s(_cut_on(m, 1, 10**12)) == pytest.approx(n * 0.005, abs=1e-9)  # done at the last launch
    assert m.saving_s(_cut_on(m, 1, 2 * MS)) == pytest.approx(n * 0.002, abs=1e-9)
    assert m.saving_s(Change("rank 1 at the median", median_ranks=np.array([1]))) == pytest.approx(n * 0.002, abs=1e-9)
    # at a typical peer's pace instead (Change.like_peers: its 2 ms over the median mapped to 1 ms), half of it
    like = {1: (np.array([0.0, 2.0 * MS]), np.array([0.0, 1.0 * MS]))}
    paced = Change("rank 1 like its peers", median_ranks=np.array([1]), like_peers=like)
    assert m.saving_s(paced) == pytest.approx(n * 0.001, abs=1e-9)
    assert m.saving_s(_cut_on(m, 0, 10**12)) == 0.0
    # rank 1's 2 ms before its last launch taken out (a drop inside the backward's compute) saves them
    assert m.saving_s(drop("late grads", 1, 28.0, 30.0)) == pytest.approx(0.002, abs=1e-9)


def test_an_iallreduce_waited_in_mpi_wait_is_replayed_from_the_wait(tmp_path: Path) -> None:
    """Two ranks, 4 steps of 20 ms: an Iallreduce launched at 1, compute, MPI_Wait from 6 (rank 0)
    or 8 (rank 1) to 12, done at 12. Replayed exactly; its transfer 3 ms shorter ends every wait
    at 9, saving 3 ms a step; without the WAIT rows the run is coupled and not replayed."""
    for waits in (True, False):
        s: list[str] = ["", "Wait"]
        d = tmp_path / str(waits)
        for r in range(2):
            rows = []
            for i in range(4):
                t = 20.0 * i
                rows.append(coll(t + 1, t + 12, i, s, op="Iallreduce", kind=Kind.COLL_ASYNC))
                if waits:
                    rows.append((int((t + 6 + 2 * r) * MS), int((t + 12) * MS), int(Kind.WAIT), s.index("Wait"), 0, i,
                                 -1, 0, 0, 0, 0, 0.0))  # fmt: skip
            rows.append(phase(79.0, 80.0, s))
            write_rank(d, r, 2, rows, s)
        m = model_of(d)
        cut = Change("faster", transfer_cut_ns=np.full(len(m.colls), 3 * MS, np.int64))
        if not waits:
            assert "non-blocking" in m.coupled_why and len(m.order) == 0
            continue
        assert m.coupled_why == "" and len(m.order) == 4
        np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
        assert m.saving_s(cut) == pytest.approx(4 * 0.003, abs=1e-9)


def _random_async_run(d: Path, seed: int) -> replay.Model:
    """2-5 ranks, 3-7 steps of 1-3 buckets each, random compute and transfers; each step's
    buckets waited either by DDP's finalize (a BACKWARD row) or in MPI_Wait rows (one per
    bucket), and a blocking all-reduce every other step."""
    rng = np.random.default_rng(seed)
    n, steps, buckets = int(rng.integers(2, 6)), int(rng.integers(3, 8)), int(rng.integers(1, 4))
    s: list[str] = [""]
    s.append("Wait")
    rows: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]
    t = np.zeros(n)  # each rank's clock, ms
    seq_b = 0
    for i in range(steps):
        ddp = bool(rng.integers(0, 2))
        launches = []
        b0 = t.copy()
        for k in range(buckets):
            t += rng.uniform(0.5, 3.0, n)  # compute up to the bucket's gradients
            launches.append(t.copy())
        done = [float(la.max()) + float(rng.uniform(0.2, 4.0)) for la in launches]
        for k in range(1, buckets):  # a bucket's all-reduce starts after the one before it
            done[k] = max(done[k], done[k - 1] + 0.1)
        for r in range(n):
            if ddp:
                end = max(t[r], done[-1]) + 0.05
                rows[r].append((int(b0[r] * MS), int(end * MS), int(Kind.BACKWARD), 0, 0, -1, -1, 0, 0, 0, 0, 0.0))
                for k in range(buckets):
                    c = done[k] + float(rng.uniform(0, 0.3))  # the callback's stamp, maybe after the backward
                    rows[r].append(coll(launches[k][r], c, seq_b + k, s, op="ddp_bucket_allreduce", comm="ddp",
                                        kind=Kind.COLL_ASYNC))  # fmt: skip
                t[r] = end
            else:
                for k in range(buckets):
                    w0 = max(t[r], launches[k][r]) + float(rng.uniform(0, 1.0))
                    w1 = max(w0, done[k])
                    rows[r].append((int(w0 * MS), int(w1 * MS), int(Kind.WAIT), 1, 0, -1, -1, 0, 0, 0, 0, 0.0))
                    rows[r].append(coll(launches[k][r], w1, seq_b + k, s, op="Iallreduce", comm="mpi",
                                        kind=Kind.COLL_ASYNC))  # fmt: skip
                    t[r] = w1 + 0.01
        seq_b += buckets
        if i % 2:
            t += rng.uniform(0.5, 2.0, n)
            arrive = t.copy()
            out = float(arrive.max()) + 0.3
            for r in range(n):
                rows[r].append(coll(arrive[r], out, i, s))
            t[:] = out
    for r in range(n):
        rows[r].append(phase(float(t[r]) + 0.1, float(t[r]) + 1.0, s))
        write_rank(d, r, n, sorted(rows[r]), s)
    return model_of(d)


@pytest.mark.parametrize("seed", range(12))
def test_random_runs_with_waited_buckets_replay_exactly_and_removing_more_never_costs(tmp_path: Path,
                                                                                      seed: int) -> None:  # fmt: skip
    """Random runs of DDP- and MPI-style waited buckets: the recorded run replays to the
    nanosecond; every change saves >= 0; two changes together save at least what each alone does."""
    m = _random_async_run(tmp_path, seed)
    assert m.reason == "" and m.coupled_why == "" and m.waits is not None
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
    rng = np.random.default_rng(100 + seed)
    c = m.colls
    cut = Change("faster", transfer_cut_ns=(rng.uniform(0, 2, len(c)) * MS).astype(np.int64))
    pace = Change("pace", median_ranks=np.array([int(rng.integers(0, len(m.start_ns)))]))
    r = int(rng.integers(0, len(m.start_ns)))
    a = int(rng.integers(int(m.start_ns[r]), int(m.end_ns[r])))
    gone = drop("gone", r, a / MS, a / MS + float(rng.uniform(0.5, 5.0)))
    saved = {ch.what: m.saving_s(ch) for ch in (cut, pace, gone)}
    assert min(saved.values()) >= 0, saved
    for x, y in ((cut, pace), (cut, gone), (pace, gone)):
        both = m.saving_s(x.plus(y))
        assert both >= max(saved[x.what], saved[y.what]) - 1e-9, (x.what, y.what, both, saved)


# -- point-to-point rendezvous (issue 20) ------------------------------------------------------
def _ring_compute(n: int, steps: int, seed: int, slow: int = -1, extra_ms: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.uniform(0.5, 3.0, (steps, n))
    if slow >= 0:
        c[:, slow] += extra_ms
    return c


@pytest.mark.parametrize("pattern", ["ring", "pairs", "isend", "chain", "nonblocking", "oddeven"])
@pytest.mark.parametrize("big", [False, True])
def test_point_to_point_calls_are_rendezvous_replayed_exactly(tmp_path: Path, pattern: str, big: bool) -> None:
    """Each exchange pattern, small and large messages, 4-5 ranks with random compute: the
    point-to-point calls are replayed (nothing left coupled), the recorded run replays to the
    nanosecond, and taking 1.5 ms out of one rank's compute in one step saves what the job
    simulated without it saves (up to the transfer slack a small Sendrecv leaves ambiguous)."""
    n = 5 if pattern == "chain" else 4
    c = _ring_compute(n, 8, seed=len(pattern) + 10 * big)
    simulate_p2p(tmp_path, n, c, pattern, big)
    m = model_of(tmp_path)
    assert m.reason == "" and m.coupled_why == "", m.coupled_why
    assert m.waits is not None and m.waits.p2p is not None and int(m.waits.p2p.sum()) > 0
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
    truth_end = simulate_p2p(tmp_path, n, c, pattern, big, write=False).max()
    for rank, step in ((1, 3), (2, 6), (0, 0)):
        c2 = c.copy()
        c2[step, rank] -= 1.5
        saved_ms = truth_end - simulate_p2p(tmp_path, n, c2, pattern, big, write=False).max()
        t_start = c[: step + 1, rank].sum()  # a lower bound on where that compute lies: find it in the rows
        # the step's compute is the stretch before the rank's step-th exchange: take its last 1.5 ms
        ev = load_run(tmp_path).events
        mine = ev[(ev["rank"] == rank) & np.isin(ev["kind"], [int(Kind.SEND), int(Kind.RECV), int(Kind.SEND_ASYNC),
                                                              int(Kind.RECV_ASYNC)])]  # fmt: skip
        firsts = np.unique(mine["t0_ns"])
        per_step = len(firsts) // len(c)
        arrive_ms = firsts[step * per_step] / MS
        assert arrive_ms >= t_start - 1e-6
        got = m.saving_s(drop("faster", rank, arrive_ms - 1.5, arrive_ms)) * 1e3
        assert got == pytest.approx(saved_ms, abs=1e-6 + (0.0 if big else XFER_MS * len(c))), (rank, step)


def test_a_straggler_in_a_sendrecv_ring_is_replayed_at_its_peers_pace(tmp_path: Path) -> None:
    """Rank 2 computes 2 ms more than its peers' 1 ms before each Sendrecv of a ring after the
    first (the first is start-up's): at its peers' pace it saves exactly what the job without the
    extra work saves; a peer saves nothing."""
    n, steps = 4, 10
    c = np.ones((steps, n))
    slow = c.copy()
    slow[1:, 2] += 2.0
    simulate_p2p(tmp_path, n, slow, "ring", big=False)
    m = model_of(tmp_path)
    assert m.coupled_why == ""
    truth_ms = simulate_p2p(tmp_path, n, slow, "ring", False, write=False).max() - \
        simulate_p2p(tmp_path, n, c, "ring", False, write=False).max()  # fmt: skip
    assert truth_ms == pytest.approx(18.0, abs=1.0)
    assert m.saving_s(Change("pace", median_ranks=np.array([2]))) * 1e3 == pytest.approx(truth_ms, abs=1e-6)
    assert m.saving_s(Change("pace", median_ranks=np.array([0]))) == 0.0


def test_point_to_point_chains_too_deep_for_the_steps_stay_as_recorded(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A pipeline 6 ranks deep needs 5 rounds of levels; allowed 2, the model keeps the point-to-point
    calls inside the segments as before (coupled from the first), and still replays exactly."""
    simulate_p2p(tmp_path, 6, _ring_compute(6, 6, seed=3), "chain", big=False)
    monkeypatch.setattr(replay, "MAX_LEVEL_ROUNDS", 2)
    m = model_of(tmp_path)
    assert m.waits is None and "point-to-point" in m.coupled_why
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
    monkeypatch.undo()
    m = model_of(tmp_path)
    assert m.coupled_why == "" and m.waits is not None


def test_a_sendrecv_held_by_its_left_neighbour_does_not_wait_for_its_right_one(tmp_path: Path) -> None:
    """A ring of 3 Sendrecvs (1 KB): rank 0 arrives at 10 ms, ranks 1 and 2 at 1 and 2. Rank 1
    returns at 10.1 although rank 2, whom it sends to, came at 2: it waited for rank 0 (its own
    receive's sender), not for rank 2. Then 1, 5 and 1 ms of work and an all-reduce ending at 15.4.
    Without rank 0's late 9 ms every rank leaves the ring by 2.1 (rank 1 at 1.1) and the
    all-reduce ends at 1.1 + 5 + 0.3 = 6.4: 9 ms saved (8 if rank 1 were held until rank 2 came)."""
    s: list[str] = [""]
    arrive, leave = [10.0, 1.0, 2.0], [10.1, 10.1, 2.1]
    after = [1.0, 5.0, 1.0]
    for r in range(3):
        rows = [phase(0.0, arrive[r], s),
                p2p_row(arrive[r], leave[r], Kind.SEND, (r + 1) % 3, s, "Sendrecv"),
                p2p_row(arrive[r], leave[r], Kind.RECV, (r - 1) % 3, s, "Sendrecv"),
                coll(leave[r] + after[r], 15.4, 0, s), phase(15.4, 16.0, s)]  # fmt: skip
        write_rank(tmp_path, r, 3, sorted(rows), s)
    m = model_of(tmp_path)
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
    assert m.saving_s(drop("rank 0 on time", 0, 1.0, 10.0)) == pytest.approx(0.009, abs=1e-9)


@pytest.mark.parametrize("pattern", ["pairs", "ring"])
def test_point_to_point_transfers_cut_shorten_the_rendezvous(tmp_path: Path, pattern: str) -> None:
    """64 KB messages (the sender waits for its receiver) taking 1 ms after the arrivals: every
    point-to-point call's transfer 0.6 ms shorter (a slow link's at the median pair's bandwidth)
    saves what the simulated job with 0.4 ms transfers saves; a cut of calls the replay does not
    hold (no such row) changes nothing and is not said to touch the run."""
    n = 4
    c = _ring_compute(n, 8, seed=5)
    simulate_p2p(tmp_path, n, c, pattern, big=True, xfer_ms=1.0)
    m = model_of(tmp_path)
    ev = load_run(tmp_path).events
    rows = np.flatnonzero(np.isin(ev["kind"], [int(Kind.SEND), int(Kind.RECV)]))
    cut = Change("faster", p2p_rows=rows, p2p_cut_ns=np.full(len(rows), int(0.6 * MS)), p2p_t_ns=ev["t0_ns"][rows])
    truth_ms = (simulate_p2p(tmp_path, n, c, pattern, True, write=False, xfer_ms=1.0).max()
                - simulate_p2p(tmp_path, n, c, pattern, True, write=False, xfer_ms=0.4).max())  # fmt: skip
    assert truth_ms > 3.0
    assert m.saving_s(cut) * 1e3 == pytest.approx(truth_ms, abs=1e-6)
    assert cut.touches(m)
    none = Change("elsewhere", p2p_rows=np.array([len(ev) + 5]), p2p_cut_ns=np.array([MS]), p2p_t_ns=np.array([0]))
    assert not none.touches(m) and m.saving_s(none) == 0.0


def _order_oracle(m: replay.Model) -> bool:
    """The order check spelled out: each rank's events (members, launches, waits) in step order,
    one rank at a time, never go back in time."""
    per_rank: dict[int, list[int]] = {}
    c, w = m.colls, m.waits
    for kind, ref in zip(m.step_kind.tolist(), m.step_ref.tolist()):
        if kind == 0:
            members = range(int(c.g_start[ref]), int(c.g_start[ref + 1]))
            pairs = [(int(c.m_rank[i]), int(c.m_t0_ns[i])) for i in members]
        elif kind == 1:
            assert w is not None
            pairs = [(int(w.rank[i]), int(w.entry_ns[i])) for i in range(ref, int(w.batch_end[ref]))]
        else:
            pairs = []
        for r, t in pairs:
            per_rank.setdefault(r, []).append(t)
    return all(ts == sorted(ts) for ts in per_rank.values())


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 17])
def test_the_order_check_by_blocks_is_the_whole_runs(tmp_path: Path, block: int, monkeypatch: Any) -> None:
    """``_in_each_ranks_order`` walks blocks of steps and carries each rank's last arrival: at any
    block size it answers as the whole-run oracle, on random waited runs, on copies of them with one
    event moved before its rank's previous one, and on a run whose order breaks."""
    monkeypatch.setattr(replay, "_ORDER_ROWS", block)
    answers = []
    for seed in range(6):
        m = _random_async_run(tmp_path / f"r{seed}", seed)
        answers.append((replay._in_each_ranks_order(m), _order_oracle(m)))
        assert m.waits is not None
        rng = np.random.default_rng(seed)
        for _ in range(3):  # move one event of a later step of a rank before that rank's earlier one
            bad = replay.Model(**{**m.__dict__})
            bad.colls = copy.copy(m.colls)
            bad.colls.m_t0_ns = m.colls.m_t0_ns.copy()
            bad.waits = copy.copy(m.waits)
            bad.waits.entry_ns = m.waits.entry_ns.copy()
            if rng.integers(0, 2) and len(bad.waits.entry_ns):
                i = int(rng.integers(0, len(bad.waits.entry_ns)))
                bad.waits.entry_ns[i] -= 50 * MS
            else:
                i = int(rng.integers(0, len(bad.colls.m_t0_ns)))
                bad.colls.m_t0_ns[i] -= 50 * MS
            answers.append((replay._in_each_ranks_order(bad), _order_oracle(bad)))
    for got, want in answers:
        assert got == want
    assert {w for _, w in answers} == {True, False}  # both answers were asked for
    d = tmp_path / "broken"
    test_a_run_whose_order_breaks_is_not_replayed(d)
    m = model_of(d)
    assert replay._in_each_ranks_order(m) is False and _order_oracle(m) is False


def test_the_replays_median_is_numpys() -> None:
    """``replay._median`` (one partition) gives ``np.median``'s very float on integer arrays of odd
    and even lengths, with repeats, negatives and values past float64's integers, so the pace it
    sets is the one np.median set."""
    rng = np.random.default_rng(3)
    for i in range(3000):
        n = int(rng.integers(1, 40))
        scale = (3, 10**6, 10**13, 2**62)[i % 4]
        x = rng.integers(-scale, scale, n)
        got, want = replay._median(x), float(np.median(x))
        assert got == want and np.int64(got) == np.int64(want), (x, got, want)


def test_the_step_bits_say_what_each_batch_holds() -> None:
    """``replay._step_bits`` against each batch asked directly (what the replay loop asked before):
    random batches tiling random events, with launches, point-to-point events and waits mixed in
    a batch and batches of one kind only, their exchanges from one line or two, in shuffled step
    order; a group's step gets 0."""
    from types import SimpleNamespace

    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        cuts = np.unique(rng.integers(1, n, int(rng.integers(0, n)))) if n > 1 else np.zeros(0, np.int64)
        lo = np.r_[0, cuts].astype(np.int64)
        end = np.r_[cuts, n].astype(np.int64)
        batch_end = np.zeros(n, np.int64)
        batch_end[lo] = end
        mode = trial % 4  # all launches, all point-to-point, no point-to-point at all, mixed
        launch = rng.random(n) < (1.0 if mode == 0 else 0.0 if mode == 1 else 0.4)
        p2p = None if mode == 2 else (~launch & (rng.random(n) < (1.0 if mode == 1 else 0.5)))
        kinds = np.r_[np.ones(len(lo), np.int8), np.zeros(int(rng.integers(0, 4)), np.int8)]
        refs = np.r_[lo, np.arange(len(kinds) - len(lo), dtype=np.int64)]
        o = rng.permutation(len(kinds))
        site = np.where(p2p, rng.integers(0, 2 if trial % 3 else 1, n), -1) if p2p is not None else None
        W = SimpleNamespace(rank=np.zeros(n, np.int64), launch=launch, p2p=p2p, p2p_site=site, batch_end=batch_end)
        m = SimpleNamespace(step_kind=kinds[o], step_ref=refs[o], waits=W)
        bits = replay._step_bits(m)  # type: ignore[arg-type]
        for k, ref, b in zip(m.step_kind, m.step_ref, bits):
            if k != 1:
                assert b == 0
                continue
            is_l = launch[ref : batch_end[ref]]
            is_p = p2p[ref : batch_end[ref]] if p2p is not None else np.zeros(len(is_l), bool)
            lines = set(site[ref : batch_end[ref]][is_p].tolist()) if site is not None else set()
            want = (replay._HAS_LAUNCH * bool(is_l.any()) + replay._HAS_P2P * bool(is_p.any())
                    + replay._NO_WAIT * bool((is_l | is_p).all()) + replay._ONE_SITE * (len(lines) <= 1))  # fmt: skip
            assert b == want, (trial, ref, b, want)


def test_a_straggler_is_paced_at_its_peers_median_from_the_same_line() -> None:
    """``_p2p_pace``: a slow rank's segment before an exchange becomes the median of its peers'
    before an exchange from the same line (worked by hand), never longer than its own, plus a
    typical peer's excess over it where its rank has a table (``Change.like_peers``); and a batch
    said to come from one line (``site=None``) gets what asking each event's line gives there, on
    random batches."""
    seg = np.array([10, 1, 2, 3, 4, 9, 0], np.int64)
    slow = np.array([1, 0, 0, 0, 0, 1, 1], bool)
    peers = np.array([0, 1, 1, 1, 1, 0, 0], bool)
    ranks = np.arange(7)
    # the peers' median is 2.5 -> 2; the slow ones at 10 and 9 go down to 2, the one at 0 keeps 0
    np.testing.assert_array_equal(replay._p2p_pace(seg, slow, peers, None, ranks, {}), [2, 1, 2, 3, 4, 2, 0])
    site = np.array([7, 7, 7, 5, 5, 5, 7])  # by line: 7's peers [1, 2] -> 1; 5's peers [3, 4] -> 3
    np.testing.assert_array_equal(replay._p2p_pace(seg, slow, peers, site, ranks, {}), [1, 1, 2, 3, 4, 3, 0])
    # rank 0's table maps its excess of 7.5 (10 over 2.5) to 6 (0 -> 0, 10 -> 8): 2.5 + 6 -> 8;
    # rank 5 has none: at the median
    like = {0: (np.array([0.0, 10.0]), np.array([0.0, 8.0]))}
    np.testing.assert_array_equal(replay._p2p_pace(seg, slow, peers, None, ranks, like), [8, 1, 2, 3, 4, 2, 0])
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(1, 30))
        seg = rng.integers(-5, 50, n)
        kind = rng.integers(0, 3, n)  # 0 not an exchange, 1 slow, 2 a peer
        sl, pe = kind == 1, kind == 2
        site = np.where(kind > 0, 4, -1)
        r = np.arange(n)
        np.testing.assert_array_equal(replay._p2p_pace(seg, sl, pe, None, r, like),
                                      replay._p2p_pace(seg, sl, pe, site, r, like))  # fmt: skip


def test_a_sendrecv_half_to_mpi_proc_null_is_part_of_its_replayed_call(tmp_path: Path) -> None:
    """A line of 3 ranks, 10 steps of 1, 5 and 1 ms of work, then one Sendrecv to the right from
    the left: rank 0 receives from MPI_PROC_NULL, rank 2 sends to it (rows with peer -1, nobody's
    partner). Rank 2 waits 4 ms a step in its Sendrecv for rank 1; the half of that call to
    MPI_PROC_NULL, same rank and times, is not point-to-point time the replay leaves as recorded:
    the run is replayed (it was said to be coupled from the first step), exactly."""
    s: list[str] = [""]
    rows: list[list[tuple[Any, ...]]] = [[], [], []]
    t = np.zeros(3)
    for _ in range(10):
        a = t + np.array([1.0, 5.0, 1.0])
        ex = np.array([a[0], max(a[1], a[0]), max(a[2], a[1])]) + XFER_MS
        for r in range(3):
            rows[r].append(p2p_row(a[r], ex[r], Kind.SEND, r + 1 if r < 2 else -1, s, "Sendrecv"))
            rows[r].append(p2p_row(a[r], ex[r], Kind.RECV, r - 1 if r > 0 else -1, s, "Sendrecv"))
        t = ex
    for r in range(3):
        rows[r] += [coll(t.max() + 0.5, t.max() + 1.0, 0, s), phase(t.max() + 1.0, t.max() + 2.0, s)]
        write_rank(tmp_path, r, 3, rows[r], s)
    m = model_of(tmp_path)
    assert m.coupled_why == "" and m.waits is not None and m.waits.p2p is not None
    np.testing.assert_array_equal(m.replay(None)[m.present], m.end_ns[m.present])
