"""Settings validation: every mistake a user can make is a ValueError naming the value and the fix."""

import pytest
import torch

from lightning_zeropp import ZeroPPConfig


def test_defaults_fill_from_world_size():
    cfg = ZeroPPConfig(pp_size=2).resolve(8)
    assert (cfg.pp_size, cfg.dp_replicate_size, cfg.dp_shard_size) == (2, 1, 4)
    assert cfg.num_microbatches == 2 and cfg.num_chunks == 1
    assert cfg.reshard_after_forward is False  # one gather per stage and step under PP
    assert ZeroPPConfig(dp_shard_size=4).resolve(4).reshard_after_forward is True  # plain FSDP
    assert ZeroPPConfig(schedule="interleaved_1f1b", pp_size=2).resolve(2).num_chunks == 2
    assert ZeroPPConfig(param_dtype="bf16").resolve(1).param_dtype == torch.bfloat16
    zeropp = ZeroPPConfig(schedule="zeropp", pp_size=2, num_microbatches=7).resolve(2)
    assert (zeropp.num_chunks, zeropp.unit_size) == (2, 2)  # any M: the last unit may be smaller
    assert (zeropp.split_backward, zeropp.grad_reduce) == (True, "step")
    assert ZeroPPConfig(pp_size=2).resolve(2).split_backward is False


def test_default_layout_rule():
    """No sizes: two pipeline stages when the world splits evenly, the rest sharded."""
    sizes = {
        w: (c.pp_size, c.dp_shard_size) for w in (1, 2, 3, 4, 8) if (c := ZeroPPConfig().resolve(w))
    }
    assert sizes == {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2), 8: (2, 4)}
    assert ZeroPPConfig(dp_shard_size=2).resolve(8).pp_size == 4  # what the others leave
    assert ZeroPPConfig(dp_replicate_size=2).resolve(2).pp_size == 1


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("Interleaved1F1B", "interleaved_1f1b"),
        ("ZBVZeroBubble", "zbv"),
        ("ScheduleGPipe", "gpipe"),
        ("LoopedBFS", "looped_bfs"),
        ("InterleavedZeroBubble", "interleaved_zb"),
        ("DualPipeV", "dualpipev"),
        ("1F1B", "1f1b"),
        ("ZeroPP", "zeropp"),
    ],
)
def test_torch_schedule_names_are_aliases(alias, name):
    assert ZeroPPConfig(pp_size=2, schedule=alias, num_microbatches=4).resolve(2).schedule == name


def test_recompute_policy():
    cfg = ZeroPPConfig(schedule="zeropp", pp_size=2, activation_checkpointing="except_last")
    cfg = cfg.resolve(2)
    assert [cfg.recomputes(s) for s in range(4)] == [True, True, True, False]
    assert ZeroPPConfig(activation_checkpointing=True).resolve(1).recomputes(0)
    assert not ZeroPPConfig().resolve(1).recomputes(0)


@pytest.mark.parametrize(
    ("kwargs", "world", "match"),
    [
        (
            dict(pp_size=2, dp_shard_size=3),
            8,
            r"pp_size \(2\) x dp_replicate_size \(1\) x dp_shard_size \(3\) = 6",
        ),
        (dict(pp_size=4, num_microbatches=2), 4, r"num_microbatches=2 is too few .* at least 4"),
        (dict(schedule="pipedream"), 1, r"schedule='pipedream' is unknown"),
        (dict(schedule="1f1b", num_chunks=2), 1, r"num_chunks=2 needs a multi-stage schedule"),
        (dict(schedule="zbv", num_chunks=3, pp_size=2), 2, r"exactly 2 stages per rank"),
        (dict(pp_size=0), 1, r"pp_size=0 must be a positive integer"),
        (dict(param_dtype="fp8"), 1, r"param_dtype='fp8' is not a known dtype"),
        (dict(schedule="interleaved_1f1b", pp_size=2, num_microbatches=5), 2, r"multiple of 2"),
        (
            dict(schedule="zeropp", pp_size=4, unit_size=2),
            4,
            r"unit_size=2 is smaller than pp_size=4",
        ),
        (dict(schedule="1f1b", unit_size=2), 1, r"unit_size=2 applies to schedule='zeropp' only"),
        (dict(grad_reduce="epoch"), 1, r"grad_reduce='epoch' is unknown"),
        (dict(grad_reduce="unit"), 1, r"grad_reduce='unit' applies to schedule='zeropp' only"),
        (dict(split_backward=True), 1, r"split_backward=True applies to schedule='zeropp' only"),
        (dict(nonfinite="ignore"), 1, r"nonfinite='ignore' is unknown; choose 'raise'"),
        (dict(activation_checkpointing="some"), 1, r"activation_checkpointing='some' is unknown"),
    ],
)
def test_bad_settings_name_the_value(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs).resolve(world)


def test_split_backward_keeps_weights_unsharded_between_its_tasks():
    """Resharding after forward under split backward lost the weight gradients (silently):
    those schedules default to no resharding, and refuse it when asked for."""
    for schedule in ("zbv", "interleaved_zb", "dualpipev", "zeropp"):
        layout = ZeroPPConfig(pp_size=1, schedule=schedule).resolve(2)
        assert layout.reshard_after_forward is False, schedule
        with pytest.raises(ValueError, match="weight gradients would be lost"):
            ZeroPPConfig(pp_size=2, schedule=schedule, reshard_after_forward=True).resolve(2)
    full = ZeroPPConfig(pp_size=1, schedule="zeropp", split_backward=False).resolve(2)
    assert full.reshard_after_forward is True  # a full backward: FSDP's default stands
    assert ZeroPPConfig(pp_size=2, reshard_after_forward=True).resolve(2).reshard_after_forward
