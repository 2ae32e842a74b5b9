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
    apply_activation_offload(offloaded, torch.device("cpu"), stats)
    expected = _grads(plain, x, retain)
    got = _grads(offloaded, x, retain)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert stats.moved > 0 and stats.peak > 0
    assert stats.live == 0, "the host copies are freed with the graph"
    # the weights stay (parameters); what moved is not counted as the device's
    # (the loss's square, outside the module, saves the module's output: 8 x 4 floats)
    assert offloaded.saved_peak == 8 * 4 * 4 < plain.saved_peak  # type: ignore[operator]
    # every activation byte went to the host (a tensor saved by two nodes, twice: as save_on_cpu)
    assert stats.peak >= plain.saved_peak
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


def test_an_expanded_tensor_saved_for_backward_is_kept_where_it_is():
    """An expanded (stride 0) tensor saved for backward, as SDPA's memory-efficient kernel saves
    its broadcast mask on CUDA, cannot be copied into a host tensor of its strides (found in
    review; the CPU kernels save none): it stays on the device, and gradients are unchanged."""

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(1, x.shape[1]).expand_as(x)  # saved by mul, stride 0 in dim 0
            return (x * mask).sum()

    x = torch.randn(4, 3, requires_grad=True)
    module, stats = Scale(), OffloadStats()
    apply_activation_offload(module, torch.device("cpu"), stats)
    module(x).backward()
    assert torch.equal(x.grad, torch.ones(4, 3))
    assert stats.tensors == 0  # x itself is a leaf the caller holds; the mask was kept
