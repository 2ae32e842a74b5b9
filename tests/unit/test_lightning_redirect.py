"""The stand-in for the pipelined network inside a user's step: what it cannot honour is an error."""

import pytest
import torch

from lightning_zeropp.lightning.redirect import StandIn
from lightning_zeropp.lightning.steps import _merge, _scalar


def test_a_second_call_in_one_step_is_refused():
    stand_in = StandIn(lambda x: x * 2, "model")
    assert torch.equal(stand_in(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(ValueError, match=r"called self.model more than once"):
        stand_in(torch.ones(2))


def test_a_submodule_of_the_network_is_not_reachable():
    stand_in = StandIn(lambda x: x, "model")
    with pytest.raises(AttributeError, match=r"self.model.encoder is not reachable.*module_name"):
        stand_in.encoder  # noqa: B018 - the attribute access is what is tested


def test_predictions_merge_along_rows():
    parts = [torch.zeros(2, 3), torch.ones(1, 3)]
    assert _merge(parts).shape == (3, 3)
    merged = _merge([{"a": torch.zeros(2)}, {"a": torch.ones(2)}])
    assert torch.equal(merged["a"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert _merge([1, 2]) == [1, 2] and _merge([]) is None


def test_a_one_element_loss_becomes_a_scalar_that_is_not_a_view():
    loss = torch.ones(1, requires_grad=True) * 2
    scalar = _scalar(loss)
    assert scalar.dim() == 0 and not scalar._is_view()
    scalar.detach_()  # what the zero-bubble schedules do to the last stage's loss
