"""The Accelerate front's pieces that need no process group: ZEROPP_* parsing, the optimizer
rebuild, the scheduler retargeting, the scheduler stepping convention, batches and loaders."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate import DistributedType
from torch import nn
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp.accelerate.build import _settings
from lightning_zeropp.accelerate.build_checks import check_accelerator, resolve_layout
from lightning_zeropp.accelerate.checkpointing import _nonempty_groups
from lightning_zeropp.accelerate.data import (
    check_loader,
    example_microbatch,
    unpack_batch,
)
from lightning_zeropp.accelerate.optim import PipelineScheduler
from lightning_zeropp.core.settings import env
from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.fronts.optim import (
    optimizer_param_names,
    rebuild_optimizer,
    retarget_scheduler,
)


# ------------------------------------------------------------------------------ ZEROPP_* variables
def test_every_config_field_has_a_variable():
    fields = {f.name for f in dataclasses.fields(ZeroPPConfig)}
    assert set(env.CONFIG_VARS.values()) == fields


def test_config_from_env_parses_every_kind_of_value():
    environ = {
        "ZEROPP_PP_SIZE": "2",
        "ZEROPP_NUM_MICROBATCHES": "8",
        "ZEROPP_SCHEDULE": "zeropp",
        "ZEROPP_PARAM_DTYPE": "bf16",
        "ZEROPP_ACTIVATION_CHECKPOINTING": "yes",
        "ZEROPP_RESHARD_AFTER_FORWARD": "0",
        "ZEROPP_SPLIT_POINTS": "3, 6",
        "ZEROPP_UNIT_SIZE": "4",
        "ZEROPP_SPLIT_BACKWARD": "false",
        "ZEROPP_GRAD_REDUCE": "unit",
        "PATH": "/bin",  # other variables are none of ZeroPP's business
    }
    cfg = env.config_from_env(environ)
    assert cfg == ZeroPPConfig(
        pp_size=2,
        num_microbatches=8,
        schedule="zeropp",
        param_dtype="bf16",
        activation_checkpointing=True,
        reshard_after_forward=False,
        split_points=[3, 6],
        unit_size=4,
        split_backward=False,
        grad_reduce="unit",
    )
    resolved = cfg.resolve(8)
    assert resolved.dp_shard_size == 4 and resolved.param_dtype == torch.bfloat16
    assert env.config_from_env({}) == ZeroPPConfig()
    policy = env.config_from_env({"ZEROPP_ACTIVATION_CHECKPOINTING": "except_last"})
    assert policy.activation_checkpointing == "except_last"


@pytest.mark.parametrize(
    "environ, match",
    [
        (
            {"ZEROPP_PP_SIZ": "2"},
            r"unknown environment variable ZEROPP_PP_SIZ=.*did you mean ZEROPP_PP_SIZE",
        ),
        ({"ZEROPP_PP_SIZE": "two"}, r"ZEROPP_PP_SIZE='two' is not an integer"),
        (
            {"ZEROPP_SPLIT_BACKWARD": "maybe"},
            r"ZEROPP_SPLIT_BACKWARD='maybe' is not a boolean",
        ),
        (
            {"ZEROPP_SPLIT_POINTS": "3;6"},
            r"ZEROPP_SPLIT_POINTS='3;6' is not a comma-separated list",
        ),
        ({"ZEROPP_SCHEDULE": " "}, r"ZEROPP_SCHEDULE is set but empty"),
    ],
)
def test_bad_variables_are_named(environ, match):
    with pytest.raises(ValueError, match=match):
        env.config_from_env(environ)


def test_split_from_env():
    assert env.split_from_env({}) is None
    assert env.split_from_env({"ZEROPP_SPLIT": "Stack"}) == "stack"
    with pytest.raises(ValueError, match=r"ZEROPP_SPLIT='pipe' is unknown"):
        env.split_from_env({"ZEROPP_SPLIT": "pipe"})
    described = env.describe_env({"ZEROPP_PP_SIZE": "3", "ZEROPP_SPLIT": "trace"})
    assert described == "ZEROPP_PP_SIZE=3 (pp_size), ZEROPP_SPLIT=trace (split)"


def test_a_bad_value_from_the_environment_names_the_variables(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "3")
    with pytest.raises(ValueError, match=r"world has 4 processes.*ZEROPP_PP_SIZE=3 \(pp_size\)"):
        resolve_layout(_settings(None, None), 4)
    # A config in code wins over the environment (which is only reported), but a typo still fails.
    assert resolve_layout(_settings(ZeroPPConfig(pp_size=2), None), 4).pp_size == 2
    monkeypatch.setenv("ZEROPP_SCHEDUEL", "gpipe")
    with pytest.raises(ValueError, match=r"did you mean ZEROPP_SCHEDULE"):
        _settings(ZeroPPConfig(pp_size=2), None)


# ------------------------------------------------------------------------------ optimizer
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.norm = nn.LayerNorm(4)


def grouped_adamw(net: Net) -> torch.optim.Optimizer:
    matrices = [p for n, p in net.named_parameters() if p.dim() == 2 and "emb" not in n]
    vectors = [p for p in net.parameters() if p.dim() == 1]
    return torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": 0.1, "name": "decay"},
            {"params": vectors, "weight_decay": 0.0},
            {"params": [net.emb.weight], "lr": 5e-3, "betas": (0.8, 0.95)},
        ],
        lr=1e-2,
        eps=1e-6,
    )


def stage_params(net: Net, stage: int) -> dict[str, nn.Parameter]:
    """A copy's parameters as a 'stage' would hold them: stage 0 has emb + blocks.0, stage 1 the rest."""
    clone = copy.deepcopy(net)
    named = dict(clone.named_parameters())
    first = {n: p for n, p in named.items() if n.startswith(("emb", "blocks.0"))}
    return first if stage == 0 else {n: p for n, p in named.items() if n not in first}


