"""distdiag.rows: the one kind index per analysis gives exactly the rows a boolean mask gave.

On real rank files (a synthetic metadata-storm run: collectives, compute
phases, file calls, probes; and a run whose ranks
recorded nothing), for every kind value, present or not, and for sets of
kinds: the same row numbers in the same ascending order as
``np.flatnonzero(np.isin(events["kind"], kinds))``, the same rows gathered,
and an index that belongs to the table it was built from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distdiag import clocks
from distdiag.pipeline import analyze
from distdiag.rows import (build, calls_of, count_of, events_of, kind_index, rows_of, unique_sorted, weighted_median,
                           weighted_quantile)
from distdiag.run import Run, load_run
from distdiag.schema import COMM_KINDS, FILE_KINDS, PHASE_KINDS, Kind
from distdiag.synth import synth
from tests.factories import write_rank


@pytest.fixture(scope="module")
def storm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rows") / "storm"
    synth(d, ranks=16, events=1000, fault="storm", ranks_per_host=4)
    return d


@pytest.fixture(scope="module")
def aligned(storm_dir: Path) -> Run:
    return clocks.align(load_run(storm_dir))


def _mask_rows(run: Run, kinds: list[int]) -> np.ndarray:
    return np.flatnonzero(np.isin(run.events["kind"], np.array(kinds, np.int64)))


def test_every_kind_value_gives_the_masks_rows_in_order(aligned: Run) -> None:
    kind = aligned.events["kind"]
    present = set(np.unique(kind).tolist())
    # the run holds several kinds, and the absent ones below really are absent
    assert {int(Kind.COLL), int(Kind.FORWARD), int(Kind.FILE_STAT), int(Kind.PROBE)} <= present
    assert int(Kind.H2D) not in present
    for k in range(256):  # every value of the uint8 column, present or not
        got = rows_of(aligned, k)
        want = np.flatnonzero(kind == k)
        assert got.dtype == np.int64
        assert np.array_equal(got, want), Kind(k).name if k in Kind._value2member_map_ else k
        assert count_of(aligned, k) == len(want)
    assert len(rows_of(aligned, Kind.H2D)) == 0 and count_of(aligned, Kind.H2D) == 0


@pytest.mark.parametrize(
    "kinds",
    [
        sorted(FILE_KINDS),
        sorted(int(k) for k in PHASE_KINDS | COMM_KINDS),  # two dense kinds merged
        [int(Kind.PROBE), int(Kind.FILE_STAT), int(Kind.H2D)],  # two rare kinds merged, one absent
        [int(Kind.STEP), int(Kind.INPUT_WAIT)],  # all absent
        [],
    ],
)
def test_a_set_of_kinds_gives_the_masks_rows_in_order(aligned: Run, kinds: list[int]) -> None:
    want = _mask_rows(aligned, kinds)
    # the forms consumers pass: a uint8 array, a tuple of Kind, a frozenset
    for form in (np.array(kinds, np.uint8), tuple(Kind(k) for k in kinds), frozenset(kinds)):
        got = rows_of(aligned, form)
        assert got.dtype == np.int64 and np.array_equal(got, want)
        assert count_of(aligned, form) == len(want)
    got_rows = events_of(aligned, kinds)
    assert got_rows.dtype == aligned.events.dtype
    assert got_rows.tobytes() == aligned.events[np.isin(aligned.events["kind"], kinds)].tobytes()


@pytest.mark.parametrize("block_rows", [1, 7, 1000, 1 << 20])
def test_the_blockwise_build_is_one_stable_sort_by_kind(aligned: Run, block_rows: int) -> None:
    # block edges fall inside runs of one kind and between kinds alike
    idx = build(aligned.events, block_rows=block_rows)
    assert np.array_equal(idx.order, np.argsort(aligned.events["kind"], kind="stable"))
    assert np.array_equal(np.diff(idx.starts), np.bincount(aligned.events["kind"], minlength=256))


@pytest.mark.parametrize("n_kinds", [1, 3, 8, 9, 40])
def test_the_per_kind_fill_and_the_sort_fallback_give_one_stable_sort(aligned: Run, n_kinds: int) -> None:
    # the real table's rows with their kinds redrawn: blocks of up to 8 kinds are counted and
    # filled one compare per kind, blocks of more are sorted; a kind first seen in a late block
    # (after blocks that were counted by compares only) must be counted by the fallback
    rng = np.random.default_rng(n_kinds)
    t = aligned.events.copy()
    kinds = rng.choice(255, n_kinds, replace=False)
    t["kind"] = rng.choice(kinds, len(t), p=rng.dirichlet(np.full(n_kinds, 0.3)))
    t["kind"][-5:] = 255  # a new kind in the last block
    for block_rows in (3, 64, 1000, 1 << 16):
        idx = build(t, block_rows=block_rows)
        assert np.array_equal(idx.order, np.argsort(t["kind"], kind="stable")), block_rows
        assert np.array_equal(np.diff(idx.starts), np.bincount(t["kind"], minlength=256)), block_rows


def test_values_outside_the_kind_range_match_nothing(aligned: Run) -> None:
    assert len(rows_of(aligned, [-1, 256, 1000])) == 0
    assert np.array_equal(rows_of(aligned, [int(Kind.PROBE), 300]), _mask_rows(aligned, [int(Kind.PROBE)]))


def test_index_is_built_once_and_belongs_to_its_table(storm_dir: Path) -> None:
    run = clocks.align(load_run(storm_dir))
    assert run.cache.kind_index is None
    idx = kind_index(run)
    assert kind_index(run) is idx  # cached: one pass per analysis
    assert idx.order.dtype == np.int32  # 4 bytes an event below 2**31 rows
    # a stage's new run starts with an empty cache: its own index
    other = run.replace()
    assert other.cache.kind_index is None
    # a table swapped under the same run object is not served the old index
    run.events = run.events[::-1].copy()
    assert kind_index(run) is not idx
    assert np.array_equal(rows_of(run, sorted(FILE_KINDS)), _mask_rows(run, sorted(FILE_KINDS)))


def test_the_pipeline_indexes_the_final_aligned_table(storm_dir: Path) -> None:
    rep = analyze(storm_dir)
    idx = rep.run.cache.kind_index  # built by the first consumer (the Slurm view, a detector)
    assert rep.run.aligned
    assert idx.table is rep.run.events
    assert np.array_equal(idx.rows(sorted(FILE_KINDS)), _mask_rows(rep.run, sorted(FILE_KINDS)))


def test_a_run_with_no_events(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    for r in range(2):  # two ranks whose files hold no event rows
        write_rank(d, r, 2, [], [""])
    run = clocks.align(load_run(d))
    assert len(run.events) == 0
    for k in (Kind.COLL, Kind.FILE_OPEN, 0, 255):
        assert len(rows_of(run, k)) == 0 and count_of(run, k) == 0
    assert len(rows_of(run, sorted(FILE_KINDS))) == 0
    assert len(events_of(run, sorted(PHASE_KINDS))) == 0
    rep = analyze(d)  # the consumers run on it without error
    assert rep.run.cache.kind_index.table is rep.run.events


@pytest.mark.parametrize(
    "values",
    [np.array([], np.int32), np.array([3, 3, 3], np.int32), np.array([0, 0, 1, 4, 4, 9], np.int32),
     np.array([5, 1, 5, 0, 1], np.int32)],  # the last unsorted: np.unique's answer too
)  # fmt: skip
def test_unique_sorted_is_np_unique_with_first_positions(values: np.ndarray) -> None:
    u, first = unique_sorted(values)
    want_u, want_first = np.unique(values, return_index=True)
    assert np.array_equal(u, want_u) and u.dtype == want_u.dtype
    assert np.array_equal(first, want_first)


def test_weighted_quantiles_are_those_of_the_values_repeated() -> None:
    # an overflow sum of the libc interposer stands for `seq` calls: its latency counts that often
    rng = np.random.default_rng(3)
    x = rng.exponential(1.0, 200)
    w = rng.integers(1, 40, 200)
    rep = np.repeat(x, w)
    for q in (0.1, 0.5, 0.9):
        got = weighted_quantile(x, w, q)
        # the value whose running weight reaches q: within one step of numpy's on the repeated values
        lo, hi = np.quantile(rep, q, method="lower"), np.quantile(rep, q, method="higher")
        assert lo <= got <= hi, (q, got, lo, hi)
    assert weighted_median(x, np.ones(200, np.int64)) == np.median(x)  # all ones: numpy's own
    assert np.isnan(weighted_median(np.zeros(0), np.zeros(0, np.int64)))


def test_calls_of_counts_a_summed_row_as_its_calls() -> None:
    ev = np.zeros(4, [("seq", "<i8")])
    ev["seq"] = [-1, 5, 1, -1]
    assert calls_of(ev).tolist() == [1, 5, 1, 1]
