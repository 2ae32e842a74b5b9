"""Bad settings, models, data and checkpoints fail on every rank with a message naming the value
and the fix (docs/bad-inputs.md lists every case the suite tries, these and the others)."""

from __future__ import annotations

import pytest

from tests.distributed.error_scenarios import SLOW_ATTEMPTS
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

EXPECTED = {
    "world_mismatch": r"pp_size (3) x dp_replicate_size (1) x dp_shard_size (1) = 3, but the world has 4",
    "too_few_microbatches": "num_microbatches=2 is too few for schedule='1f1b' with pp_size=4",
    "more_stages_than_blocks": "has 8 blocks in 'blocks' but the layout needs 16 stages",
    "indivisible_batch": "a batch of 6 rows does not split into num_microbatches=4",
    # ranks 0 and 2 name rank 1 and its error
    "one_dp_rank_indivisible_batch": "a batch of 6 rows does not split into num_microbatches=4",
    "shape_change": "a train batch changed shape from [(4, 16), (4, 16)] to [(4, 8), (4, 8)]",
    "trace_batch_unlike_example": "split='trace' fixed the stages to the example micro-batch's shapes [(2, 16)], so a training batch of num_microbatches=2 micro-batches has [(4, 16)]; this one has [(8, 16)]",
    "unknown_schedule": "schedule='pipedream' is unknown",
    "unsplittable_model": "no ModuleList, ModuleDict or nn.Sequential",
    "lightning_bad_layout": "pp_size (3) x dp_replicate_size (1) x dp_shard_size (1) = 3, but the world has 4",
    "lightning_step_without_model": "the step never called the network",
    "lightning_dataset_smaller_than_a_batch": "the training dataloader gave no batches",
    # core
    "split_typo": "split='calll' is unknown; use 'auto', 'call', 'trace', 'stack' or a callable",
    "bad_split_points": "split_points=[9] must list 1 strictly increasing block indices in 1..7",
    "no_batch": "train_step / eval_step got no batch",
    "tied_weights_traced": "'tok_emb.weight' and 'head.weight' are the same tensor (tied weights)",
    "trace_without_example": "split='trace' needs one example micro-batch of model inputs",
    "meta_unset_on_the_last_stage": "'head.gain' was built on the meta device and nothing set",
    # Lightning: settings
    "lightning_env_typo": "unknown environment variable ZEROPP_PP_SIZ='2'; did you mean ZEROPP_PP_SIZE?",
    "lightning_env_not_an_integer": "ZEROPP_NUM_MICROBATCHES='four' is not an integer",
    "lightning_env_split_typo": "ZEROPP_SPLIT='pipe' is unknown; use one of ('auto', 'call'",
    "lightning_state_dict_type_typo": "state_dict_type='fulll' is not one of ('sharded', 'full')",
    "lightning_split_typo": "split='calll' is unknown",
    "lightning_bad_dtype": "param_dtype='bfloat' is not a known dtype; use one of",
    "lightning_mixed_precision": "keep the Trainer's precision at '32-true' and pass ZeroPPStrategy(param_dtype='bf16')",
    # Lightning: modules
    "lightning_manual_optimization": "ZeroPPStrategy needs automatic optimization",
    "lightning_two_networks": "module_name='model' leaves trainable parameters of _TwoNetworks outside the pipeline (critic.weight, critic.bias): only the pipelined network is trained",
    "lightning_part_outside_forward": "the step uses self.temperature outside _ReadsAPartOutsideForward.forward",
    "lightning_layers_without_forward": "_LayersWithoutForward trains parameters outside one child module (['encoder', 'head']); ZeroPPStrategy then pipelines the module's own forward, which it does not define",
    "lightning_step_calls_a_submodule": "self.model.tok_emb is not reachable inside a step under ZeroPPStrategy",
    # Lightning: data
    "lightning_indivisible_batch": "each data-parallel rank gets 3 rows per batch (batch_size=3, dp_size=2, the loader's batch_size is per rank), which do not split into num_microbatches=2",
    "lightning_short_last_batch": "a batch of 1 rows does not split into num_microbatches=2",
    "lightning_empty_dataset": "the training dataloader gave no batches",
    # Lightning: checkpoints
    "lightning_ckpt_of_another_size": "has `model.tok_emb.weight` [64, 16], the model [64, 32] (and 45 more): it was saved from another model",
    "lightning_full_ckpt_of_another_depth": "the checkpoint does not fit this model: 22 missing (model.blocks.6.",
    "lightning_ckpt_not_from_lightning": "weights.pt is not a Lightning checkpoint: it has no 'state_dict'",
    "lightning_ckpt_missing": "never-saved.ckpt does not exist: there is nothing to load",
    "lightning_ckpt_of_a_deeper_model": "deeper.ckpt holds 22 tensors this model lacks (model.blocks.8.attn.proj.bias, model.blocks.8.attn.proj.weight, model.blocks.8.attn.qkv.weight and 19 more): it was saved from another model (a deeper or wider one)",
    # ranks that must agree
    "lightning_split_points_differ_per_rank": "the ranks disagree on their settings: split_points is [4] on rank 0 and [3] on rank 2 (ZEROPP_SPLIT_POINTS='4' on rank 0, ZEROPP_SPLIT_POINTS='3' on rank 2). Every rank must run with the same settings: set ZEROPP_SPLIT_POINTS alike on every rank",
    "accelerate_split_points_differ_per_rank": "the ranks disagree on their settings: split_points is [4] on rank 0 and [3] on rank 2 (ZEROPP_SPLIT_POINTS='4' on rank 0, ZEROPP_SPLIT_POINTS='3' on rank 2)",
    "lightning_check_batch_differs_per_rank": "the ranks disagree on their settings: check_batch is True on rank 0 and False on rank 2 (ZEROPP_CHECK_BATCH='1' on rank 0, ZEROPP_CHECK_BATCH='0' on rank 2)",
    "lightning_step_draws_apart_under_check_batch": "ZEROPP_CHECK_BATCH: what the step passed to the network differs between the stages of a pipeline: step['micro-batch 0']['args'][0] is",
    "hsdp_replicas_built_unseeded": "the data-parallel replicas (dp_replicate) start from different weights: 'tok_emb.weight' (rank 0) differs between replicas (and more), so they would train apart while averaging gradients. Build the model from the same seed on every rank",
    "lightning_pp_size_differs_per_rank": "the ranks disagree on their settings: pp_size is 2 on rank 0 and 4 on rank 2 (ZEROPP_PP_SIZE='2' on rank 0, ZEROPP_PP_SIZE='4' on rank 2)",
    "lightning_schedule_differs_per_rank": "the ranks disagree on their settings: schedule is '1f1b' on rank 0 and 'gpipe' on rank 2 (ZEROPP_SCHEDULE='1f1b' on rank 0, ZEROPP_SCHEDULE='gpipe' on rank 2)",
    "accelerate_param_dtype_differs_per_rank": "the ranks disagree on their settings: param_dtype is torch.float32 on rank 0 and torch.bfloat16 on rank 2 (ZEROPP_PARAM_DTYPE='fp32' on rank 0, ZEROPP_PARAM_DTYPE='bf16' on rank 2)",
    "accelerate_quantized_weights_differ_per_rank": "the ranks disagree on their settings: quantized_weights is 'int8' on rank 0 and 'fp' on rank 2 (ZEROPP_QUANTIZED_WEIGHTS='int8' on rank 0, ZEROPP_QUANTIZED_WEIGHTS='fp' on rank 2)",
    "model_depth_differs_per_rank": "the ranks disagree on their settings: stage_blocks is [[0, 1, 2, 3], [4, 5, 6, 7]] on rank 0 and [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] on rank 2. Every rank must build the same model",
    "lightning_ckpt_meta_runs_code": "meta.pt names builtins.print, which loading would call: a checkpoint this library or its fronts write holds data only",
    "lightning_ckpt_metadata_runs_code": ".metadata names builtins.print, which unpickling would call: it is not the metadata torch's distributed checkpoint writes",
    "lightning_ckpt_changed_shard": "__1_0.distcp does not match its checksum in",
    "lightning_ckpt_truncated_shard": "__2_0.distcp does not match its checksum in",
    "lightning_ckpt_without_metadata": ".metadata is missing (listed in SHA256SUMS): the checkpoint is incomplete",
    "lightning_ckpt_a_temporary": "saved.ckpt.tmp-0123abcd is the temporary of a save that did not finish (its name ends in .tmp-0123abcd): load the checkpoint under its own name, saved.ckpt.",
    "load_from_a_deeper_model": "holds 22 tensors this model lacks (e.g. ['model.blocks.8.",
    "lightning_timeout_not_a_timedelta": "timeout=60 must be a positive datetime.timedelta, e.g. timeout=datetime.timedelta(seconds=60)",
    # Accelerate
    "accelerate_env_typo": "unknown environment variable ZEROPP_SCHEDUEL='gpipe'; did you mean ZEROPP_SCHEDULE?",
    "accelerate_env_bad_dtype": "param_dtype='fp8' is not a known dtype; use one of ['16', '32', 'bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32']. (settings from the environment: ZEROPP_PARAM_DTYPE=fp8 (param_dtype)",
    "accelerate_indivisible_loader": "each data-parallel rank gets 6 rows per batch (batch_size=6, dp_size=2, split_batches=False), which do not split into num_microbatches=4",
}
ERROR_TYPE = {
    "lightning_step_without_model": "RuntimeError",
    "lightning_step_calls_a_submodule": "AttributeError",
    "lightning_ckpt_missing": "FileNotFoundError",
}


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("errors")
    params = {"work_dir": str(out / "work")}
    return launch(4, "error_scenarios.attempt_all", params, out, timeout=240)