def test_rebuild_keeps_class_groups_and_hyperparameters():
    net = Net()
    opt = grouped_adamw(net)
    names = optimizer_param_names(opt, net)
    for stage in (0, 1):
        params = stage_params(net, stage)
        new = rebuild_optimizer(opt, names, params)
        assert type(new) is torch.optim.AdamW and new.defaults == opt.defaults
        assert len(new.param_groups) == 3  # aligned across stages, even where a group is empty
        for old_g, new_g in zip(opt.param_groups, new.param_groups, strict=True):
            assert {k: v for k, v in old_g.items() if k != "params"} == {
                k: v for k, v in new_g.items() if k != "params"
            }
            want = [
                params[n]
                for n, p in net.named_parameters()
                if any(p is q for q in old_g["params"]) and n in params
            ]
            assert new_g["params"] == want
    assert rebuild_optimizer(opt, names, stage_params(net, 1)).param_groups[2]["params"] == []


def test_rebuilt_optimizer_trains_like_the_original():
    torch.manual_seed(0)
    net = Net()
    opt = grouped_adamw(net)
    twin = copy.deepcopy(net)
    new = rebuild_optimizer(opt, optimizer_param_names(opt, net), dict(twin.named_parameters()))
    for step in range(3):
        for model, o in ((net, opt), (twin, new)):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.1 * (i + 1) * (step + 1))
            o.step()
            o.zero_grad()
    for (n, a), b in zip(net.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_optimizer_errors_say_what_to_do():
    net = Net()
    stranger = torch.optim.SGD([*net.parameters(), nn.Parameter(torch.zeros(7))], lr=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the model"):
        optimizer_param_names(stranger, net)
    stepped = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    stepped.step()
    with pytest.raises(ValueError, match=r"already has state.*load_state"):
        optimizer_param_names(stepped, net)
    with pytest.raises(TypeError, match=r"not one from accelerator.prepare"):
        optimizer_param_names(SimpleNamespace(optimizer=stepped), net)  # type: ignore[arg-type]

    class Picky(torch.optim.SGD):
        def __init__(self, params: Any, lr: float, *, special: int) -> None:
            super().__init__(params, lr=lr)

    picky = Picky(net.parameters(), lr=0.1, special=1)
    with pytest.raises(TypeError, match=r"cannot rebuild Picky.*lambda module"):
        rebuild_optimizer(picky, optimizer_param_names(picky, net), dict(net.named_parameters()))


# ------------------------------------------------------------------------------ schedulers
def _hf_cosine(opt: torch.optim.Optimizer) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)


SCHEDULERS = {
    "lambda": lambda o: lrs.LambdaLR(o, lambda s: 1 / (s + 1)),
    "step": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "multistep": lambda o: lrs.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "exponential": lambda o: lrs.ExponentialLR(o, gamma=0.9),
    "cosine": lambda o: lrs.CosineAnnealingLR(o, T_max=5),
    "warm_restarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=3),
    "polynomial": lambda o: lrs.PolynomialLR(o, total_iters=4, power=2.0),
    "onecycle": lambda o: lrs.OneCycleLR(o, max_lr=[0.1, 0.05, 0.02], total_steps=8),
    "cyclic": lambda o: lrs.CyclicLR(o, 1e-3, 1e-2, step_size_up=2, mode="exp_range"),
    "sequential": lambda o: lrs.SequentialLR(
        o, [lrs.LinearLR(o, 0.2, total_iters=2), lrs.CosineAnnealingLR(o, T_max=5)], [2]
    ),
    "chained": lambda o: lrs.ChainedScheduler(
        [lrs.ConstantLR(o, factor=0.5, total_iters=2), lrs.ExponentialLR(o, gamma=0.9)]
    ),
    "plateau": lambda o: lrs.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "hf_cosine_warmup": _hf_cosine,
}


# The rebuilt optimizer's `step` was never wrapped by torch's call-order tracker, and torch says so
# at the first scheduler step; PipelineScheduler silences that, these tests drive the raw scheduler.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_retargeted_scheduler_drives_the_rebuilt_optimizer_as_the_original(kind):
    torch.manual_seed(0)
    net = Net()
    opt = grouped_adamw(net)
    sched = SCHEDULERS[kind](opt)
    twin = copy.deepcopy(net)
    new = rebuild_optimizer(opt, optimizer_param_names(opt, net), dict(twin.named_parameters()))
    moved = retarget_scheduler(sched, opt, new)
    assert moved.optimizer is new and sched.optimizer is opt  # the original is untouched
    for step in range(6):
        for model, o, s in ((net, opt, sched), (twin, new, moved)):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01 * (step + 1))
            o.step()
            s.step(1.0) if kind == "plateau" else s.step()
            o.zero_grad()
        assert [g["lr"] for g in new.param_groups] == [g["lr"] for g in opt.param_groups]
        assert moved.get_last_lr() == sched.get_last_lr()
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scheduler_factories_and_errors():
    net = Net()
    opt, other = grouped_adamw(net), grouped_adamw(net)
    built = retarget_scheduler(lambda o: lrs.StepLR(o, step_size=1), opt, other)
    assert built.optimizer is other
    with pytest.raises(ValueError, match=r"drives another optimizer"):
        retarget_scheduler(lrs.StepLR(other, step_size=1), opt, other)
    with pytest.raises(TypeError, match=r"optimizer factory.*scheduler=lambda opt"):
        retarget_scheduler(lrs.StepLR(opt, step_size=1), None, other)

    class Hidden(lrs.StepLR):  # keeps the optimizer where retargeting cannot see to replace it
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            super().__init__(optimizer, step_size=1)
            self.extra = {"opt": optimizer}

    with pytest.raises(TypeError, match=r"cannot retarget Hidden: its attribute 'extra'"):
        retarget_scheduler(Hidden(opt), opt, other)


