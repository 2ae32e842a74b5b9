"""LightningModules as users write them, trained through `ZeroPPStrategy` under 1F1B and ZeroPP
(pp 2 x dp_shard 2, 4 micro-batches per batch), against one process.

"One process" runs each data-parallel rank's share of a batch as Lightning's step defines it: the
step once per micro-batch, as gradient accumulation runs it (a random mask drawn per micro-batch
from the rank's generator, seeded alike on every rank as `seed_everything` seeds them), the loss
the mean over the global batch's items (masked tokens), the update one optimizer step. Logged
losses per step and every parameter after training within 1e-5 (fp32, no clipping); the token
counter, the summed log, the extra returned keys, `grad_norm` in `on_before_optimizer_step`, the
learning rate of each parameter group and the throughput's count of pipelines checked alongside.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.common import GLOBAL_BATCH, sampler_batches
from tests.distributed.launch import launch
from tests.distributed.step_scenarios import (
    CFG,
    STEP_SEED,
    Counting,
    EncoderHead,
    FlatGPT,
    masked,
)

pytestmark = pytest.mark.distributed

PP2 = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 4}
ZEROPP = {**PP2, "schedule": "zeropp", "num_chunks": 2, "unit_size": 2}
DP, MICRO, STEPS = 2, 4, 3
# One launch each: the suite's (a module per schedule) and the other three (`slow`: for time).
SUITE = {"flat": "zeropp", "encoder_head": "zeropp", "counting": "1f1b"}
LAYOUTS = {"1f1b": PP2, "zeropp": ZEROPP}
CASES = [
    {"id": f"{module}-{name}", "module": module, "layout": LAYOUTS[name]}
    for module in ("flat", "encoder_head", "counting")
    for name in ("1f1b", "zeropp")
]


# Run with the suite's launch; checked for the masks only (its head's draws make one process's
# random sequence another than the pipeline's, so no parity case).
DRAWING = {"id": "drawing-1f1b", "module": "drawing", "layout": PP2}
# The same, its mask drawn by the loader's collate_fn (a random augmentation in the loader).
COLLATING = {"id": "collating-1f1b", "module": "collating", "layout": PP2}


def _slow(case_id: str) -> bool:
    module, name = case_id.split("-")
    return SUITE[module] != name


@pytest.fixture(scope="module")
def launched(tmp_path_factory: Any) -> Any:
    """Each launch on first use: {slow?: per-rank results}."""
    cache: dict[bool, list[dict[str, Any]]] = {}

    def get(slow: bool) -> list[dict[str, Any]]:
        if slow not in cache:
            cases = [dict(c) for c in CASES if _slow(c["id"]) == slow]
            cases += [] if slow else [dict(DRAWING), dict(COLLATING)]
            params = {"cases": cases, "init_process_group": False}
            out = tmp_path_factory.mktemp("steps_slow" if slow else "steps")
            cache[slow] = launch(4, "step_scenarios.fit_cases", params, out, timeout=900)
        return cache[slow]

    return get


def _params(case_ids: list[str]) -> list[Any]:
    return [pytest.param(c, marks=[pytest.mark.slow] if _slow(c) else [], id=c) for c in case_ids]


def _one_process(module: str) -> dict[str, Any]:
    """Each global batch as the data-parallel ranks' micro-batch steps, summed over items."""
    lit = {"flat": FlatGPT, "encoder_head": EncoderHead, "counting": Counting}[module]()
    opt = lit.configure_optimizers()
    out: dict[str, list[float]] = {"losses": [], "norms": []}
    for i, (x, y) in enumerate(sampler_batches(STEPS)):
        torch.manual_seed(STEP_SEED + i)
        if module == "counting" and i == Counting.SKIP:
            out["losses"].append(float("nan"))  # skipped: nothing logged
            continue
        state = torch.get_rng_state()
        total, items = torch.zeros(()), 0
        for rank in range(DP):  # every rank's generator is alike at the step's start
            torch.set_rng_state(state)
            for xm, ym in zip(
                x[rank::DP].tensor_split(MICRO), y[rank::DP].tensor_split(MICRO), strict=True
            ):
                if module == "flat":
                    xm, ym = masked(xm, ym)
                logits = lit(xm) if module != "counting" else lit.model(xm)
                total = total + F.cross_entropy(logits.flatten(0, 1), ym.flatten(), reduction="sum")
                items += int((ym != -100).sum())
        loss = total / items
        loss.backward()
        out["losses"].append(float(loss))
        grads = [p.grad for p in lit.parameters() if p.grad is not None]
        out["norms"].append(float(torch.nn.utils.get_total_norm(grads)))
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in lit.named_parameters()}
    return out


