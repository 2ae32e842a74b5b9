"""Bad settings and bad batches fail on every rank with a message naming the value and the fix."""

from __future__ import annotations

import pytest

from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

EXPECTED = {
    "world_mismatch": r"pp_size (3) x dp_replicate_size (1) x dp_shard_size (1) = 3, but the world has 4",
    "too_few_microbatches": "num_microbatches=2 is too few for schedule='1f1b' with pp_size=4",
    "more_stages_than_blocks": "has 8 blocks in 'blocks' but the layout needs 16 stages",
    "indivisible_batch": "a batch of 6 rows does not split into num_microbatches=4",
    "shape_change": "a train batch changed shape from [(4, 16), (4, 16)] to [(4, 8), (4, 8)]",
    "unknown_schedule": "schedule='pipedream' is unknown",
    "unsplittable_model": "no ModuleList, ModuleDict or nn.Sequential",
    "lightning_bad_layout": "pp_size (3) x dp_replicate_size (1) x dp_shard_size (1) = 3, but the world has 4",
    "lightning_step_without_model": "the step never called the network",
    "lightning_dataset_smaller_than_a_batch": "the training dataloader gave no batches",
}
ERROR_TYPE = {"lightning_step_without_model": "RuntimeError"}


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    return launch(
        4, "error_scenarios.attempt_all", {}, tmp_path_factory.mktemp("errors"), timeout=240
    )


@pytest.mark.parametrize("name", EXPECTED)
def test_every_rank_gets_a_clear_error(errors, name):
    for rank, rank_errors in enumerate(errors):
        message = rank_errors[name]
        kind = ERROR_TYPE.get(name, "ValueError")
        assert message.startswith(f"{kind}: "), f"rank {rank}: {message}"
        assert EXPECTED[name] in message, f"rank {rank}: {message}"
