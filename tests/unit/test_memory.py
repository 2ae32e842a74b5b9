"""The memory report's figures on one process, against byte counts worked out by hand."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zeropp.core.measure.memory import (
    SavedActivations,
    format_report,
    host_peak_bytes,
    measure,
)


def test_measure_counts_parameters_gradients_and_optimizer_state() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5, bias=False))  # 220 + 100 floats
    opt = torch.optim.AdamW(model.parameters())
    before = measure(model, [opt], torch.device("cpu"))
    assert before.parameters == 320 * 4
    assert before.gradients == 320 * 4  # what they will take, before any backward
    assert before.optimizer == 0  # AdamW's state is created by its first step
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    after = measure(model, [opt], torch.device("cpu"), gathered_peak=7, activation_peak=9)
    # exp_avg and exp_avg_sq per parameter, plus one 0-dim fp32 step counter per parameter
    assert after.optimizer == 2 * 320 * 4 + 3 * 4
    assert after.gathered_peak == 7 and after.activation_peak == 9 and after.peak_kind == "host"
    assert host_peak_bytes() >= after.peak > 10 * 2**20
    text = format_report(after, "after the first update")
    assert "rank 0: parameters 0.0, gradients 0.0, optimizer state 0.0, gathered" in text


def test_saved_activations_count_what_backward_keeps_not_the_weights() -> None:
    """Linear saves its input (16 x 8 fp32: 512 bytes) and its weight (a parameter: not
    counted); ReLU saves its output (16 x 4: 256 bytes). Nested trackers both see them."""
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    with SavedActivations() as outer:
        with SavedActivations() as inner:
            out = model(torch.randn(16, 8))
            assert inner.live == outer.live == 768
        out.sum().backward()
        del out  # the graph and what it saved go with it
        assert outer.live == 0
    assert inner.peak == outer.peak == 768


def test_saved_activations_leave_no_graph_behind_when_a_backward_retains_it() -> None:
    # Split backward's input-gradient task runs with retain_graph and its weight task never runs
    # the input path's nodes (here: the attention and the activation). With the tensor itself
    # returned by the pack hook, a saved output held its own node and leaked for good.
    from lightning_zeropp.models import GPT, GPTConfig

    block = GPT(GPTConfig(vocab_size=16, seq_len=8, dim=16, num_heads=2, num_layers=1)).blocks[0]
    with SavedActivations() as saved:
        for _ in range(3):
            x = torch.randn(2, 8, 16, requires_grad=True)
            y = block(x)
            held = saved.live
            torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
            del x, y
            assert held > 0 and saved.live == 0