def test_every_attempt_is_checked(errors):
    assert set(errors[0]) == set(EXPECTED) - SLOW_ATTEMPTS


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - SLOW_ATTEMPTS))
def test_every_rank_gets_a_clear_error(errors, name):
    for rank, rank_errors in enumerate(errors):
        message = rank_errors[name]
        kind = ERROR_TYPE.get(name, "ValueError")
        assert message.startswith(f"{kind}: "), f"rank {rank}: {message}"
        assert EXPECTED[name] in message, f"rank {rank}: {message}"


@pytest.mark.slow  # another 4-rank launch: bench/slow_tests.py
def test_every_rank_gets_a_clear_error_in_the_slow_attempts(tmp_path):
    params = {"work_dir": str(tmp_path / "work"), "slow": True}
    seen = launch(4, "error_scenarios.attempt_all", params, tmp_path, timeout=400)
    assert set(seen[0]) == SLOW_ATTEMPTS
    for name in sorted(SLOW_ATTEMPTS):
        for rank, rank_errors in enumerate(seen):
            kind = ERROR_TYPE.get(name, "ValueError")
            assert rank_errors[name].startswith(f"{kind}: "), f"{name}, rank {rank}"
            assert EXPECTED[name] in rank_errors[name], f"{name}, rank {rank}: {rank_errors[name]}"


def test_a_bad_batch_on_one_data_parallel_rank_is_named_on_every_rank(errors):
    """Data-parallel rank 1 (global ranks 1 and 3) alone reads 6 rows: it raises its own error,
    and the ranks whose batch passed raise one naming it, instead of a transport error."""
    for rank, rank_errors in enumerate(errors):
        message = rank_errors["one_dp_rank_indivisible_batch"]
        if rank % 2:
            assert "this rank's batch passed" not in message, message
        else:
            assert message.startswith("ValueError: rank 1 ("), message
            assert message.endswith("(this rank's batch passed; every rank stops at this step)")