def test_pipeline_scheduler_follows_accelerates_convention():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    sched = lrs.LambdaLR(opt, lambda s: 1 / (s + 1))
    acc = SimpleNamespace(step_scheduler_with_optimizer=True, sync_gradients=True)
    wrapped = PipelineScheduler(
        sched, acc, SimpleNamespace(step_was_skipped=False), steps_per_call=2
    )
    opt.step()
    wrapped.step()  # each dp rank loaded a whole batch: two single-process steps per update
    assert sched.last_epoch == 2 and wrapped.last_epoch == 2
    acc.sync_gradients = False  # accumulating: no optimizer step, no scheduler step
    wrapped.step()
    assert sched.last_epoch == 2
    assert wrapped.state_dict()["last_epoch"] == 2

    once_opt = torch.optim.SGD(net.parameters(), lr=1.0)
    once = lrs.OneCycleLR(once_opt, max_lr=1.0, total_steps=3)
    once_opt.step()
    acc.sync_gradients = True
    capped = PipelineScheduler(once, acc, SimpleNamespace(step_was_skipped=False), steps_per_call=2)
    for _ in range(3):  # would pass OneCycleLR's last step (it raises there): stops at the end
        capped.step()
    assert once.last_epoch == 3


# ------------------------------------------------------------------------------ batches, loaders
def test_unpack_batch():
    x, y, mask = torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3)
    assert unpack_batch((x, y)) == ((x,), {}, y)
    args, kwargs, target = unpack_batch({"input_ids": x, "labels": y, "attention_mask": mask})
    assert args == (x,) and kwargs == {"attention_mask": mask} and target is y
    assert unpack_batch([(x, mask), y])[0] == (x, mask)
    with pytest.raises(ValueError, match=r"'input_ids' and 'labels'"):
        unpack_batch({"x": x})
    with pytest.raises(TypeError, match=r"unpack=fn"):
        unpack_batch((x, y, mask))