@pytest.mark.parametrize("case_id", _params([c["id"] for c in CASES]))
def test_module_trains_as_one_process(launched: Any, case_id: str) -> None:
    case = next(c for c in CASES if c["id"] == case_id)
    results = launched(_slow(case_id))
    ref = _one_process(case["module"])
    for rank, r in enumerate(results):
        got = r[case["id"]]
        logged = [v for v, want in zip(got["logged"], ref["losses"], strict=True) if want == want]
        torch.testing.assert_close(
            torch.tensor(logged),
            torch.tensor([v for v in ref["losses"] if v == v]),
            rtol=0,
            atol=1e-5,
            msg=lambda m, r=rank: f"rank {r}: {m}",
        )
    params: dict[str, torch.Tensor] = {}
    for r in results:
        params |= r[case["id"]]["params"]
    assert set(ref["params"]) <= set(params)
    for name, want in ref["params"].items():
        torch.testing.assert_close(params[name], want, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("case_id", _params(["counting-1f1b", "counting-zeropp"]))
def test_the_steps_side_effects_happen_once_per_micro_batch(launched: Any, case_id: str) -> None:
    """Counting: 8 rows x 16 tokens per rank per trained batch (batch 1 skipped before the
    network), the sum over ranks logged; extra keys reach on_train_batch_end whole; the
    whole-model gradient norm; each parameter group's learning rate; throughput per pipeline."""
    results = launched(_slow(case_id))
    ref = _one_process("counting")
    per_rank = (GLOBAL_BATCH // DP) * CFG.seq_len
    for r in results:
        got = r[case_id]
        assert got["tokens"] == per_rank * (STEPS - 1)
        assert got["logged_tokens"][0] == per_rank * DP and got["logged_tokens"][2] == per_rank * DP
        assert (
            got["extras"] == [("loss", "predicted", str(GLOBAL_BATCH // DP), str(CFG.seq_len))] * 2
        )
        torch.testing.assert_close(
            torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6
        )
    metrics = results[0][case_id]["metrics"]
    lrs = [m for m in metrics if "lr-AdamW/pg1" in m]
    assert lrs and all(m["lr-AdamW/pg1"] == m["lr-AdamW/pg2"] == 1e-3 for m in lrs)
    rates = [m for m in metrics if "train/device/samples_per_sec" in m]
    assert rates and all(
        m["train/samples_per_sec"] == pytest.approx(DP * m["train/device/samples_per_sec"])
        for m in rates
    )


def test_a_random_mask_drawn_before_the_network_is_the_same_on_every_stage(launched: Any) -> None:
    """Seeded once, with a head that draws on the last stage only: every micro-batch's mask is
    the same on the first stage (which masks the inputs) and on the last (whose loss reads the
    masked targets), at every step; without the strategy's random-state sync they part at the
    second step."""
    results = launched(False)
    masks = [r[DRAWING["id"]]["masks"] for r in results]
    # pp-major: ranks 0 and 1 hold stage 0 (data-parallel ranks 0 and 1), ranks 2 and 3 stage 1
    for first, last in ((0, 2), (1, 3)):
        assert len(masks[first]) == len(masks[last]) == STEPS * MICRO
        for k, (a, b) in enumerate(zip(masks[first], masks[last], strict=True)):
            assert torch.equal(a, b), f"micro-batch {k}: the stages drew other masks"


def test_a_random_collate_fn_gives_every_stage_the_first_stages_batch(launched: Any) -> None:
    """The loader's collate_fn masks at random on every rank (its generator parts from the other
    stages' as the last stage's head draws): every micro-batch's masked inputs and targets are
    the same on the first stage (which feeds the inputs) and the last (whose loss reads the
    targets), at every step; without the batch shared over the pipeline they part from the second
    batch on (micro-batches 4 to 11 of 12)."""
    results = launched(False)
    masks = [r[COLLATING["id"]]["masks"] for r in results]
    for first, last in ((0, 2), (1, 3)):
        assert len(masks[first]) == len(masks[last]) == STEPS * MICRO
        apart = [k for k, (a, b) in enumerate(zip(masks[first], masks[last], strict=True))
                 if not torch.equal(a, b)]  # fmt: skip
        assert not apart, f"micro-batches {apart} of {STEPS * MICRO}: the stages read others"
