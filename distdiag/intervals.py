"""Interval arithmetic on int64 nanoseconds: unions, covered lengths, "covered before t".

Every function is vectorized over intervals (sorts, running maxima, binary
searches; no Python loop per interval). Conventions shared by all of them:

* An interval is ``[t0, t1)`` in int64 ns. One whose end lies before its start
  counts as empty (zero-length at ``t0``), as a call still in flight would.
* A *segment set* is what the unions return: disjoint segments sorted by start,
  separated by gaps of at least 1 ns (touching intervals join: [0, 5) and
  [5, 9) are one segment [0, 9)). A zero-length interval inside or touching
  another joins it; alone it stays a zero-length segment (it adds no length).
* *Keyed* functions union each key's intervals on their own (a key is a rank,
  or a rank's step). Many of them do it in *band coordinates*:
  ``(key - key_lo) * span + (t - lo)`` puts every key's times into its own band
  ``[key * span, (key + 1) * span)``, so one sort orders by (key, t) and one
  running maximum never carries a value from one key into the next.
  :func:`band_of` picks (lo, span), or says that int64 would overflow.
"""

from __future__ import annotations

import numpy as np

_I64_MAX = int(np.iinfo(np.int64).max)
_I64_MIN = int(np.iinfo(np.int64).min)


def band_of(key_max: int, *times: np.ndarray, ends: tuple[np.ndarray, ...] | None = None, pad: int = 0) -> tuple[int, int] | None:
    """(lo, span) that put every key's times into its own band ``key * span - lo``, for keys up to
    ``key_max`` (any upper bound) and times among ``times`` (non-empty arrays); None when int64 overflows.
    With ``ends``, ``times`` are starts and ``ends`` the ends of the same intervals (each end >= its start):
    the lowest start and the highest end then bound them all. ``pad`` (ns) widens every band: a
    gap of up to ``pad`` never reaches from one key's last end to the next key's first start."""
    lo = min(int(t.min()) for t in times)
    span = max(int(t.max()) for t in (times if ends is None else ends)) - lo + 1 + pad
    return (lo, span) if key_max < _I64_MAX // span - 1 else None