def test_check_loader_names_sizes_and_fix():
    data = TensorDataset(torch.zeros(64, 3), torch.zeros(64, 3))
    check_loader(DataLoader(data, batch_size=16), True, 2, 4)  # 8 rows per rank, 4 micro-batches
    with pytest.raises(ValueError, match=r"batch_size=15 does not split over 2 data-parallel"):
        check_loader(DataLoader(data, batch_size=15, drop_last=True), True, 2, 1)
    with pytest.raises(ValueError, match=r"gets 8 rows .* num_microbatches=3"):
        check_loader(DataLoader(data, batch_size=8), False, 2, 3)
    with pytest.raises(ValueError, match=r"drop_last=True"):
        check_loader(DataLoader(data, batch_size=12), False, 2, 2)  # 64 rows, 24 per step


def test_a_dataset_smaller_than_one_step_is_refused_not_trained_for_0_steps():
    small = TensorDataset(torch.zeros(6, 3), torch.zeros(6, 3))  # one step needs 2 x 4 rows
    with pytest.raises(ValueError, match=r"has 6 rows, fewer than one step's 8 .* drop_last=True"):
        check_loader(DataLoader(small, batch_size=4, drop_last=True), False, 2, 2)
    with pytest.raises(ValueError, match=r"has 0 rows"):
        check_loader(DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=4), False, 2, 2, True)
    # Without drop_last, Accelerate completes the short batch (even_batches): one step.
    check_loader(DataLoader(small, batch_size=4), False, 2, 2, fills_last=True)


def test_example_is_read_without_touching_the_shuffling_generators():
    data = TensorDataset(torch.arange(40).view(20, 2), torch.zeros(20, 2))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    before = torch.get_rng_state()
    args, kwargs = example_microbatch(loader, 2, unpack_batch)
    assert torch.equal(torch.get_rng_state(), before)
    assert kwargs == {} and torch.equal(args[0], torch.tensor([[0, 1], [2, 3]]))


# ------------------------------------------------------------------------------ accelerator, checkpoint
def fake_accelerator(**overrides: Any) -> SimpleNamespace:
    values = {
        "distributed_type": DistributedType.MULTI_CPU,
        "mixed_precision": "no",
        "parallelism_config": None,
        "num_processes": 4,
    }
    return SimpleNamespace(**(values | overrides))


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"distributed_type": DistributedType.FSDP}, r"without --use_fsdp"),
        ({"mixed_precision": "bf16"}, r"ZEROPP_PARAM_DTYPE=bf16"),
        ({"parallelism_config": object()}, r"ZEROPP_PP_SIZE"),
    ],
)
def test_accelerator_settings_that_cannot_work_are_refused(overrides, match):
    check_accelerator(fake_accelerator())  # the supported setting passes
    with pytest.raises(ValueError, match=match):
        check_accelerator(fake_accelerator(**overrides))


def test_single_process_accelerator_under_a_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_CPU=1, before anything else reads"):
        check_accelerator(fake_accelerator(num_processes=1, distributed_type=DistributedType.NO))


def test_a_tracker_that_made_a_one_process_state_first_is_named(monkeypatch):
    """Before: a custom tracker (its @on_main_process __init__ reads PartialState()) built before
    ZeroPPAccelerator(cpu=True) left Accelerate one process, and the user, who had passed
    cpu=True, was told to pass cpu=True."""
    from accelerate.state import AcceleratorState
    from accelerate.tracking import GeneralTracker, on_main_process

    from lightning_zeropp.accelerate import ZeroPPAccelerator

    class Tracker(GeneralTracker):
        name, requires_logging_directory, main_process_only = "mine", False, True

        @on_main_process
        def __init__(self) -> None:
            super().__init__()

        @property
        def tracker(self) -> None:
            return None

    monkeypatch.setenv("WORLD_SIZE", "4")  # as a launcher sets it (LOCAL_RANK would rendezvous)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    AcceleratorState._reset_state(True)
    try:
        tracker = Tracker()  # makes Accelerate's process state, without cpu=True
        with pytest.raises(ValueError, match=r"it was made before the ZeroPPAccelerator") as err:
            ZeroPPAccelerator(cpu=True, log_with=[tracker])
        assert "PartialState(cpu=True)` before building the tracker" in str(err.value)
    finally:
        AcceleratorState._reset_state(True)


def test_empty_groups_are_hidden_from_the_checkpoint_and_restored():
    net = Net()
    opt = grouped_adamw(net)
    opt.param_groups[2]["params"] = []  # as on a stage without the embedding
    empty = opt.param_groups[2]
    with _nonempty_groups(opt):
        assert len(opt.param_groups) == 2
        # loading replaces the group dicts, as Optimizer.load_state_dict does
        opt.param_groups = [dict(g, lr=0.5) for g in opt.param_groups]
    assert len(opt.param_groups) == 3 and opt.param_groups[2] is empty
    assert [g["lr"] for g in opt.param_groups[:2]] == [0.5, 0.5]
