"""distdiag.ranks: how warnings and findings write a set of ranks."""

from __future__ import annotations

import numpy as np
import pytest

from distdiag.ranks import rank_list, rank_ranges


@pytest.mark.parametrize(("ranks", "text"), [
    ([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8"),
    ([8, 7, 0, 5, 2, 1], "0-2, 5, 7-8"),  # any order in, ascending out
    ([3], "3"),
    ([3, 4], "3-4"),  # two in a row are a range already
    ([1, 3, 5], "1, 3, 5"),  # gaps of one rank break it
    (list(range(1024)), "0-1023"),  # one line at 1,024 ranks
    ([], ""),
])  # fmt: skip
def test_consecutive_ranks_fold_into_ranges(ranks: list[int], text: str) -> None:
    assert rank_ranges(ranks) == text


def test_ranges_take_numpy_ranks_and_write_plain_numbers() -> None:
    # the loader and align pass lists, the detectors numpy arrays of int32
    assert rank_ranges(np.array([9, 4, 5, 6], np.int32)) == "4-6, 9"
    assert rank_ranges(iter([2, 1])) == "1-2"


def test_a_repeated_rank_shows() -> None:
    assert rank_ranges([1, 1, 2]) == "1, 1-2"


def test_rank_list_names_each_rank_up_to_the_limit() -> None:
    assert rank_list(np.array([5, 0, 3])) == "0, 3, 5"
    assert rank_list([], 4) == ""


def test_rank_list_counts_the_ranks_past_the_limit() -> None:
    assert rank_list(range(4), 4) == "0, 1, 2, 3"  # at the limit: all named
    assert rank_list(range(5), 4) == "0, 1, 2, 3 and 1 more"
    assert rank_list(range(40)) == ", ".join(map(str, range(16))) + " and 24 more"
