"""No host sync per micro-batch: values the user logs stay on the device through the step.

A torch-function mode counts the calls that read a tensor's value into Python (`float()`,
`.item()`, `.tolist()`, `int()`, `bool()`); on a GPU each is a stream sync.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode

from lightning_zeropp.lightning.logging import LogRecorder, _combine, _Record

_READS = {"__float__", "item", "tolist", "__int__", "__bool__", "__index__"}


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        if getattr(func, "__name__", "") in _READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_logged_values_stay_tensors_through_the_micro_batches() -> None:
    recorder, module = LogRecorder(), pl.LightningModule()
    with recorder._patch(module), HostReads() as reads:
        for i in range(8):  # eight micro-batches of one step
            with recorder.microbatch():
                module.log("train_loss", torch.tensor(float(i)) * 2)
                module.log("lr", 0.5)
    assert reads.count == 0
    values = recorder._records["train_loss"].values
    assert len(values) == 8 and all(torch.is_tensor(v) for v in values)


def test_a_steps_means_sums_and_weighted_means_stay_on_the_device() -> None:
    cpu = torch.device("cpu")
    none = [lambda: None] * 2
    records = [
        _Record([torch.tensor(float(i)) for i in range(8)], [lambda: None] * 8),
        _Record([0.5, 1.5], none),
        _Record([torch.tensor(3.0), 1.0], none, kwargs={"reduce_fx": "sum"}),
        _Record([torch.tensor(3.0), 1.0], none, kwargs={"reduce_fx": torch.max}),
        _Record([2.0, 4.0], [lambda: torch.tensor(1.0), lambda: torch.tensor(3.0)]),
    ]
    with HostReads() as reads:
        combined = [_combine(r, cpu) for r in records]
    assert reads.count == 0
    assert [float(v) for v, _ in combined] == [3.5, 1.0, 4.0, 3.0, 14.0]
    assert [w if w is None else float(w) for _, w in combined] == [None] * 4 + [4.0]


def test_one_stage_replays_a_step_without_reading_its_values() -> None:
    """pp 1: the step's values go to `self.log` as device tensors; nothing crosses."""
    recorder, module = LogRecorder(), pl.LightningModule()
    engine = SimpleNamespace(
        device=torch.device("cpu"),
        config=SimpleNamespace(pp_size=1),
        dims=SimpleNamespace(dp_size=1, dp_groups=[]),
    )
    with recorder._patch(module):
        for i in range(4):
            with recorder.microbatch():
                module.log("loss", torch.tensor(float(i)))
    logged: dict[str, Any] = {}
    module.log = lambda name, value, *a, **k: logged.__setitem__(name, value)  # type: ignore
    with HostReads() as reads:
        replayed = recorder.replay(module, engine, skipped=False)
    assert reads.count == 0
    assert torch.is_tensor(logged["loss"]) and float(logged["loss"]) == 1.5
    assert replayed.skipped.tolist() == [0.0] and replayed.weight is None
