"""distdiag.intervals against a brute-force reference on random small intervals.

Times are drawn from a few dozen values, so ties, touching, nested, zero-length
and backwards (end before start: empty) intervals all occur; the reference
paints a boolean grid of nanoseconds or merges by start in Python.
"""

from __future__ import annotations

import numpy as np
import pytest

from distdiag import intervals as iv

T = 60  # the grid: times in [0, T)
FAR = 1 << 61  # a second cluster of times this far away: band coordinates overflow


def random_intervals(seed: int, n_keys: int = 5, far: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    key = rng.integers(0, n_keys, n).astype(np.int64)
    t0 = rng.integers(0, T - 12, n).astype(np.int64)
    t1 = t0 + rng.integers(-3, 12, n) * (rng.random(n) < 0.9)  # some zero-length, some backwards
    if far:  # half of the intervals far away: the key * span band coordinates would overflow
        shift = np.where(rng.random(n) < 0.5, FAR, 0)
        t0, t1 = t0 + shift, t1 + shift
    return key, t0, t1


def ref_segments(t0: np.ndarray, t1: np.ndarray, gap: int = 0) -> list[list[int]]:
    """The textbook merge: by start, a new segment where one starts more than ``gap`` after
    everything before it ended; a backwards interval is empty at its start."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), max(int(a), int(b))) for a, b in zip(t0, t1)):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def grid(t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Which nanoseconds of [0, T) the half-open intervals cover."""
    on = np.zeros(T, bool)
    for a, b in zip(t0, t1):
        on[int(a) : max(int(a), int(b))] = True
    return on


def far_grid_len(t0: np.ndarray, t1: np.ndarray) -> int:
    """How many ns intervals drawn with ``far=True`` cover: each cluster on its own grid."""
    near = t0 < FAR
    return int(grid(t0[near], t1[near]).sum() + grid(t0[~near] - FAR, t1[~near] - FAR).sum())


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gap", [0, 3])
def test_union_sorted_is_the_merge_by_start(seed: int, gap: int) -> None:
    _, t0, t1 = random_intervals(seed)
    t1 = np.maximum(t0, t1)  # union_sorted's contract: e >= s
    want = np.array(ref_segments(t0, t1, gap), np.int64).reshape(-1, 2)
    s, e = iv.union_sorted(t0.copy(), t1.copy(), gap)
    np.testing.assert_array_equal(np.c_[s, e], want)
    o = np.argsort(t0, kind="stable")  # already sorted starts: checked, not sorted
    s, e = iv.union_sorted(t0[o], t1[o], gap)
    np.testing.assert_array_equal(np.c_[s, e], want)


def test_union_sorted_of_nothing_is_nothing() -> None:
    z = np.zeros(0, np.int64)
    assert all(len(x) == 0 for x in iv.union_sorted(z.copy(), z.copy()))
    assert all(len(x) == 0 for x in iv.union_by_key(z, z, z, 5))
    assert all(len(x) == 0 for x in iv.union_banded(z, z, z, 100))
    assert iv.union_length(z, z) == 0
    np.testing.assert_array_equal(iv.union_length_by_key(z, z, z, 3), [0, 0, 0])
    np.testing.assert_array_equal(iv.covered_before(z, z, np.array([0, 5])), [0, 0])


def test_touching_intervals_join_and_a_lone_zero_length_one_stays() -> None:
    t0 = np.array([0, 5, 20, 30, 32], np.int64)
    t1 = np.array([5, 9, 20, 35, 33], np.int64)  # [0,5) [5,9) touch; [20,20) alone; [32,33) nested
    s, e = iv.union_sorted(t0.copy(), t1.copy())
    assert (s.tolist(), e.tolist()) == ([0, 20, 30], [9, 20, 35])
    assert iv.union_length(t0, t1) == 9 + 0 + 5


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gap", [0, 2, 7])
@pytest.mark.parametrize("far", [False, True])
def test_union_by_key_is_each_keys_merge(seed: int, gap: int, far: bool) -> None:
    key, t0, t1 = random_intervals(seed, far=far)
    key = key + 3  # keys need not start at 0
    if far:
        assert iv.band_of(int(key.max() - key.min()), t0, ends=(np.maximum(t0, t1),), pad=gap) is None
    want = [(k, a, b) for k in sorted(set(key.tolist())) for a, b in ref_segments(t0[key == k], t1[key == k], gap)]
    got_k, got_s, got_e = iv.union_by_key(key, t0, t1, gap)
    assert got_k.dtype == got_s.dtype == got_e.dtype == np.int64
    assert list(zip(got_k.tolist(), got_s.tolist(), got_e.tolist())) == want


def test_union_by_key_worked_example() -> None:
    key = np.array([0, 1, 0, 0])
    t0 = np.array([9, 2, 0, 3])
    t1 = np.array([10, 3, 1, 4])
    got = iv.union_by_key(key, t0, t1, 2)
    assert [x.tolist() for x in got] == [[0, 0, 1], [0, 9, 2], [4, 10, 3]]


@pytest.mark.parametrize("seed", SEEDS)
def test_union_banded_is_each_keys_merge_shifted(seed: int) -> None:
    key, t0, t1 = random_intervals(seed)
    span = 100
    want = [(k * span + a, k * span + b) for k in range(5) for a, b in ref_segments(t0[key == k], t1[key == k])]
    s, e = iv.union_banded(key, t0, t1, span)
    assert list(zip(s.tolist(), e.tolist())) == want


@pytest.mark.parametrize("seed", SEEDS)
def test_union_length_counts_each_covered_ns_once(seed: int) -> None:
    key, t0, t1 = random_intervals(seed)
    assert iv.union_length(t0, t1) == int(grid(t0, t1).sum())
    want = [float(grid(t0[key == k], t1[key == k]).sum()) for k in range(7)]  # keys 5, 6: none
    got = iv.union_length_by_key(key, t0, t1, 7)
    assert got.dtype == np.float64 and got.tolist() == want
    o = np.lexsort((t0, key))  # sorted by (key, t0): the sort is skipped, same sums
    assert iv.union_length_by_key(key[o], t0[o], t1[o], 7).tolist() == want


@pytest.mark.parametrize("seed", SEEDS)
def test_union_length_in_band_any_key_lo_and_without_band(seed: int) -> None:
    key, t0, t1 = random_intervals(seed)
    want = iv.union_length_by_key(key, t0, t1, 5)
    band = iv.band_of(5, t0, t1)
    for key_lo in (0, 7, 1 << 40):  # a band's ranks or steps; absolute keys that overflow band coordinates
        np.testing.assert_array_equal(iv.union_length_in_band(key + key_lo, t0, t1, 5, band, key_lo), want)
        np.testing.assert_array_equal(iv.union_length_in_band(key + key_lo, t0, t1, 5, None, key_lo), want)


@pytest.mark.parametrize("seed", SEEDS)
def test_union_length_of_far_apart_times(seed: int) -> None:
    """Times too far apart for band coordinates: the sweep by (key, t0) gives the same lengths."""
    key, t0, t1 = random_intervals(seed, far=True)
    assert iv.band_of(int(key.max()), t0, t1) is None
    want = [float(far_grid_len(t0[key == k], t1[key == k])) for k in range(5)]
    assert iv.union_length_by_key(key, t0, t1, 5).tolist() == want
    assert iv.union_length(t0, t1) == far_grid_len(t0, t1)


@pytest.mark.parametrize("seed", SEEDS)
def test_covered_before_counts_the_covered_ns_below_t(seed: int) -> None:
    _, t0, t1 = random_intervals(seed)
    seg = np.array(ref_segments(t0, t1), np.int64).reshape(-1, 2)
    on = grid(t0, t1)
    t = np.arange(-3, T + 4)
    want = [int(on[: max(int(x), 0)].sum()) for x in t]
    got = iv.covered_before(seg[:, 0], seg[:, 1], t)
    assert got.dtype == np.int64 and got.tolist() == want
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, T, 50)
    b = a + rng.integers(0, 20, 50)
    want_in = [int(on[max(int(x), 0) : max(int(y), 0)].sum()) for x, y in zip(a, b)]
    assert iv.covered_within(seg[:, 0], seg[:, 1], a, b).tolist() == want_in


