"""The pieces of one batch per pipeline that need no peer: a batch's structure sent without its
tensors and rebuilt around them, the checksums the batch check compares, and the
`ZEROPP_CHECK_BATCH` variable (the exchange itself runs on 4 ranks: test_batch_once.py)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from transformers import BatchEncoding

from lightning_zeropp.core.settings.env import check_batch_from_env, describe_env, zeropp_env
from lightning_zeropp.core.step import pipeline_batch as pb

Pair = namedtuple("Pair", "x y")


def _batch(seed: int, rows: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 9, (rows, 3), generator=g),
        "mask": torch.rand(rows, generator=g) < 0.5,
        "scale": 2.0,
        "pair": Pair(torch.zeros(rows), [torch.ones(1), "name"]),
    }


def test_a_batch_is_sent_as_its_structure_and_rebuilt_around_the_tensors() -> None:
    batch = _batch(0)
    tensors: list[torch.Tensor] = []
    skeleton = pb._strip(batch, tensors)
    assert [t is u for t, u in zip(tensors, _leaves(batch), strict=True)] == [True] * 4
    assert batch["input_ids"] is tensors[0]  # the batch itself is left as it was
    assert isinstance(skeleton["pair"], Pair) and skeleton["scale"] == 2.0
    # another rank's batch of the same rows and shapes (other draws): the same skeleton
    assert pb._same(skeleton, pb._strip(_batch(1), []))
    assert not pb._same(skeleton, pb._strip(_batch(0, rows=3), []))
    assert not pb._same(skeleton, pb._strip({**_batch(0), "scale": 3.0}, []))
    rebuilt = pb._fill(pb._strip(batch, []), tensors)
    assert rebuilt["pair"].y[1] == "name" and rebuilt["input_ids"] is tensors[0]


def test_an_hf_batch_encoding_keeps_its_type() -> None:
    encoding = BatchEncoding({"input_ids": torch.ones(2, 3), "labels": torch.zeros(2, 3)})
    tensors: list[torch.Tensor] = []
    skeleton = pb._strip(encoding, tensors)
    assert type(skeleton) is BatchEncoding and len(tensors) == 2
    assert type(pb._fill(skeleton, tensors)) is BatchEncoding


def test_checksums_name_each_entry_and_tell_draws_apart() -> None:
    one, two = pb._digests(_batch(0)), pb._digests(_batch(1))
    assert [path for path, _ in one] == [path for path, _ in two]
    assert one[0][0] == "batch['input_ids']" and one[0][1] != two[0][1]
    assert pb._digests(_batch(0)) == one  # the same values, the same sums
    message = pb._difference(one, two, 1, "the batch")
    assert "batch['input_ids']" in message and "pipeline rank 1" in message


def test_the_check_variable_is_read_and_a_bad_value_is_named() -> None:
    assert check_batch_from_env({}) is False
    assert check_batch_from_env({"ZEROPP_CHECK_BATCH": "1"}) is True
    assert check_batch_from_env({"ZEROPP_CHECK_BATCH": "off"}) is False
    with pytest.raises(ValueError, match="ZEROPP_CHECK_BATCH='sometimes' is not a boolean"):
        check_batch_from_env({"ZEROPP_CHECK_BATCH": "sometimes"})
    with pytest.raises(ValueError, match="did you mean ZEROPP_CHECK_BATCH"):
        zeropp_env({"ZEROPP_CHECK_BATCHES": "1"})
    assert describe_env({"ZEROPP_CHECK_BATCH": "1"}) == "ZEROPP_CHECK_BATCH=1 (check_batch)"


def _leaves(batch: dict) -> list[torch.Tensor]:
    return [batch["input_ids"], batch["mask"], batch["pair"].x, batch["pair"].y[0]]
