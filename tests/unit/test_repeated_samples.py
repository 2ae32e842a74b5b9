"""The samples Accelerate repeats to complete a short last evaluation batch, kept out of a loss
computed over the global batch: which of a data-parallel rank's samples are real
(`counts.real_samples`), rows and packed documents masked (`counts.without_repeated_rows`), and
TRL's pairwise losses (`reward_loss`, `dpo_loss`) equal to the same loss over the real pairs only.
The distributed cases (`test_last_loss`, `test_trl*` at dp 2) compare whole runs with one
process; these check the pieces on one rank, in CI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_zeropp.transformers.counts import real_samples, without_repeated_rows


def _pipeline(dp_rank: int) -> SimpleNamespace:
    return SimpleNamespace(engine=SimpleNamespace(dims=SimpleNamespace(dp_rank=dp_rank)))


def _state(last: bool, remainder: int) -> SimpleNamespace:
    return SimpleNamespace(end_of_dataloader=last, remainder=remainder)


@pytest.mark.parametrize(
    ("dp_rank", "last", "remainder", "want"),
    [
        (0, False, 7, 4),  # not the last batch: every sample
        (1, True, 0, 4),  # a last batch that divides: every sample
        (0, True, 7, 4),  # 7 samples, 4 a rank: rank 0 holds 0..3
        (1, True, 7, 3),  # rank 1 holds 4..6 and one repeat
        (1, True, 3, 0),  # rank 1 holds repeats only
        (2, True, 9, 1),
    ],
)
def test_real_samples(dp_rank, last, remainder, want):
    assert real_samples(_state(last, remainder), _pipeline(dp_rank), 4) == want


def test_repeated_rows_are_masked():
    labels = torch.arange(12).view(4, 3)
    inputs = {"input_ids": labels.clone(), "labels": labels}
    out = without_repeated_rows(inputs, _state(True, 6), _pipeline(1))
    assert torch.equal(out["labels"][:2], labels[:2])
    assert bool((out["labels"][2:] == -100).all())
    assert torch.equal(inputs["labels"], torch.arange(12).view(4, 3))  # the batch given: kept
    same = without_repeated_rows(inputs, _state(False, 6), _pipeline(1))
    assert same is inputs


def test_repeated_packed_documents_are_masked():
    # one row of three documents (lengths 3, 2, 3): rank 1 of 3-document ranks, 4 real
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    labels = torch.arange(8).view(1, 8)
    inputs = {"input_ids": labels.clone(), "position_ids": positions, "labels": labels}
    out = without_repeated_rows(inputs, _state(True, 4), _pipeline(1))
    assert out["labels"].tolist() == [[0, 1, 2, -100, -100, -100, -100, -100]]


def _rewards(values: list[float]) -> dict[str, torch.Tensor]:
    return {"logits": torch.tensor(values).unsqueeze(-1)}


def test_the_reward_loss_counts_only_the_real_pairs():
    pytest.importorskip("trl")
    from lightning_zeropp.trl.reward import reward_loss

    # 3 pairs in pair order (chosen rows, then rejected), the third a repeat
    output = _rewards([0.5, -0.2, -9.0, 0.1, 0.3, 9.0])
    labels = torch.tensor([1, 1, -100, 1, 1, -100])
    margin = torch.tensor([0.2, -0.1, 5.0])
    loss, metrics = reward_loss(output, labels, 4.0, center=0.1, margin=margin)
    real_loss, real = reward_loss(
        _rewards([0.5, -0.2, 0.1, 0.3]), torch.ones(4, dtype=torch.long), 4.0, 0.1, margin[:2]
    )
    torch.testing.assert_close(loss, real_loss)
    for name, value in real.items():
        torch.testing.assert_close(metrics[name], value, msg=name)
    assert float(metrics["max_reward"]) == pytest.approx(0.5)  # not the repeat's 9.0


def test_the_dpo_loss_counts_only_the_real_pairs():
    pytest.importorskip("trl")
    from lightning_zeropp.trl.dpo import dpo_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 7, generator=g)  # rows c0 r0 c1 r1 c2 r2, the third pair repeated
    labels = torch.randint(0, 7, (6, 5), generator=g)
    completion = torch.tensor([[0, 0, 1, 1, 1]] * 6)
    ref = torch.randn(6, generator=g)
    counted = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    loss, metrics = dpo_loss(
        {"logits": logits}, labels, 2.0, completion, ref, beta=0.1, counted=counted
    )
    want, real = dpo_loss({"logits": logits[:4]}, labels[:4], 2.0, completion[:4], ref[:4], 0.1)
    torch.testing.assert_close(loss, want)
    for name, value in real.items():
        torch.testing.assert_close(metrics[name], value, msg=name)
