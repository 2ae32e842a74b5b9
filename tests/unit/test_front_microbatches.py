"""The fronts' one micro-batch decision (`fronts.microbatches`): the count a call runs in, and
a loader's rows per data-parallel rank checked against the ranks and the micro-batches."""

from __future__ import annotations

import pytest

from lightning_zeropp.fronts.microbatches import call_microbatches, check_rows_per_rank, rows_split


@pytest.mark.parametrize(
    ("rows", "training", "want"),
    [(8, True, 4), (6, True, 4), (8, False, 4), (6, False, 3), (7, False, 1), (2, False, 2)],
)
def test_training_takes_the_setting_forward_only_the_most_that_split(rows, training, want):
    assert call_microbatches(rows, 4, training) == want


def test_rows_split_into_equal_micro_batches_of_a_row_at_least():
    assert rows_split(8, 4) and rows_split(4, 4)
    assert not rows_split(6, 4) and not rows_split(2, 4)


def test_rows_per_rank_split_or_refused_naming_the_fix():
    assert check_rows_per_rank(16, 2, 4, split_batches=True) == 8
    assert check_rows_per_rank(8, 2, 4, split_batches=False) == 8
    with pytest.raises(ValueError, match="batch_size=9 does not split over 2 data-parallel"):
        check_rows_per_rank(9, 2, 1, split_batches=True)
    with pytest.raises(
        ValueError, match=r"6 rows per batch .* num_microbatches=4 .* multiple of 4"
    ):
        check_rows_per_rank(6, 2, 4, split_batches=False)
