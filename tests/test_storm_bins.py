"""metadata_storm's hot windows over segments of bins (``_hot_windows``): the same windows as one
bin at a time, and memory that follows the rows, not the time they span (a run dir is untrusted:
a timestamp flipped 63 days ahead made 55 M bins, 1.4 GB)."""

from __future__ import annotations

import tracemalloc
from typing import Callable

import numpy as np
import pytest

from distdiag.detectors.metadata_storm import _hot_windows

HotOf = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _dense(b0: np.ndarray, b1: np.ndarray, n_of: np.ndarray, dur: np.ndarray, hot_of: HotOf,
           gap: int) -> list[tuple[int, int]]:  # fmt: skip
    """The oracle: every bin from 0 to the last one a row touches, filled row by row."""
    n_bins = int(max(b0.max(), b1.max())) + 1
    calls, busy = np.zeros(n_bins), np.zeros(n_bins)
    for i in np.flatnonzero(n_of <= 1):
        calls[b0[i]] += n_of[i]
        busy[b0[i]] += dur[i]
    extra_c, extra_b = np.zeros(n_bins), np.zeros(n_bins)
    for i in np.flatnonzero(n_of > 1):
        k = max(b1[i], b0[i]) - b0[i] + 1
        for j in range(b0[i], b0[i] + k):
            extra_c[j] += n_of[i] / k
            extra_b[j] += dur[i] / k
    hot = np.flatnonzero(hot_of(calls + extra_c, busy + extra_b))
    wins: list[tuple[int, int]] = []
    for h in hot.tolist():
        if wins and h - wins[-1][1] - 1 <= gap:
            wins[-1] = (wins[-1][0], h)
        else:
            wins.append((h, h))
    return wins


def _rows(rng: np.random.Generator, n: int, span: int) -> tuple[np.ndarray, ...]:
    b0 = np.sort(rng.integers(0, span, n))
    b0[0] = 0  # the bins count from the first call
    b1 = b0 + (rng.random(n) < 0.2) * rng.integers(1, 20, n)
    n_of = np.where(rng.random(n) < 0.15, rng.integers(2, 400, n), 1)
    dur = rng.uniform(1e6, 3e8, n)
    return b0.astype(np.int64), b1.astype(np.int64), n_of.astype(np.int64), dur


@pytest.mark.parametrize("seed", range(30))
def test_segments_give_the_windows_bins_one_by_one_give(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b0, b1, n_of, dur = _rows(rng, int(rng.integers(1, 300)), int(rng.integers(1, 400)))
    gap = int(rng.integers(0, 4))
    min_rate, min_busy = float(rng.uniform(1, 40)), float(rng.uniform(0, 0.8))

    def hot_of(c: np.ndarray, b: np.ndarray) -> np.ndarray:
        out: np.ndarray = (c / 0.1 >= min_rate) & (b / 1e8 >= min_busy)
        return out

    assert _hot_windows(b0, b1, n_of, dur, hot_of, gap) == _dense(b0, b1, n_of, dur, hot_of, gap)


def test_a_call_far_in_the_future_costs_no_bins_of_its_own() -> None:
    """The same rows with one summed call moved 10^12 bins on (a flipped timestamp): the windows
    of the others are unchanged, the far call's own bins are judged alone, and the peak stays a
    few MB."""
    rng = np.random.default_rng(7)
    b0, b1, n_of, dur = _rows(rng, 2000, 300)

    def hot_of(c: np.ndarray, b: np.ndarray) -> np.ndarray:
        out: np.ndarray = (c / 0.1 >= 20) & (b / 1e8 >= 0.5)
        return out

    near = _hot_windows(b0, b1, n_of, dur, hot_of, 2)
    assert near == _dense(b0, b1, n_of, dur, hot_of, 2) and near
    far = 10**12
    b0f, b1f = np.r_[b0, far], np.r_[b1, far + 5]
    n_f, dur_f = np.r_[n_of, 1000], np.r_[dur, 6e8]  # 1,000 calls over 6 bins: ~167 a bin, each bin 0.1 s busy
    tracemalloc.start()
    try:
        got = _hot_windows(b0f, b1f, n_f, dur_f, hot_of, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == near + [(far, far + 5)]
    assert peak < 8 << 20, peak
