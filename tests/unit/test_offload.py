"""Activation offload in one process: the settings, the hooks' numbers and accounting, and the
engine's run with offload bit-identical to the run without (`core.shard.offload`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeropp import launch_layout
from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.core.measure.memory import SavedActivations
from lightning_zeropp.core.settings.env import config_from_env
from lightning_zeropp.core.settings.ranks import in_flight
from lightning_zeropp.core.shard.offload import OffloadStats, apply_activation_offload
from tests.distributed.common import MODEL, lm_loss, make_batches, make_model
from tests.distributed.core_scenarios import _full

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_settings_resolve_and_refuse_by_name():
    assert ZeroPPConfig(offload_activations=True).resolve(1).offload_activations == "on"
    assert ZeroPPConfig(offload_activations="AUTO").resolve(1).offload_activations == "auto"
    assert ZeroPPConfig().resolve(1).offload_activations == "off"
    with pytest.raises(ValueError, match=r"offload_activations='sometimes' is unknown"):
        ZeroPPConfig(offload_activations="sometimes").resolve(1)
    with pytest.raises(ValueError, match=r"outside 0\.\.1 \(pp_size=2\)"):
        ZeroPPConfig(pp_size=2, activation_checkpointing=True, recompute_ranks=[2]).resolve(2)
    with pytest.raises(ValueError, match="set activation_checkpointing=True"):
        ZeroPPConfig(pp_size=2, recompute_ranks=[0]).resolve(2)
    with pytest.raises(ValueError, match="distinct pipeline ranks"):
        ZeroPPConfig(pp_size=2, activation_checkpointing=True, recompute_ranks=[0, 0]).resolve(2)
    env = {"ZEROPP_OFFLOAD_ACTIVATIONS": "auto", "ZEROPP_RECOMPUTE_RANKS": "0,1"}
    config = config_from_env(env)
    assert (config.offload_activations, config.recompute_ranks) == ("auto", [0, 1])
    assert config_from_env({"ZEROPP_OFFLOAD_ACTIVATIONS": "0,2"}).offload_activations == [0, 2]
    assert config_from_env({"ZEROPP_OFFLOAD_ACTIVATIONS": "1"}).offload_activations is True
    layout = ZeroPPConfig(pp_size=4, offload_activations=[2, 0]).resolve(4)
    assert layout.offload_ranks() == [0, 2] and layout.offloads(2) and not layout.offloads(1)
    with pytest.raises(ValueError, match=r"offload_activations=\[4\] names pipeline ranks"):
        ZeroPPConfig(pp_size=4, offload_activations=[4]).resolve(4)


def test_in_flight_falls_down_the_pipeline_under_1f1b_only():
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("interleaved_1f1b", 4, 2, 8, r) for r in range(4)] == [11, 9, 7, 5]
    assert {in_flight("gpipe", 4, 1, 8, r) for r in range(4)} == {8}
    layout = ZeroPPConfig(pp_size=4, schedule="interleaved_1f1b", offload_activations="auto")
    assert layout.resolve(4).offload_ranks() == [0, 1]
    assert (
        ZeroPPConfig(pp_size=4, schedule="gpipe", offload_activations="auto")
        .resolve(4)
        .offload_ranks()
        == []
    )
    assert ZeroPPConfig(pp_size=4, offload_activations="on").resolve(4).offload_ranks() == [
        0,
        1,
        2,
        3,
    ]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _grads(model: nn.Module, x: torch.Tensor, retain: bool = False) -> list[torch.Tensor]:
    model.zero_grad()
    with SavedActivations() as saved:
        loss = model(x).square().sum()
    if retain:  # split backward: the graph is unpacked twice
        torch.autograd.backward(loss, retain_graph=True)
    loss.backward()
    model.saved_peak = saved.peak  # type: ignore[assignment]
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("retain", [False, True])
def test_the_hooks_give_the_same_bits_and_count_what_moved(retain):
    x = torch.randn(8, 16)
    plain, offloaded = _mlp(), _mlp()
    stats = OffloadStats()
    # a split backward (retain: read twice) copies back as it reads, as the engine sets it
    apply_activation_offload(offloaded, torch.device("cpu"), stats, prefetch=not retain)
    expected = _grads(plain, x, retain)
    got = _grads(offloaded, x, retain)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert stats.moved > 0 and stats.peak > 0
    assert stats.live == 0, "the host copies are freed with the graph"
    # the weights stay (parameters); what moved is not counted as the device's
    # (the loss's square, outside the module, saves the module's output: 8 x 4 floats)
    assert offloaded.saved_peak == 8 * 4 * 4 < plain.saved_peak  # type: ignore[operator]
    # every activation byte went to the host, each storage once: the host holds what the device
    # held without offload (the plain run's peak is the output kept outside plus what moved)
    assert stats.peak + offloaded.saved_peak == plain.saved_peak  # type: ignore[operator]
    # the copies back: all started as the backward started, or (split) each pass as it read
    if retain:
        # (a storage read by two nodes, tanh's output, comes back for each: nothing holds it)
        assert stats.fetched_ahead == 0 and stats.fetched_late >= 2 * stats.moved
    else:
        assert stats.fetched_ahead == stats.moved and stats.fetched_late == 0
    before = stats.tensors
    with torch.no_grad():  # nothing is saved: nothing moves
        offloaded(x)
    assert stats.tensors == before


def _engine_run(
    offload: bool | str, compile: bool = False
) -> tuple[list[float], dict[str, torch.Tensor], ZeroPPEngine]:
    config = ZeroPPConfig(num_microbatches=2, offload_activations=offload, compile=compile)
    config = config.resolve(1)
    example = (torch.zeros(4, MODEL.seq_len, dtype=torch.long),)
    engine = ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example
    )
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for x, y in make_batches(2, global_batch=8):
        losses.append(engine.train_step(x, target=y).item())
        opt.step()
        opt.zero_grad()
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    return losses, params, engine


@pytest.mark.usefixtures("group")
def test_one_process_with_offload_is_bit_identical():
    losses_off, params_off, off = _engine_run(False)
    losses_on, params_on, on = _engine_run(True)
    assert losses_on == losses_off
    assert all(torch.equal(params_on[n], params_off[n]) for n in params_off)
    assert on.offload is not None and on.offload.moved > 0 and on.offload.live == 0
    assert off.offload is None and off.host_activation_peak is None
    assert on.activation_peak is not None and off.activation_peak is not None
    assert on.activation_peak < off.activation_peak / 2
    assert "offloaded to host" in on.memory_report()


@pytest.mark.slow
@pytest.mark.usefixtures("group")
def test_compiled_blocks_with_offload_are_bit_identical():
    # A compiled backward checks its saved tensors' strides: the host copies keep them (a plain
    # clone of attention's q, a view of the fused qkv, came back contiguous and failed there).
    losses_off, params_off, _ = _engine_run(False, compile=True)
    losses_on, params_on, on = _engine_run(True, compile=True)
    assert losses_on == losses_off
    assert all(torch.equal(params_on[n], params_off[n]) for n in params_off)
    assert on.offload is not None and on.offload.moved > 0


def test_an_expanded_tensor_saved_for_backward_comes_back_as_the_same_view():
    """An expanded (stride 0) tensor saved for backward, as SDPA's memory-efficient kernel saves
    its broadcast mask on CUDA (found in review; the CPU kernels save none): its storage (one
    row) is copied and it comes back with its strides, gradients unchanged."""

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(1, x.shape[1]).expand_as(x)  # saved by mul, stride 0 in dim 0
            return (x * mask).sum()

    x = torch.randn(4, 3, requires_grad=True)
    module, stats = Scale(), OffloadStats()
    apply_activation_offload(module, torch.device("cpu"), stats)
    module(x).backward()
    assert torch.equal(x.grad, torch.ones(4, 3))
    assert (stats.tensors, stats.storages, stats.moved) == (1, 1, 3 * 4)


class _ThreeReads(nn.Module):
    """One input read by three projections (q, k, v), then their views of one fused output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.exp()  # x's own storage, saved by exp (its result) and read by q, k and v
        mixed = self.q(x) * self.k(x) + self.v(x)
        q, k, v = self.qkv(mixed).sigmoid().split(8, dim=-1)  # views of sigmoid's output
        return (q * k * v).sum()


