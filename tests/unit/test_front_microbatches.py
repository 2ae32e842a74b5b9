"""The fronts' one micro-batch decision (`fronts.microbatches`): the count a call runs in, and
a loader's rows per data-parallel rank checked against the ranks and the micro-batches, and the
number of losses a step averages (what a global count is divided by)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_zeropp.fronts.microbatches import (
    call_microbatches,
    check_rows_per_rank,
    loss_shares,
    rows_split,
)


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


def _dims(dp: int, cp: int) -> Any:
    """What `loss_shares` reads of a `ParallelDims`: its sizes (a mesh needs a process group)."""
    return SimpleNamespace(dp_size=dp, grad_size=dp * cp)


@pytest.mark.parametrize(
    ("micro", "dp", "cp", "cp_parts", "want"),
    [(4, 1, 1, False, 4), (4, 2, 1, True, 8), (3, 2, 2, False, 6), (3, 2, 2, True, 12)],
)
def test_loss_shares_count_micro_batches_and_ranks_cp_only_for_parts(micro, dp, cp, cp_parts, want):
    assert loss_shares(micro, _dims(dp, cp), cp_parts=cp_parts) == want
