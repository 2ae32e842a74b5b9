"""Parameters read outside the step, and blocks checkpointed at the call site, against one process.

Two LightningModules as users write them (`param_read_scenarios`; no `example_input_array`) train
3 steps on 4 gloo ranks (pp 2 x dp_shard 2). A parameter read in `on_train_batch_end` or after
`trainer.fit` is the value one process has, or raises naming `lightning_zeropp.full_parameter`:
never a stale copy (rank 0 used to read `logit_scale` as 0.0 at every step). `full_parameter`
and `param_norm` give every rank the trained values. `checkpoint(block, h, use_reentrant=False)`
in the model's loop trains as one process does; `use_reentrant=True` is refused naming
`activation_checkpointing=True`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.common import make_model, sampler_batches
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed

LAYOUT = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
STEPS = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("params")
    params = {"layout": LAYOUT, "init_process_group": False}
    return launch(4, "param_read_scenarios.cases", params, out, timeout=600)


def _train(model, forward):
    """One process, SGD on the global batches: per step, the loss and the parameters after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, after = [], []
    for x, y in sampler_batches(STEPS):
        loss = F.cross_entropy(forward(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, after


@functools.cache
def _scaled():
    from tests.distributed.param_read_scenarios import Scaled

    return _train(Scaled(), lambda m, x: m(x))


def _close(got, want, what):
    torch.testing.assert_close(
        torch.tensor(got),
        torch.tensor(float(torch.as_tensor(want).detach())),
        atol=1e-5,
        rtol=0,
        msg=what,
    )


def _value_or_named(read, want, helper_arg, what):
    """A read outside the step: the one-process value, or an error naming the helper."""
    value, error = read
    if value is None:
        assert "held by another pipeline stage" in error, (what, error)
        assert f"lightning_zeropp.full_parameter(self, {helper_arg!r})" in error, (what, error)
    else:
        _close(value, want, what)


def test_scalar_parameter_read_in_a_hook_and_after_fit(results):
    _, after = _scaled()
    held = 0
    for rank, r in enumerate(results):
        got = r["reads"]["scaled"]
        for step, seen in enumerate(got["seen"]):
            want = after[step]
            _close(seen["full"], want["logit_scale"], (rank, step, "full_parameter"))
            _close(seen["norm"], want["head.weight"].norm(), (rank, step, "param_norm"))
            _value_or_named(seen["direct"], want["logit_scale"], "logit_scale", (rank, step))
            _value_or_named(
                seen["head_norm"], want["head.weight"].norm(), "head.<name>", (rank, step)
            )
        _close(got["full"], after[-1]["logit_scale"], (rank, "after fit"))
        _value_or_named(got["direct"], after[-1]["logit_scale"], "logit_scale", (rank, "after"))
        held += got["direct"][0] is not None
        # the state_dict holds it where the value is real, nowhere else
        assert got["state_dict_has_scale"] == (got["direct"][0] is not None), rank
    assert held == 2  # the last stage's two ranks read it; the first stage's are told


def test_wrapped_network_weight_norms_and_full_parameter(results):
    torch.manual_seed(0)
    _, after = _train(make_model(0), lambda m, x: m(x))
    for rank, r in enumerate(results):
        got = r["reads"]["wrapped"]
        for step, seen in enumerate(got["seen"]):
            want = after[step]
            total = torch.stack([p.norm() for p in want.values()]).norm()
            _close(seen["norm"], want["head.weight"].norm(), (rank, step, "param_norm"))
            _close(seen["total"], total, (rank, step, "param_norm total"))
            head, emb = want["head.weight"].norm(), want["tok_emb.weight"].norm()
            _value_or_named(seen["head_norm"], head, "model.head.<name>", (rank, step))
            _value_or_named(seen["emb_norm"], emb, "model.tok_emb.<name>", (rank, step))
            # each rank holds one of the two: one read served, the other refused
            assert (seen["head_norm"][0] is None) != (seen["emb_norm"][0] is None), (rank, step)
        torch.testing.assert_close(got["head"], after[-1]["head.weight"], atol=1e-5, rtol=0)
        assert "did you mean 'model.head.weight'" in got["unknown"], got["unknown"]


def test_call_site_checkpoint_trains_as_one_process(results):
    losses, after = _scaled()
    rank0 = results[0]["checkpoint"]
    torch.testing.assert_close(
        torch.tensor(rank0["losses"]), torch.tensor(losses), atol=1e-5, rtol=0
    )
    state = rank0["state"]
    assert set(state) == set(after[-1]), sorted(state)
    for name, want in after[-1].items():
        torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=name)


def test_reentrant_call_site_checkpoint_is_refused_on_every_rank(results):
    for rank, r in enumerate(results):
        message = r["checkpoint"]["reentrant"]
        assert message is not None and "activation_checkpointing=True" in message, (rank, message)
        assert "use_reentrant=True" in message, (rank, message)