def _three_reads_run(offload: bool) -> tuple[list[torch.Tensor], OffloadStats]:
    module, stats = _ThreeReads(), OffloadStats()
    if offload:
        apply_activation_offload(module, torch.device("cpu"), stats)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    module(x).backward()
    return [p.grad for p in module.parameters()], stats  # type: ignore[misc]


def test_a_storage_saved_three_times_is_copied_once():
    expected, _ = _three_reads_run(False)
    got, stats = _three_reads_run(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    row = 4 * 8 * 4  # bytes of one (4, 8) float tensor
    # storages: exp's output (saved by exp, q, k, v), q(x), k(x), the sigmoid's (4, 24) output
    # (saved by sigmoid and, as q, k and v views, by the products), q * k, and the products
    assert stats.storages < stats.tensors
    with SavedActivations() as saved:  # what the device holds without offload, per storage
        _ThreeReads()(torch.randn(4, 8))
    assert stats.moved == stats.peak == saved.peak, (stats, saved.peak)
    assert stats.live == 0
    assert stats.moved >= 3 * row


class _Twice(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        a = y.sin()  # saves y at version 0
        y = y.add_(1) if self.in_place else y + 1  # in place: the same storage at version 1
        return (a * y.cos()).sum()  # cos saves y again: other bytes


def test_a_storage_written_in_place_after_its_copy_is_copied_again():
    # Autograd refuses this graph without hooks (sin's y was written); under saved-tensor hooks
    # it does not check (as under save_on_cpu), so the copies must hold each version's bytes:
    # the gradients are those of the same graph written out of place.
    x = torch.randn(5, requires_grad=True)
    _Twice(in_place=False)(x).backward()
    expected, x.grad = x.grad.clone(), None
    module, stats = _Twice(in_place=True), OffloadStats()
    apply_activation_offload(module, torch.device("cpu"), stats)
    module(x).backward()
    assert torch.equal(x.grad, expected)
    assert stats.storages == stats.tensors == 4  # y at versions 0 and 1, a, cos(y)
    assert stats.fetched_late == 0 and stats.fetched_ahead == stats.moved


def test_the_copies_back_start_as_the_backward_starts_last_saved_first():
    order: list[str] = []
    module, stats = _mlp(), OffloadStats()
    apply_activation_offload(module, torch.device("cpu"), stats)
    from lightning_zeropp.core.shard import offload as offload_module

    hooks = None
    for cell in module.forward.__closure__ or ():  # type: ignore[attr-defined]
        if isinstance(cell.cell_contents, offload_module._HostCopies):
            hooks = cell.cell_contents
    assert hooks is not None
    run = hooks.to_device.run

    def traced(copy, reads, after):  # type: ignore[no-untyped-def]
        out, event = run(copy, reads, after)
        order.append(f"fetch {out.numel()}")
        return out, event

    unpack = hooks.unpack
    hooks.to_device.run = traced  # type: ignore[method-assign]
    hooks.unpack = lambda packed: (order.append("read"), unpack(packed))[1]  # type: ignore[method-assign]
    out = module(torch.randn(8, 16))
    assert not order and stats.fetched_ahead == 0  # nothing comes back before the backward
    out.square().sum().backward()
    fetches = [o for o in order if o.startswith("fetch")]
    assert order[: len(fetches)] == fetches and "read" in order, order  # all started first
    # last saved first: the last Linear's input (8 x 64 floats) before the first one's (8 x 16)
    assert fetches[0] == f"fetch {8 * 64 * 4}" and fetches[-1] == f"fetch {8 * 16 * 4}", fetches
    assert stats.fetched_ahead == stats.moved and stats.fetched_late == 0


def test_every_copy_of_a_forward_is_prefetched_when_storages_die_within_it():
    """A saved tensor's device storage may be freed within the forward (the host copy is what
    autograd keeps) and its Python id reused by the next one: each copy is still prefetched."""

    class Chain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(50):
                x = (x * 1.01).tanh()  # each intermediate saved (tanh), then dropped here
            return x.sum()

    x = torch.randn(64, requires_grad=True)
    Chain()(x).backward()
    expected, x.grad = x.grad.clone(), None
    module, stats = Chain(), OffloadStats()
    apply_activation_offload(module, torch.device("cpu"), stats)
    module(x).backward()
    assert torch.equal(x.grad, expected)
    assert stats.storages == 50 and stats.fetched_late == 0, stats