def union_sorted(s: np.ndarray, e: np.ndarray, gap_ns: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals ``[s[i], e[i])`` (int64, ``e >= s``, any order) as a segment set
    (starts, ends). Intervals whose gap is at most ``gap_ns`` (>= 0) join too. Sorts ``s`` and ``e``
    in place (pass copies to keep them); arrays that come sorted are only checked.

    The starts and the ends are sorted each on its own, not the intervals by
    start: with both ascending, a segment ends at ``e[i]`` exactly when
    ``s[i + 1] > e[i] + gap_ns``. (Take ``gap_ns`` = 0; a gap is the same on
    ends pushed ``gap_ns`` later. Then the i + 1 intervals with the smallest
    ends all end before ``s[i + 1]``, so they are the i + 1 first by start, and
    no later one starts before ``s[i + 1]``: a gap, and ``e[i]`` is the running
    max of the ends by start, the test the merge by start makes. Conversely,
    where that running max is below the next start, it is ``e[i]``.) Example:
    [0, 5), [1, 2), [7, 9): s = 0 1 7, e = 2 5 9; 1 <= 2, 7 > 5: segments
    [0, 5), [7, 9). No argsort and no gathers of the intervals by its order,
    and timsort takes nearly sorted ends in few merges.
    """
    if len(s) == 0:
        return s, e
    for a in (s, e):
        if len(a) > 1 and not _nondecreasing(a):
            a.sort(kind="stable")
    gap = s[1:] > (e[:-1] + gap_ns if gap_ns else e[:-1])
    return s[np.r_[True, gap]], e[np.r_[gap, True]]


def union_banded(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key, the union of intervals ``[t0, t1)``, as one segment set in band coordinates
    ``key * span + t`` (so sorted by key, then start). The caller's keys are >= 0 and its times
    lie in ``[0, span)``; :func:`covered_before` then answers queries shifted the same way."""
    if len(t0) == 0:
        z = np.zeros(0, np.int64)
        return z, z
    shift = key.astype(np.int64) * span
    s = t0.astype(np.int64) + shift
    e = np.maximum(t1, t0).astype(np.int64) + shift
    del shift
    return union_sorted(s, e)


def union_by_key(
    key: np.ndarray, t0: np.ndarray, t1: np.ndarray, gap_ns: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key, the union of intervals ``[t0, t1)`` (any order) whose gaps of at most ``gap_ns``
    (>= 0) are bridged: (key, start, end) of each segment, int64, sorted by (key, start).

    Worked example, gap 2: key 0: [0, 1) [3, 4) [9, 10), key 1: [2, 3) -> (0, 0, 4) (0, 9, 10) (1, 2, 3).
    """
    if len(key) == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    key = key.astype(np.int64)
    t0 = t0.astype(np.int64)
    t1 = np.maximum(t1, t0).astype(np.int64)
    k_lo = int(key.min())
    band = band_of(int(key.max()) - k_lo, t0, ends=(t1,), pad=gap_ns)
    if band is None:  # astronomically long runs: by (key, t0), with a running max per key
        o = np.lexsort((t0, key))
        k, a, b = key[o], t0[o], t1[o]
        first = np.r_[True, k[1:] != k[:-1]]
        reach = _running_max_by_key(np.cumsum(first) - 1, b)
        new = first
        new[1:] |= a[1:] > reach[:-1] + gap_ns
        at = np.flatnonzero(new)
        return k[at], a[at], np.maximum.reduceat(b, at)
    lo, span = band
    shift = (key - k_lo) * span - lo
    s, e = union_sorted(t0 + shift, t1 + shift, gap_ns)
    del shift
    k = s // span  # an end lies in its start's band (the pad keeps it below the next band)
    s -= k * span
    e -= k * span
    return k + k_lo, s + lo, e + lo


def union_length(t0: np.ndarray, t1: np.ndarray) -> int:
    """The total length (ns) of the union of intervals ``[t0, t1)`` (any order); 0 for none."""
    if len(t0) == 0:
        return 0
    s, e = union_sorted(np.array(t0, np.int64), np.maximum(t1, t0).astype(np.int64))
    return int((e - s).sum())


def union_length_by_key(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int) -> np.ndarray:
    """Per key in ``[0, n_keys)``, the total length of the union of its intervals [t0, t1) (any
    order), as float64 (whole ns, exact). A key without intervals has 0.

    Sweep: sorted by (key, t0), an interval adds what sticks out past the
    furthest end seen so far in its key. [0,10) [2,5) [8,12) -> 10 + 0 + 2 = 12.
    """
    if len(key) == 0:
        return np.zeros(n_keys)
    return union_length_in_band(key.astype(np.int64), t0, t1, n_keys, band_of(int(key.max()), t0, t1))


def union_length_in_band(
    key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int, band: tuple[int, int] | None, key_lo: int = 0
) -> np.ndarray:
    """:func:`union_length_by_key` with ``band`` from :func:`band_of` (for keys up to ``n_keys``) of
    these intervals or of any superset of them (None: too long for band coordinates); the int64 keys
    lie in ``[key_lo, key_lo + n_keys)`` (a band's ranks, a band's steps) and come in any order.

    In band coordinates every key's times lie in its own band, so sorting the
    starts sorts by (key, t0), and one running max of the ends over the whole
    array never carries a value into the next key: at a key's first interval
    the previous keys' ends all lie below its start. The sweep then needs no
    key-boundary mask and no conversion back from band coordinates: 3 gathers
    and ~8 passes, not the ~20 of a sort by (key, t0) and a sweep in times.
    Input already sorted by (key, t0) skips the sort, and ends that never go
    back (no interval inside another) skip the running max.
    """
    if len(key) == 0:
        return np.zeros(n_keys)
    if key_lo and (band is None or (key_lo + n_keys) * band[1] >= 1 << 62):
        key, key_lo = key - key_lo, 0  # for the sweep, or absolute keys would overflow band coordinates
    if band is None:  # astronomically long runs
        o = np.lexsort((t0, key))
        return _sweep(key[o], t0[o], t1[o], n_keys)
    lo, span = band
    s0 = key * span
    s0 -= lo + key_lo * span  # key_lo's band is band 0: no pass to make the keys relative
    s1 = s0 + t1
    s0 += t0
    if not _nondecreasing(s0):  # often already sorted (one interval a member, in time order): no sort
        o = np.argsort(s0, kind="stable")  # timsort: the input is a few sorted runs
        s0, s1, key = s0[o], s1[o], key[o]
        del o
    # reach[i]: the furthest end before interval i (its key's, or below its start);
    # when the ends never go back (no interval inside another), the previous end
    reach = np.empty_like(s1)
    reach[0] = _I64_MIN
    if _nondecreasing(s1):
        reach[1:] = s1[:-1]
    else:
        np.maximum.accumulate(s1[:-1], out=reach[1:])
    np.maximum(reach, s0, out=reach)
    np.subtract(s1, reach, out=reach)
    np.maximum(reach, 0, out=reach)
    return _sum_by_key(key, reach, n_keys, key_lo)


def covered_before(seg_s: np.ndarray, seg_e: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Per time in ``t`` (any order), the length of a segment set (sorted, disjoint: what the
    unions return) that lies before it, int64. No segments: zeros.

    Prefix sums of the lengths plus the part of the segment ``t`` falls in.
    Worked example: segments [0, 5) [10, 20); t = 3 -> 3, 7 -> 5, 12 -> 7, 30 -> 15.
    """
    if len(seg_s) == 0:
        return np.zeros(len(t), np.int64)
    lens = seg_e - seg_s
    before = np.concatenate([[0], np.cumsum(lens)])
    k = np.searchsorted(seg_s, t, side="right") - 1  # the last segment starting at or before t
    kk = np.maximum(k, 0)
    inside = np.where(k >= 0, np.clip(t - seg_s[kk], 0, lens[kk]), 0)
    return before[kk] * (k >= 0) + inside


def subtract_sorted(a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray, b_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segment set ``a`` less the segment set ``b`` (both sorted and disjoint: what the unions
    return, e.g. two :func:`union_banded` of one band layout), as a sorted disjoint set.

    ``a`` is cut against ``b``'s gaps: each piece of ``a`` that lies in a gap of ``b`` (before its
    first segment, between two, after its last) is kept; the gaps an ``a`` segment meets are a
    contiguous run of them, found by two searches. Worked example: a = [0, 10) [20, 30), b =
    [2, 4) [25, 40): [0, 2) [4, 10) [20, 25)."""
    if len(a_s) == 0 or len(b_s) == 0:
        return a_s.copy(), a_e.copy()
    lo = min(int(a_s[0]), int(b_s[0])) - 1
    hi = max(int(a_e[-1]), int(b_e[-1])) + 1
    g_s = np.concatenate([[lo], b_e]).astype(np.int64)  # b's gaps: [lo, b0) [b_e[i], b_s[i+1]) [b_e[-1], hi)
    g_e = np.concatenate([b_s, [hi]]).astype(np.int64)
    first = np.searchsorted(g_e, a_s, side="right")  # the first gap that ends after the segment starts
    last = np.searchsorted(g_s, a_e, side="left")  # one past the last gap that starts before it ends
    n = np.maximum(last - first, 0)
    seg = np.repeat(np.arange(len(a_s)), n)
    gap = np.repeat(first - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    s = np.maximum(a_s[seg], g_s[gap])
    e = np.minimum(a_e[seg], g_e[gap])
    keep = e > s
    return s[keep], e[keep]


def covered_within(seg_s: np.ndarray, seg_e: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Per query interval ``[t0[i], t1[i])`` (``t1 >= t0``), the length of it that a segment set
    covers (the length of their intersection), int64. Worked example: segments [0, 5) [10, 20),
    query [3, 12): 2 + 2 = 4."""
    return np.asarray(covered_before(seg_s, seg_e, t1) - covered_before(seg_s, seg_e, t0))


def _nondecreasing(x: np.ndarray) -> bool:
    return bool(np.all(x[1:] >= x[:-1]))


def _running_max_by_key(group: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The running maximum of the int64 ``x`` within each group; ``group``: dense ids 0, 1, ...,
    nondecreasing. Done on the ranks of ``x`` (below n), coded ``group * n + rank``: one running
    max over the codes never carries a value into the next group, and no time can overflow."""
    n = len(x)
    o = np.argsort(x, kind="stable")
    rank = np.empty(n, np.int64)
    rank[o] = np.arange(n, dtype=np.int64)
    code = group.astype(np.int64) * n
    best = np.maximum.accumulate(code + rank) - code
    return x[o][best]


def _sum_by_key(key: np.ndarray, x: np.ndarray, n_keys: int, key_lo: int = 0) -> np.ndarray:
    """Per key in ``[key_lo, key_lo + n_keys)``, the sum of the int64 ``x``, as float64; ``key`` sorted.

    One sum per run of equal keys (``np.add.reduceat``, 2 ns an element, a
    third of ``np.bincount`` with weights). The same numbers as bincount's: the
    values are whole nanoseconds whose partial sums stay below 2^53 (a key's
    union is at most its rank's wall-clock), so the float64 sums are exact.
    """
    out = np.zeros(n_keys)
    if len(key) == 0:
        return out
    first = np.empty(len(key), bool)
    first[0] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    at = np.flatnonzero(first)
    out[key[at] - key_lo] = np.add.reduceat(x, at)
    return out


def _sweep(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int) -> np.ndarray:
    """union_length_by_key on intervals already sorted by (key, t0), keys in ``[0, n_keys)``,
    for runs too long for band coordinates."""
    first = np.r_[True, key[1:] != key[:-1]]
    reach = _running_max_by_key(np.cumsum(first) - 1, t1)
    prev = np.empty_like(reach)
    prev[1:] = reach[:-1]
    prev[first] = _I64_MIN
    contrib = np.maximum(t0, prev, out=prev)
    np.subtract(t1, contrib, out=contrib)
    np.maximum(contrib, 0, out=contrib)
    return np.bincount(key, weights=contrib, minlength=n_keys)
