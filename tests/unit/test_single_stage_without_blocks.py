"""One pipeline stage of a model without a block container (no ModuleList / Sequential of at
least 2 layers): the engine shards it at its root only and trains it as one process does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeropp import ZeroPPConfig

pytestmark = pytest.mark.usefixtures("group", "one_thread")


def test_a_model_without_blocks_trains_on_one_stage_as_one_process_does():
    from lightning_zeropp import launch_layout
    from lightning_zeropp.core.engine import ZeroPPEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))  # one layer: no block container
    reference = nn.Sequential(nn.Linear(4, 3))
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    loss_fn = lambda out, target: nn.functional.mse_loss(out, target)  # noqa: E731

    engine = ZeroPPEngine(model, launch_layout(ZeroPPConfig(num_microbatches=1)), loss_fn=loss_fn)
    loss = engine.train_step(x, target=y)
    expected = loss_fn(reference(x), y)
    expected.backward()

    torch.testing.assert_close(torch.as_tensor(loss).float(), expected.detach(), atol=1e-5, rtol=0)
    grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=0)