def test_covered_worked_examples() -> None:
    s, e = np.array([0, 10]), np.array([5, 20])
    assert iv.covered_before(s, e, np.array([3, 7, 12, 30])).tolist() == [3, 5, 7, 15]
    assert iv.covered_within(s, e, np.array([3]), np.array([12])).tolist() == [4]


def test_band_of_says_when_int64_overflows() -> None:
    t = np.array([0, 1 << 40])
    lo, span = iv.band_of(10, t)  # type: ignore[misc]
    assert (lo, span) == (0, (1 << 40) + 1)
    assert iv.band_of(10, t, pad=5) == (0, (1 << 40) + 6)
    assert iv.band_of(1 << 23, t) is None  # 2^23 keys of 2^40 ns: past 2^63


def test_union_length_of_chained_overlaps() -> None:
    """Overlapping intervals none of which lies inside another (ends never go back: the
    branch without a running max) count their overlaps once: [0,5) [3,8) [6,9) -> 9."""
    t0 = np.array([0, 3, 6, 20, 22], np.int64)
    t1 = np.array([5, 8, 9, 24, 25], np.int64)
    key = np.array([0, 0, 0, 1, 1], np.int64)
    assert iv.union_length_by_key(key, t0, t1, 2).tolist() == [9.0, 5.0]
    assert iv.union_length(t0, t1) == 14


@pytest.mark.parametrize("seed", SEEDS)
def test_subtract_sorted_keeps_exactly_the_ns_of_a_not_in_b(seed: int) -> None:
    _, a0, a1 = random_intervals(seed)
    _, b0, b1 = random_intervals(seed + 100)
    a = np.array(ref_segments(a0, a1), np.int64).reshape(-1, 2)
    b = np.array(ref_segments(b0, b1), np.int64).reshape(-1, 2)
    s, e = iv.subtract_sorted(a[:, 0], a[:, 1], b[:, 0], b[:, 1])
    assert (e > s).all() and (s[1:] >= e[:-1]).all()  # sorted, disjoint, no empty pieces
    assert grid(s, e).tolist() == (grid(a0, a1) & ~grid(b0, b1)).tolist()


def test_subtract_sorted_worked_example() -> None:
    s, e = iv.subtract_sorted(np.array([0, 20]), np.array([10, 30]), np.array([2, 25]), np.array([4, 40]))
    assert (s.tolist(), e.tolist()) == ([0, 4, 20], [2, 10, 25])
    s, e = iv.subtract_sorted(np.array([0]), np.array([10]), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert (s.tolist(), e.tolist()) == ([0], [10])
