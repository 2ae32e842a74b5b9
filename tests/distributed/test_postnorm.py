"""A post-norm transformer under ZeroPP's split backward equals one process (fp32, 1e-5): the
held-back weight-gradient tasks of released chunks start at the blocks' outputs, where FSDP's
pre-backward hook sits (it must not gather the released weights again)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import launch
from tests.distributed.postnorm_scenarios import PostNorm, batches, loss_fn

pytestmark = pytest.mark.distributed

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "schedule": "zeropp", "num_microbatches": 8,
          "unit_size": 2}  # fmt: skip


def test_post_norm_blocks_under_zeropp_match_one_process(tmp_path) -> None:
    ranks = launch(4, "postnorm_scenarios.train", {"layout": LAYOUT}, tmp_path, timeout=300)
    torch.manual_seed(0)
    model = PostNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches(2):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    want = dict(model.named_parameters())
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, abs=1e-5)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, want[name].detach(), atol=1e-5, rtol=0)
