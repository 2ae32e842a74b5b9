"""No host sync per micro-batch: values the user logs stay on the device until one read per step.

A torch-function mode counts the calls that read a tensor's value into Python (`float()`,
`.item()`, `.tolist()`, `int()`, `bool()`); on a GPU each is a stream sync.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode

from lightning_zeropp.lightning.logging import LogRecorder, _means

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
    values, _, _ = recorder._records["train_loss"]
    assert len(values) == 8 and all(torch.is_tensor(v) for v in values)


def test_a_steps_means_cross_to_the_host_in_one_read() -> None:
    records = [[torch.tensor(float(i)) for i in range(8)], [0.5, 1.5], [torch.tensor(3.0), 1.0]]
    with HostReads() as reads:
        means = _means(records, torch.device("cpu"))
    assert reads.count == 1
    assert means == [3.5, 1.0, 2.0]
