"""The Lightning front's pieces without a process group: which network a LightningModule has, a
step run once per micro-batch and paused at its network call, the stand-ins for the network's
parts, losses weighted by their items, and the checks on hooks that read the model."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

from lightning_zeropp.lightning.continuation import Continuation
from lightning_zeropp.lightning.hooks import ShardReads
from lightning_zeropp.lightning.microbatches import merge as _merge
from lightning_zeropp.lightning.microbatches import scalar as _scalar
from lightning_zeropp.lightning.network import Network
from lightning_zeropp.lightning.redirect import StandIn, attributes_kept
from lightning_zeropp.lightning.weighting import WeightWatch, loss_weight


# ------------------------------------------------------------------ which network
class NoForward(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)


class EncoderHead(NoForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class WithScale(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.logit_scale = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.logit_scale.exp()


class Teacher(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.teacher = nn.Linear(4, 4).requires_grad_(False)


def test_the_network_is_the_one_trainable_child_else_the_module_itself() -> None:
    assert Network.of(Teacher(), None).attr == "student"  # a frozen teacher stays outside
    scaled = Network.of(WithScale(), None)
    assert scaled.attr is None and scaled.call == "self(...)"
    assert scaled.params == ["logit_scale"] and scaled.children == ["model"]
    assert Network.of(EncoderHead(), None).children == ["encoder", "head"]


def test_a_trainable_parameter_left_outside_the_pipeline_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"module_name='encoder' leaves .*\(head.weight, head.bias\)"
    ):
        Network.of(EncoderHead(), "encoder")
    with pytest.raises(ValueError, match=r"logit_scale.*Leave module_name out"):
        Network.of(WithScale(), "model")


def test_a_module_whose_layers_need_its_forward_must_have_one() -> None:
    with pytest.raises(ValueError, match=r"\['encoder', 'head'\].*does not define. Define forward"):
        Network.of(NoForward(), None)


def test_inside_a_step_the_parts_are_reached_only_through_forward() -> None:
    module = WithScale()
    network = Network.of(module, None)
    with network.redirected(lambda x: x + 1):
        assert torch.equal(module(torch.zeros(2)), torch.ones(2))
        with pytest.raises(ValueError, match=r"uses self.logit_scale outside WithScale.forward"):
            module.logit_scale.exp()
        with pytest.raises(ValueError, match=r"uses self.model outside"):
            module.model(torch.zeros(4))
    assert isinstance(module.logit_scale, nn.Parameter)  # restored after the step


# ------------------------------------------------------------------ a step, once per micro-batch
def test_a_step_runs_once_paused_at_its_network_call() -> None:
    seen = []

    def step(network):
        seen.append("before")
        mask = torch.rand(3) < 0.5
        out = network(torch.ones(3), mask=mask)
        seen.append("after")
        return out * mask

    torch.manual_seed(0)
    continuation = Continuation(step, "twice")
    call = continuation.start()
    assert call.kind == "call" and seen == ["before"]
    drawn = call.kwargs["mask"]
    done = continuation.resume(torch.full((3,), 2.0))
    assert done.kind == "return" and seen == ["before", "after"]
    assert torch.equal(done.value, 2.0 * drawn)  # the loss sees what the step drew


def test_a_second_network_call_and_errors_reach_the_caller() -> None:
    def twice(network):
        return network(1) + network(2)

    continuation = Continuation(twice, "called more than once")
    assert continuation.start().kind == "call"
    event = continuation.resume(1)
    assert event.kind == "raise" and "called more than once" in str(event.value)


def test_an_abandoned_step_ends_at_its_network_call() -> None:
    after = []

    def step(network):
        try:
            network(1)
        except Exception:  # noqa: BLE001 - a user's broad except must not see the abandon
            after.append("caught")
        after.append("ran on")

    continuation = Continuation(step, "")
    continuation.start()
    continuation.abandon()
    assert continuation.done and after == []


def test_the_step_at_setup_leaves_the_modules_attributes_as_they_were() -> None:
    module = nn.Module()
    module.count, module.seen, module.total = 0, [1], torch.zeros(())
    with attributes_kept(module):
        module.count += 5
        module.seen.append(2)
        module.total += 3
        module.new = "x"
    assert (module.count, module.seen, float(module.total)) == (0, [1], 0.0)
    assert not hasattr(module, "new")


# ------------------------------------------------------------------ weighted losses
def test_a_mean_cross_entropy_carries_its_counted_targets() -> None:
    logits, targets = torch.randn(6, 5), torch.tensor([1, -100, 3, 4, -100, 0])
    weight = torch.rand(5)
    with WeightWatch() as watch:
        plain = F.cross_entropy(logits, targets)
        weighted = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)(logits, targets)
        summed = F.cross_entropy(logits, targets, reduction="sum")
        nothing = F.cross_entropy(logits, torch.full((6,), -100))
    torch.testing.assert_close(plain, F.cross_entropy(logits, targets))
    torch.testing.assert_close(
        weighted, F.cross_entropy(logits, targets, weight=weight, label_smoothing=0.1)
    )
    assert float(watch.weight_of(plain)) == 4.0
    torch.testing.assert_close(watch.weight_of(weighted), weight[[1, 3, 4, 0]].sum())
    assert watch.weight_of(summed) is None and watch.weight_of(plain * 1.0) is None
    assert float(nothing) == 0.0  # all targets ignored: 0, not NaN
    loss = torch.tensor(2.0, requires_grad=True)
    assert float(loss_weight({"loss": loss, "num_items": 7}, loss, watch)) == 7.0
    with pytest.raises(ValueError, match=r"num_items='x'"):
        loss_weight({"loss": loss, "num_items": "x"}, loss, watch)


# ------------------------------------------------------------------ hooks reading the model
def test_lightnings_grad_norm_in_a_hook_names_the_librarys_helper() -> None:
    module = WithScale()
    module(torch.ones(2, 4)).sum().backward()
    with (
        ShardReads(module, "on_before_optimizer_step"),
        pytest.raises(ValueError, match=r"lightning_zeropp.grad_norm\(self, norm_type\)"),
    ):
        lightning_grad_norm(module, norm_type=2)
    with ShardReads(module, "on_before_optimizer_step"):
        for p in module.parameters():  # element-wise work on a shard is the shard's
            p.grad.clamp_(-1, 1)
        with ShardReads.allowed():
            sum(p.grad.norm() for p in module.parameters())


# ------------------------------------------------------------------ merging micro-batches
def test_predictions_and_extra_keys_merge_along_rows() -> None:
    parts = [torch.zeros(2, 3), torch.ones(1, 3)]
    assert _merge(parts, averaged=False).shape == (3, 3)
    merged = _merge([{"a": torch.zeros(2)}, {"a": torch.ones(2)}], averaged=False)
    assert torch.equal(merged["a"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert _merge([1, 2], averaged=False) == [1, 2] and _merge([], averaged=False) is None
    assert float(_merge([torch.tensor(1.0), torch.tensor(3.0)], averaged=True)) == 2.0


def test_a_one_element_loss_becomes_a_scalar_that_is_not_a_view() -> None:
    loss = torch.ones(1, requires_grad=True) * 2
    scalar = _scalar(loss)
    assert scalar.dim() == 0 and not scalar._is_view()
    scalar.detach_()  # what the zero-bubble schedules do to the last stage's loss


def test_a_submodule_of_the_pipelined_child_is_not_reachable() -> None:
    stand_in = StandIn(lambda x: x, "model")
    with pytest.raises(AttributeError, match=r"self.model.encoder is not reachable.*module_name"):
        stand_in.encoder  # noqa: B018 - the attribute access is what is tested


def test_a_loss_the_library_cannot_weight_is_said_once(monkeypatch) -> None:
    """A step whose loss carries no weight (not a mean F.cross_entropy, no num_items): rank 0
    says once that micro-batch losses are averaged as returned, naming num_items."""
    from types import SimpleNamespace

    from lightning_zeropp.fronts.call_adapter import CallAdapter
    from lightning_zeropp.lightning import strategy

    said: list[str] = []
    monkeypatch.setattr(strategy, "rank_zero_info", said.append)
    fake = SimpleNamespace(
        _told=False,
        _runner=SimpleNamespace(weighted=False, adapter=CallAdapter()),
        layout=SimpleNamespace(num_microbatches=4),
        engine=SimpleNamespace(dims=SimpleNamespace(dp_size=2)),
    )
    fake._layout = lambda: fake.layout
    for _ in range(3):
        strategy.ZeroPPStrategy._tell_weighting(fake)
    assert len(said) == 1 and "{'loss': loss, 'num_items': n}" in said[0]
    weighted = SimpleNamespace(**{**vars(fake), "_told": False})
    weighted._runner = SimpleNamespace(weighted=True, adapter=CallAdapter())
    strategy.ZeroPPStrategy._tell_weighting(weighted)
    assert len(said) == 1


def test_an_empty_training_loader_names_drop_last_and_the_sizes() -> None:
    from torch.utils.data import DataLoader

    from lightning_zeropp.lightning.redirect import _empty_loader

    loader = DataLoader(list(range(6)), batch_size=8, drop_last=True)
    assert next(iter(loader), None) is None
    message = _empty_loader("train_dataloader", loader)
    assert "6 rows are fewer than one batch of 8 rows" in message
    assert "drop_last=True" in message and "or drop_last=False" in message
    assert "is empty (0 rows)" in _empty_loader("train_dataloader", DataLoader([], batch_size=8))
