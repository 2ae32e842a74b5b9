"""Scenarios for a loss computed on the last stage: `trainer_script.run` with the Trainer's
`compute_loss_func` or `label_smoothing_factor` under `ZeroPPTrainer` and the plain Trainer, and
an Accelerate loop with its own loss (`PipelineModel.use_loss`), each against one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Trainer

from lightning_zeropp.core.step.failure import PeerFailedError
from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer
from tests.distributed.trainer_scenarios import _saved
from tests.distributed.trainer_script import Script
from tests.distributed.trainer_script import run as run_script


def z_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A `compute_loss_func` as the Trainer's docs write one: next-token cross-entropy plus a
    z-loss term (log-partition squared), summed over the labelled tokens and divided by the
    Trainer's count."""
    logits = outputs["logits"][:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    ce = F.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), reduction="none")
    z = torch.logsumexp(logits, dim=-1) ** 2
    total = ((ce + 1e-2 * z) * keep).sum()
    return total / (num_items_in_batch if num_items_in_batch is not None else keep.sum())


def run(cases: list[dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """Each case: {"id", "script": Script fields, "plugin": ZeroPPPlugin settings or None (the
    plain Trainer), "func": whether to pass `compute_loss_func=z_loss`}."""
    results = {}
    for case in cases:
        if "loop" in case:
            try:
                results[case["id"]] = accelerate_loop(
                    case["loop"],
                    eval_rows=case.get("eval", 0),
                    doubled=case.get("doubled", False),
                    rows=case.get("rows"),
                    multiple=case.get("multiple", 1),
                    train_rows=case.get("train_rows", 16),
                )
            except (ValueError, PeerFailedError) as err:  # a refusal: its message, every rank
                results[case["id"]] = {"error": str(err), "type": type(err).__name__}
            continue
        folder = Path(out_dir) / case["id"]
        script = Script(**case["script"])
        extra: dict[str, Any] = {"compute_loss_func": z_loss} if case.get("func") else {}
        if case.get("plugin") is None:
            done = run_script(Trainer, script, str(folder), **extra)
        else:
            plugin = ZeroPPPlugin(**case["plugin"])
            done = run_script(ZeroPPTrainer, script, str(folder), zeropp_plugin=plugin, **extra)
        trainer = done.pop("trainer")
        out = {"logs": done["logs"], "steps": done["steps"]}
        if case.get("plugin") is not None:
            out["checkpointing"] = trainer.pipeline.engine.config.activation_checkpointing
            out["args_checkpointing"] = bool(trainer.args.gradient_checkpointing)
        trainer.save_model(str(folder / "final"))
        out.update(_saved(script, folder / "final"))
        trainer.accelerator.free_memory()
        results[case["id"]] = out
    return results


def weighted_loss(
    output: Any, labels: torch.Tensor, num_items_in_batch: float, weight: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An Accelerate loop's own loss, written for the pipeline's `use_loss`: next-token
    cross-entropy weighted per row (`weight`, a per-row tensor of the batch), summed and divided
    by `num_items_in_batch`; its token accuracy, the same way, as a metric."""
    logits = output["logits"][:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    ce = F.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), reduction="none")
    loss = (ce * keep * weight[:, None]).sum() / num_items_in_batch
    hits = ((logits.argmax(-1) == target) & keep).sum() / num_items_in_batch
    return loss, {"accuracy": hits}


def weighted_collate(
    samples: list[dict[str, torch.Tensor]], multiple: int = 1
) -> dict[str, torch.Tensor]:
    from tests.distributed.clm_loop import collate

    batch = collate(samples, multiple)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    return {**batch, "weight": 1.0 + 0.25 * (lengths % 3)}


def _doubled(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return weighted_collate(samples + samples)


def accelerate_loop(
    plugin: dict[str, Any] | None,
    steps: int = 3,
    eval_rows: int = 0,
    doubled: bool = False,
    rows: int | None = None,
    multiple: int = 1,
    train_rows: int = 16,
) -> dict[str, Any]:
    """The loop with its own loss: one process calls the model and the loss itself; under
    `ZeroPPAccelerator` the loss is handed to the pipelined model (`model.use_loss`). With
    `eval_rows`, then an evaluation as run_clm writes it: each batch's loss gathered once per
    row (`gather_for_metrics(loss.repeat(rows))`), their mean; `doubled`: its collator makes
    two rows of each sample (a repeated sample's rows cannot be told apart); `rows`: the batch
    per process (default 4 in one process, 2 under the pipeline); `multiple`: rows padded to a
    multiple of it (context parallelism's 2 x cp chunks); `train_rows`: the training set's."""
    import functools

    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from lightning_zeropp.accelerate import ZeroPPAccelerator
    from tests.distributed.clm_loop import Args, Texts, build_model
    from tests.distributed.clm_scenarios import PG

    if plugin is None:
        accelerator = Accelerator(cpu=True, kwargs_handlers=PG)
        rows = rows or 4
    else:
        accelerator = ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(**plugin), cpu=True)
        rows = 2  # per process: the 2 processes read 4 rows a step
    model = build_model(Args())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    padded = functools.partial(weighted_collate, multiple=multiple)
    loader = DataLoader(Texts(train_rows, 0), batch_size=rows, collate_fn=padded)
    collate = _doubled if doubled else padded
    evals = DataLoader(Texts(eval_rows, 2), batch_size=rows, collate_fn=collate)
    model, optimizer, loader, evals = accelerator.prepare(model, optimizer, loader, evals)
    if plugin is not None:
        model.use_loss(weighted_loss, rows=("weight",))
    model.train()
    logs = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss, metrics = _call(model, batch, plugin)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        logs.append({"loss": float(loss), **metrics})
    out: dict[str, Any] = {"logs": logs}
    if eval_rows:
        model.eval()
        losses = []
        for batch in evals:
            with torch.no_grad():
                loss, _ = _call(model, batch, plugin)
            size = batch["input_ids"].shape[0]
            losses.append(accelerator.gather_for_metrics(loss.reshape(1).repeat(size)))
        out["eval_loss"] = float(torch.cat(losses).mean())
    whole = accelerator.get_state_dict(model)
    accelerator.free_memory()
    out["weights"] = {k: v.clone() for k, v in (whole or {}).items()}
    return out


def _call(model: Any, batch: dict[str, Any], plugin: Any) -> tuple[torch.Tensor, dict]:
    """The loss and metrics of one call: the loop's own in one process, the pipeline's."""
    if plugin is None:
        labels, weight = batch.pop("labels"), batch.pop("weight")
        items = float((labels[:, 1:] != -100).sum())
        loss, metrics = weighted_loss(model(**batch), labels, items, weight)
        return loss, {k: float(v) for k, v in metrics.items()}
    out = model(**batch)
    return out.loss, out.metrics
