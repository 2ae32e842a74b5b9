"""What the head and the loss hold while they run (`plan.loss_memory`): the tracker against the
process's own peak memory (an independent oracle: the kernel's high-water mark of resident pages,
reset before the run), the meta
device's count against a real run's, and the planner's activation peak with and without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.models import GPT, GPTConfig
from lightning_zeropp.plan import activations
from lightning_zeropp.plan.activations import activation_peaks
from lightning_zeropp.plan.loss_memory import (
    LiveBytes,
    _forward,
    _run,
    held_weight_gradient,
    last_stage_transients,
    loss_transients,
)

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20

# A process that allocates the inputs, then runs the loss forward and backward on real CPU
# tensors: the rise of its peak resident memory (ru_maxrss), and what LiveBytes counted.
_PROBE = """
import json, sys, torch
from lightning_zeropp.plan.loss_memory import LiveBytes, _run
torch.set_num_threads(1)
tokens, dim, vocab, chunk = map(int, sys.argv[1:5])
torch.manual_seed(0)
hidden = torch.randn(tokens, dim, requires_grad=True)
weight = (torch.randn(vocab, dim) * 0.05).requires_grad_()
target = torch.randint(0, vocab, (tokens,))
_run(hidden[:8], weight[:64], target[:8] % 64, 4)  # first calls allocate what they keep
hidden.grad = weight.grad = None

def status(field):  # kB
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # the peak resident size restarts from now
before = status("VmRSS")
with LiveBytes() as track:
    _run(hidden, weight, target, chunk)
print(json.dumps({"rss": status("VmHWM") - before, "tracked": track.peak()}))
"""


def _probe(tokens: int, dim: int, vocab: int, chunk: int) -> dict[str, int]:
    # Every allocation over 64 KiB its own mapping, returned when freed: glibc otherwise serves
    # blocks under 32 MiB from its heap after the first is freed, and keeps them resident.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *map(str, (tokens, dim, vocab, chunk))],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("chunk", [0, 256], ids=["whole", "chunked"])
def test_the_tracked_peak_is_the_process_peak(chunk: int) -> None:
    # 2048 tokens x 32000: 250 MiB of fp32 logits, far above the allocator's and Python's noise
    got = _probe(2048, 64, 32000, chunk)
    assert got["tracked"] > 60 * MIB
    assert got["tracked"] == pytest.approx(got["rss"], rel=0.05, abs=8 * MIB), got


@pytest.mark.parametrize("chunk", [0, 256], ids=["whole", "chunked"])
@pytest.mark.parametrize(
    ("dtype", "trained"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "bf16", "bf16-frozen-head"],
)
def test_the_meta_count_is_a_real_runs(chunk: int, dtype: torch.dtype, trained: bool) -> None:
    def tracked(device: str) -> int:
        hidden = torch.zeros(2048, 64, device=device, dtype=dtype, requires_grad=True)
        weight = torch.zeros(4000, 64, device=device, dtype=dtype, requires_grad=trained)
        with LiveBytes() as track:
            _run(hidden, weight, torch.zeros(2048, dtype=torch.long, device=device), chunk)
        return track.peak()

    assert tracked("meta") == pytest.approx(tracked("cpu"), rel=0.02)


def test_a_frozen_head_is_priced_as_the_runtime_cuts_it() -> None:
    """A frozen bf16 head (LoRA) is cut by tokens at run time, a trained one by vocabulary."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32000, seq_len=2048, dim=64, num_heads=2, num_layers=2))
    trained = loss_transients(model, 2048, torch.bfloat16, 256)
    model.head.requires_grad_(False)
    frozen = loss_transients(model, 2048, torch.bfloat16, 256)
    assert frozen != trained
    # a real run's count, cut as the runtime cuts it
    hidden = torch.zeros(2048, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.zeros(32000, 64, dtype=torch.bfloat16)
    with LiveBytes() as track:
        loss = _forward(hidden, weight, torch.zeros(2048, dtype=torch.long), 256)
        saved, mark = track.live, len(track.events)
        loss.backward()
    assert frozen[1] == pytest.approx(track.peak(mark, track.surviving()) - saved, rel=0.02)


def test_split_backward_holds_the_heads_weight_gradient_from_i_to_w(monkeypatch) -> None:
    """The chunked loss keeps each micro-batch's head weight gradient for its weight pass."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32000, seq_len=2048, dim=64, num_heads=2, num_layers=4))
    config = ZeroPPConfig(pp_size=2, num_microbatches=4, schedule="zeropp", loss_chunk=256)
    held = held_weight_gradient(model, config.resolve(2), 1, 2048)
    assert held == 32000 * 64 * 4  # fp32: the weight's size
    whole = ZeroPPConfig(pp_size=2, num_microbatches=4, schedule="zeropp", loss_chunk=0)
    assert held_weight_gradient(model, whole.resolve(2), 1, 2048) == 0
    with_it = activation_peaks(model, config, 2, 4, 2048)
    monkeypatch.setattr(activations, "held_weight_gradient", lambda *a: 0)
    without = activation_peaks(model, config, 2, 4, 2048)
    grew = [with_it[r] - without[r] for r in with_it]
    assert max(grew) >= held and all(g % held == 0 for g in grew), grew


def test_chunks_hold_far_less_and_the_planner_adds_it_on_the_last_stage() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32000, seq_len=2048, dim=64, num_heads=2, num_layers=4))
    layout = {"pp_size": 2, "num_microbatches": 2, "schedule": "1f1b"}
    whole, chunked = ZeroPPConfig(**layout, loss_chunk=0), ZeroPPConfig(**layout, loss_chunk=256)
    loss_whole = last_stage_transients(model, whole.resolve(2), 1, 2048)
    loss_chunked = last_stage_transients(model, chunked.resolve(2), 1, 2048)
    logits = 2048 * 32000 * 4
    assert max(loss_whole) >= logits  # the logits' fp32 gradient, at least
    assert max(loss_chunked) < max(loss_whole) / 4
    for config, loss in ((whole, loss_whole), (chunked, loss_chunked)):
        with_it = activation_peaks(model, config, 2, 2, 2048)
        without = activation_peaks(model, config, 2, 2, 2048, transients=False)
        assert with_it[0] == without[0]  # the first stage runs no loss
        assert with_it[1] - without[1] == max(loss), config
