"""Scenarios running `trainer_script.run` under `ZeroPPTrainer`, the plain Trainer (DDP) and one
process; each returns what the tests compare: logs, evaluation, predictions and weights."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import Trainer

from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer
from tests.distributed.trainer_script import Script, build_model, model_class
from tests.distributed.trainer_script import run as run_script


def run(cases: list[dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """Each case: {"id", "script": Script fields, "plugin": ZeroPPPlugin settings or None (the
    plain Trainer), "resume": {"script": fields of the resumed run} (train, then resume a fresh
    run from checkpoint-2), "other": script fields of a resume expected to fail}."""
    results = {}
    for case in cases:
        folder = Path(out_dir) / case["id"]
        results[case["id"]] = _run_case(case, folder)
        if "resume" in case:
            again = {**case, "script": {**case["script"], **case["resume"]}}
            resumed = _run_case(again, folder / "again", resume=str(folder / "checkpoint-2"))
            results[case["id"]]["resumed"] = resumed
            results[case["id"]]["planted"] = _planted_resume(again, folder)
        if "other" in case:  # resumed with other script fields: the error on this rank
            other = {**case, "script": {**case["script"], **case["other"]}}
            try:
                _run_case(other, folder / "other", resume=str(folder / "checkpoint-2"))
                results[case["id"]]["other"] = None
            except ValueError as err:
                results[case["id"]]["other"] = str(err)
    return results


class _Planted:
    """Unpickling it creates the file `path`: whether a resume ran code from the checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _planted_resume(case: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Resume from a copy of checkpoint-2 whose `zeropp/meta.pt` runs code when unpickled, its
    checksums rewritten to match: every rank must refuse it, naming the file, and run nothing."""
    from lightning_zeropp.core.weights import checksum

    planted, marker = folder / "checkpoint-planted", folder / "code-ran"
    if torch.distributed.get_rank() == 0:
        shutil.copytree(folder / "checkpoint-2", planted)
        torch.save({"world_size": _Planted(marker)}, planted / "zeropp" / "meta.pt")
        checksum.write_sums(planted / "zeropp")
    torch.distributed.barrier()
    try:
        _run_case(case, folder / "planted", resume=str(planted))
        error = None
    except ValueError as err:
        error = str(err)
    torch.distributed.barrier()
    return {"error": error, "code_ran": marker.exists()}


def _run_case(case: dict[str, Any], folder: Path, resume: str | None = None) -> dict[str, Any]:
    script = Script(**case.get("script", {}))
    plugin = case.get("plugin")
    if "env" in case:  # no plugin: the layout from ZEROPP_* variables, as a launcher sets them
        with _environment(case["env"]):
            done = run_script(ZeroPPTrainer, script, str(folder), resume=resume)
        plugin = case["env"]
    elif plugin is None:
        done = run_script(Trainer, script, str(folder), resume=resume)
    else:
        zeropp = ZeroPPPlugin(**plugin)
        done = run_script(ZeroPPTrainer, script, str(folder), resume=resume, zeropp_plugin=zeropp)
    trainer = done.pop("trainer")
    out = {k: v for k, v in done.items() if k != "predict"}
    if "predict" in done:
        out["predictions"] = done["predict"].predictions
        out["predict_metrics"] = done["predict"].metrics
    best = trainer.state.best_model_checkpoint
    out["best"] = Path(best).name if best else None
    out["checkpoints"] = sorted(p.name for p in folder.glob("checkpoint-*"))
    if case.get("save_pretrained"):  # the model's own save, not trainer.save_model
        out["save_pretrained"] = _save_pretrained(trainer.model, folder / "direct")
    trainer.save_model(str(folder / "final"))
    out.update(_saved(script, folder / "final"))
    if script.lora:
        out.update(_merged(trainer, folder / "merged"))
    if plugin is not None:
        out.update(_pipeline_facts(trainer))
    trainer.accelerator.free_memory()
    return out


def _save_pretrained(model: Any, folder: Path) -> dict[str, Any]:
    """`model.save_pretrained(dir)` on every rank, after training: what it raised, and what it
    wrote."""
    try:
        model.save_pretrained(str(folder))
        error = None
    except RuntimeError as err:
        error = str(err)
    torch.distributed.barrier()
    return {"error": error, "files": sorted(p.name for p in folder.glob("*"))}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def _saved(script: Script, folder: Path) -> dict[str, Any]:
    """What save_model wrote, read back as a user would (main process only)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    if script.lora:
        return {
            "adapter": load_file(folder / "adapter_model.safetensors"),
            "files": sorted(p.name for p in folder.iterdir()),
        }
    model = model_class(script.family).from_pretrained(folder)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _merged(trainer: Any, folder: Path) -> dict[str, Any]:
    """PEFT's merge and export, as a user writes it: the whole model (a collective under
    ZeroPPTrainer: the trained weights land on the main process), merged there, saved and
    read back."""
    whole = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    whole.merge_and_unload().save_pretrained(folder)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(folder)
    return {"merged": {k: v.clone() for k, v in merged.state_dict().items()}}


def _pipeline_facts(trainer: Any) -> dict[str, Any]:
    """Per rank: which parameters have optimizer state and whether they train; the whole
    model's weights (for PEFT: base weights included); re-planning counts."""
    pipeline = trainer.pipeline
    optimizer = trainer.optimizer.optimizer
    names = {p: n for n, p in pipeline.engine.module.named_parameters()}
    with_state = [names[p] for p in optimizer.state if optimizer.state[p]]
    frozen = [n for p, n in names.items() if not p.requires_grad]
    whole = trainer.accelerator.get_state_dict(pipeline)  # collective
    facts = {
        "with_state": with_state,
        "frozen": frozen,
        "planning": pipeline.engine.core.planning.summary(),
        "param_dtype": str(pipeline.engine.config.param_dtype),
        "layout": {
            "pp_size": pipeline.engine.config.pp_size,
            "num_microbatches": pipeline.engine.config.num_microbatches,
        },
    }
    if whole:
        facts["whole"] = {k: v.clone() for k, v in whole.items()}
    return facts


def initial_weights(script: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model the script starts from (for PEFT: the base weights and initial adapters)."""
    model = build_model(Script(**script))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
