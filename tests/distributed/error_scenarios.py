"""Bad input on every rank: each attempt must raise a clear error on all ranks, never hang.

Every attempt runs in one process group of 4 ranks, one after the other, so each must fail on
every rank alike and leave the group usable: a bad input that only one rank sees (and that the
failure board turns into a dead group) does not belong here. docs/bad-inputs.md lists them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zeropp import ZeroPPConfig, ZeroPPEngine, ZeroPPStrategy, launch_layout
from lightning_zeropp.models import GPT
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import MODEL, lm_loss, make_model


def _engine(model: nn.Module | None = None, split: str = "auto", **layout: Any) -> ZeroPPEngine:
    example = (torch.zeros(2, MODEL.seq_len, dtype=torch.long),)
    return ZeroPPEngine(
        model or make_model(),
        launch_layout(ZeroPPConfig(**layout)),
        loss_fn=lm_loss,
        example_args=example,
        split=split,
    )


def _indivisible_batch() -> None:
    engine = _engine(pp_size=2, dp_shard_size=2, num_microbatches=4)
    x = torch.zeros(6, MODEL.seq_len, dtype=torch.long)
    engine.train_step(x, target=x)


def _one_dp_rank_indivisible_batch() -> None:
    # pp-major layout: ranks 1 and 3 are data-parallel rank 1, which alone reads 6 rows
    engine = _engine(pp_size=2, dp_shard_size=2, num_microbatches=4)
    x = torch.zeros(6 if dist.get_rank() % 2 else 8, MODEL.seq_len, dtype=torch.long)
    engine.train_step(x, target=x)


def _shape_change() -> None:
    # Traced stages are fixed to the example's shapes (the call split takes any shape).
    engine = _engine(pp_size=2, dp_shard_size=2, num_microbatches=2, split="trace")
    for seq in (MODEL.seq_len, MODEL.seq_len // 2):
        x = torch.zeros(4, seq, dtype=torch.long)
        engine.train_step(x, target=x)


def _trace_batch_unlike_example() -> None:
    # The example is a micro-batch of 2 rows; these batches have micro-batches of 4.
    engine = _engine(pp_size=2, dp_shard_size=2, num_microbatches=2, split="trace")
    x = torch.zeros(8, MODEL.seq_len, dtype=torch.long)
    engine.train_step(x, target=x)


def _meta_unset_on_the_last_stage() -> None:
    # The head gains a parameter of its own that no init sets: only the last stage holds it.
    from lightning_zeropp.core.weights.materialize import empty_parameters

    with empty_parameters():
        model = GPT(MODEL)
        model.head.register_parameter("gain", nn.Parameter(torch.ones(MODEL.vocab_size)))
    _engine(model, pp_size=2, dp_shard_size=2)


def _trainer(strategy: ZeroPPStrategy, max_steps: int = 1) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _lightning_bad_layout() -> None:
    _trainer(ZeroPPStrategy(pp_size=3)).fit(LitGPT(MODEL), [])


class _StepWithoutModel(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0].float().mean()  # never calls self.model: nothing to feed the pipeline


def _lightning_step_without_model() -> None:
    x = torch.zeros(8, MODEL.seq_len, dtype=torch.long)
    loader = DataLoader(TensorDataset(x, x), batch_size=2)
    _trainer(ZeroPPStrategy(pp_size=2)).fit(_StepWithoutModel(MODEL), loader)


def _lightning_dataset_smaller_than_a_batch() -> None:
    x = torch.zeros(6, MODEL.seq_len, dtype=torch.long)  # 2 data-parallel ranks of 3 rows
    loader = DataLoader(TensorDataset(x, x), batch_size=4, drop_last=True)
    _trainer(ZeroPPStrategy(pp_size=2)).fit(LitGPT(MODEL), loader)


# ------------------------------------------------------------------ core: more engine inputs
def _no_batch() -> None:
    _engine(pp_size=2, dp_shard_size=2).train_step()


def _tied_weights_traced() -> None:
    model = make_model()
    model.head.weight = model.tok_emb.weight
    _engine(model, split="trace", pp_size=2, dp_shard_size=2)


def _trace_without_example() -> None:
    ZeroPPEngine(
        make_model(), launch_layout(ZeroPPConfig(pp_size=2)), loss_fn=lm_loss, split="trace"
    )


# ------------------------------------------------------------------ Lightning: settings
@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for one attempt and restore them after (raised or not)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _strategy_under(**env: str) -> None:
    with _environ(**env):
        ZeroPPStrategy()


def _loader(rows: int = 8, batch: int = 2, drop_last: bool = True) -> DataLoader:
    x = torch.zeros(rows, MODEL.seq_len, dtype=torch.long)
    return DataLoader(TensorDataset(x, x), batch_size=batch, drop_last=drop_last)


def _fit(strategy: ZeroPPStrategy, module: pl.LightningModule | None = None, **kwargs: Any) -> None:
    loader = kwargs.pop("loader", None)
    loader = _loader() if loader is None else loader  # an empty DataLoader is falsy
    _trainer(strategy, kwargs.pop("max_steps", 1)).fit(module or LitGPT(MODEL), loader, **kwargs)


def _mixed_precision_trainer() -> None:
    pl.Trainer(accelerator="cpu", devices=4, strategy=ZeroPPStrategy(), precision="bf16-mixed")


# ------------------------------------------------------------------ Lightning: modules
class _ManualOptimization(LitGPT):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


class _TwoNetworks(LitGPT):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.critic = nn.Linear(4, 4)  # a second child with parameters: which to pipeline?


class _ReadsAPartOutsideForward(LitGPT):
    """Its own parameter makes its forward the network; its step reads it outside forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.temperature = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        t = self.temperature.clamp(min=0.1)
        return torch.nn.functional.cross_entropy((self(x) / t).flatten(0, 1), y.flatten())


class _LayersWithoutForward(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Embedding(MODEL.vocab_size, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, MODEL.vocab_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return lm_loss(self.head(self.encoder(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _StepCallsASubmodule(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model.tok_emb(batch[0]).mean()  # a piece of the split network


# ------------------------------------------------------------------ Lightning: data
def _lightning_indivisible_batch() -> None:
    # 12 rows over 2 data-parallel ranks, batches of 3 rows: 3 do not split into 2 micro-batches
    _fit(ZeroPPStrategy(pp_size=2, num_microbatches=2), loader=_loader(12, 3))


def _lightning_short_last_batch() -> None:
    # 10 rows: 5 per data-parallel rank, batches of 4 and then 1 row (drop_last=False)
    loader = _loader(10, 4, drop_last=False)
    _fit(ZeroPPStrategy(pp_size=2, num_microbatches=2), loader=loader, max_steps=2)


# ------------------------------------------------------------------ Lightning: checkpoints
def _barrier_after_rank0(write: Any) -> None:
    if dist.get_rank() == 0:
        write()
    dist.barrier()


def _ckpt_of_another_size(work_dir: Path) -> None:
    from lightning_zeropp.core.weights.checkpoint import save_checkpoint

    path = work_dir / "narrow.ckpt"  # a sharded (DCP) checkpoint of a model of dim 16
    save_checkpoint(path, LitGPT(dataclasses.replace(MODEL, dim=16)), [], {"global_step": 0})
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(path))


def _full_ckpt_of_another_depth(work_dir: Path) -> None:
    path = work_dir / "shallow.ckpt"  # a full Lightning checkpoint file of a 6-block model
    shallow = LitGPT(dataclasses.replace(MODEL, num_layers=6))
    _barrier_after_rank0(lambda: torch.save({"state_dict": shallow.state_dict()}, path))
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(path))


def _ckpt_not_from_lightning(work_dir: Path) -> None:
    path = work_dir / "weights.pt"  # a bare state_dict, not a Lightning checkpoint
    _barrier_after_rank0(lambda: torch.save(LitGPT(MODEL).state_dict(), path))
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(path))


def _ckpt_missing(work_dir: Path) -> None:
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(work_dir / "never-saved.ckpt"))


def _ckpt_of_a_deeper_model(work_dir: Path) -> None:
    from lightning_zeropp.core.weights.checkpoint import save_checkpoint

    path = work_dir / "deeper.ckpt"  # a sharded (DCP) checkpoint of a model of 10 blocks, not 8
    save_checkpoint(path, LitGPT(dataclasses.replace(MODEL, num_layers=10)), [], {})
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(path))


class _RunsCode:
    """Unpickling it calls print: harmless here, but a crafted checkpoint could call anything."""

    def __reduce__(self) -> tuple:
        return (print, ("[a crafted checkpoint ran code]",))


def _saved_sharded(work_dir: Path, name: str = "saved.ckpt") -> Path:
    from lightning_zeropp.core.weights.checkpoint import save_checkpoint

    return save_checkpoint(work_dir / name, LitGPT(MODEL), [], {"global_step": 0})


def _changed_and_loaded(work_dir: Path, change: Any) -> None:
    """A sharded checkpoint that rank 0 changes after the save, then `ckpt_path=` it."""
    path = _saved_sharded(work_dir)
    _barrier_after_rank0(lambda: change(path))
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(path))


def _crafted(file: Path, write: Any, value: Any) -> None:
    """An attacker's file in a checkpoint, the checksums removed (they would give it away)."""
    write(value, file)
    (file.parent / "SHA256SUMS").unlink(missing_ok=True)


def _pickle_to(value: Any, file: Path) -> None:
    file.write_bytes(pickle.dumps(value))


def _flip_a_byte(file: Path, at: float = 0.5, truncate: bool = False) -> None:
    data = bytearray(file.read_bytes())
    if truncate:
        file.write_bytes(bytes(data[: len(data) // 2]))
        return
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def _ckpt_a_temporary(work_dir: Path) -> None:
    # What a save killed mid-write leaves: `.saved.ckpt.tmp-<id>` holding meta.pt and shards.
    path = _saved_sharded(work_dir)
    temporary = work_dir / ".saved.ckpt.tmp-0123abcd"
    _barrier_after_rank0(lambda: os.rename(path, temporary))
    _fit(ZeroPPStrategy(pp_size=2), ckpt_path=str(temporary))


def _load_from_a_deeper_model(work_dir: Path) -> None:
    from lightning_zeropp.core.weights.checkpoint import save_checkpoint

    path = work_dir / "deeper"
    save_checkpoint(path, GPT(dataclasses.replace(MODEL, num_layers=10)), [], {})
    example = (torch.zeros(2, MODEL.seq_len, dtype=torch.long),)
    config = ZeroPPConfig(pp_size=2, dp_shard_size=2)
    ZeroPPEngine(
        make_model(), launch_layout(config), loss_fn=lm_loss, example_args=example, load_from=path
    )


# ------------------------------------------------------------------ ranks that disagree
def _split_points_per_rank() -> dict[str, str]:
    """ZEROPP_SPLIT_POINTS set differently on the two pipeline stages' ranks (pp-major: ranks 0
    and 1 hold stage 0)."""
    return {"ZEROPP_PP_SIZE": "2", "ZEROPP_SPLIT_POINTS": "4" if dist.get_rank() < 2 else "3"}


def _with_env(env: dict[str, str], run: Any) -> None:
    with _environ(**env):
        run()


def _lightning_split_points_differ() -> None:
    with _environ(**_split_points_per_rank()):
        _fit(ZeroPPStrategy())


def _per_rank_env(**pairs: tuple[str, str]) -> dict[str, str]:
    """Variables set one way on ranks 0 and 1 (pipeline stage 0), another on ranks 2 and 3."""
    return {k: (first if dist.get_rank() < 2 else second) for k, (first, second) in pairs.items()}


class _DrawsApartPerRank(LitGPT):
    """Masks its inputs with numpy's generator, seeded per process: a draw the strategy does
    not share (it shares torch's), so the stages would feed and score other masks."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import numpy as np

        x, y = batch
        np.random.seed(dist.get_rank())
        hide = torch.from_numpy(np.random.rand(*x.shape) < 0.5)
        return lm_loss(self(x.masked_fill(hide, 0)), y)


def _ones() -> DataLoader:
    x = torch.ones(8, MODEL.seq_len, dtype=torch.long)  # a mask shows (0 where hidden)
    return DataLoader(TensorDataset(x, x), batch_size=2, drop_last=True)


def _depth_per_rank() -> None:
    # One node built a deeper model (another config file): the ranks would cut other blocks.
    depth = 8 if dist.get_rank() < 2 else 10
    _engine(GPT(dataclasses.replace(MODEL, num_layers=depth)), pp_size=2, dp_shard_size=2)


def _hsdp_unseeded() -> None:
    # Each rank builds the model from its own seed: the two replicas of each shard differ.
    engine = _engine(make_model(seed=dist.get_rank()), dp_replicate_size=2, dp_shard_size=2)
    x = torch.zeros(4, MODEL.seq_len, dtype=torch.long)
    engine.train_step(x, target=x)


# ------------------------------------------------------------------ Accelerate
def _accelerate(env: dict[str, str] | None = None, batch: int = 16, **settings: Any) -> None:
    """`prepare_pipeline` as a user's script calls it, layout from `settings` or `env`."""
    from accelerate import Accelerator

    from lightning_zeropp.accelerate import prepare_pipeline

    with _environ(**(env or {})):
        accelerator = Accelerator(cpu=True)
        net = make_model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        x = torch.zeros(32, MODEL.seq_len, dtype=torch.long)
        loader = DataLoader(TensorDataset(x, x), batch_size=batch, drop_last=True)
        config = ZeroPPConfig(**settings) if settings else None
        prepare_pipeline(accelerator, net, opt, loader, loss_fn=lm_loss, config=config)


ATTEMPTS = {
    "world_mismatch": lambda: _engine(pp_size=3),
    "too_few_microbatches": lambda: _engine(pp_size=4, num_microbatches=2),
    "more_stages_than_blocks": lambda: _engine(
        pp_size=4, schedule="interleaved_1f1b", num_chunks=4, num_microbatches=4
    ),
    "indivisible_batch": _indivisible_batch,
    "one_dp_rank_indivisible_batch": _one_dp_rank_indivisible_batch,
    "shape_change": _shape_change,
    "trace_batch_unlike_example": _trace_batch_unlike_example,
    "unknown_schedule": lambda: _engine(pp_size=2, schedule="pipedream"),
    "unsplittable_model": lambda: _engine(nn.Linear(4, 4), pp_size=2),
    "lightning_bad_layout": _lightning_bad_layout,
    "lightning_step_without_model": _lightning_step_without_model,
    "lightning_dataset_smaller_than_a_batch": _lightning_dataset_smaller_than_a_batch,
    # core
    "split_typo": lambda: _engine(pp_size=2, dp_shard_size=2, split="calll"),
    "bad_split_points": lambda: _engine(pp_size=2, dp_shard_size=2, split_points=[9]),
    "no_batch": _no_batch,
    "tied_weights_traced": _tied_weights_traced,
    "trace_without_example": _trace_without_example,
    "meta_unset_on_the_last_stage": _meta_unset_on_the_last_stage,
    # Lightning: settings (ZEROPP_* read as the Accelerate front reads them)
    "lightning_env_typo": lambda: _strategy_under(ZEROPP_PP_SIZ="2"),
    "lightning_env_not_an_integer": lambda: _strategy_under(ZEROPP_NUM_MICROBATCHES="four"),
    "lightning_env_split_typo": lambda: _strategy_under(ZEROPP_SPLIT="pipe"),
    "lightning_state_dict_type_typo": lambda: ZeroPPStrategy(state_dict_type="fulll"),
    "lightning_split_typo": lambda: _fit(ZeroPPStrategy(pp_size=2, split="calll")),
    "lightning_bad_dtype": lambda: _fit(ZeroPPStrategy(pp_size=2, param_dtype="bfloat")),
    "lightning_mixed_precision": _mixed_precision_trainer,
    # Lightning: modules
    "lightning_manual_optimization": lambda: _fit(ZeroPPStrategy(), _ManualOptimization(MODEL)),
    "lightning_two_networks": lambda: _fit(
        ZeroPPStrategy(module_name="model"), _TwoNetworks(MODEL)
    ),
    "lightning_part_outside_forward": lambda: _fit(
        ZeroPPStrategy(pp_size=2), _ReadsAPartOutsideForward(MODEL)
    ),
    "lightning_layers_without_forward": lambda: _fit(ZeroPPStrategy(), _LayersWithoutForward()),
    "lightning_step_calls_a_submodule": lambda: _fit(ZeroPPStrategy(), _StepCallsASubmodule(MODEL)),
    # Lightning: data
    "lightning_indivisible_batch": _lightning_indivisible_batch,
    "lightning_short_last_batch": _lightning_short_last_batch,
    "lightning_empty_dataset": lambda: _fit(ZeroPPStrategy(pp_size=2), loader=_loader(0)),
    # Lightning: checkpoints (ckpt_path=)
    "lightning_ckpt_of_another_size": _ckpt_of_another_size,
    "lightning_full_ckpt_of_another_depth": _full_ckpt_of_another_depth,
    "lightning_ckpt_not_from_lightning": _ckpt_not_from_lightning,
    "lightning_ckpt_missing": _ckpt_missing,
    # Accelerate (last: Accelerate's state is per process)
    "accelerate_env_typo": lambda: _accelerate(env={"ZEROPP_SCHEDUEL": "gpipe"}),
    "accelerate_env_bad_dtype": lambda: _accelerate(
        env={"ZEROPP_PP_SIZE": "2", "ZEROPP_PARAM_DTYPE": "fp8"}
    ),
    "lightning_ckpt_of_a_deeper_model": _ckpt_of_a_deeper_model,
    # ranks that must agree
    "lightning_split_points_differ_per_rank": _lightning_split_points_differ,
    "lightning_check_batch_differs_per_rank": lambda: _with_env(
        _per_rank_env(ZEROPP_PP_SIZE=("2", "2"), ZEROPP_CHECK_BATCH=("1", "0")),
        lambda: _fit(ZeroPPStrategy()),
    ),
    "lightning_step_draws_apart_under_check_batch": lambda: _with_env(
        {"ZEROPP_PP_SIZE": "2", "ZEROPP_CHECK_BATCH": "1"},
        lambda: _fit(ZeroPPStrategy(), _DrawsApartPerRank(MODEL), loader=_ones()),
    ),
    "accelerate_split_points_differ_per_rank": lambda: _accelerate(env=_split_points_per_rank()),
    "hsdp_replicas_built_unseeded": _hsdp_unseeded,
    "lightning_pp_size_differs_per_rank": lambda: _with_env(
        _per_rank_env(ZEROPP_PP_SIZE=("2", "4")), lambda: _fit(ZeroPPStrategy())
    ),
    "lightning_schedule_differs_per_rank": lambda: _with_env(
        _per_rank_env(ZEROPP_PP_SIZE=("2", "2"), ZEROPP_SCHEDULE=("1f1b", "gpipe")),
        lambda: _fit(ZeroPPStrategy()),
    ),
    "accelerate_param_dtype_differs_per_rank": lambda: _accelerate(
        env=_per_rank_env(ZEROPP_PP_SIZE=("2", "2"), ZEROPP_PARAM_DTYPE=("fp32", "bf16"))
    ),
    "accelerate_quantized_weights_differ_per_rank": lambda: _accelerate(
        env=_per_rank_env(
            ZEROPP_PP_SIZE=("2", "2"),
            ZEROPP_SCHEDULE=("zeropp", "zeropp"),
            ZEROPP_QUANTIZED_WEIGHTS=("int8", "fp"),
        )
    ),
    "model_depth_differs_per_rank": _depth_per_rank,
    "lightning_ckpt_meta_runs_code": lambda work_dir: _changed_and_loaded(
        work_dir, lambda path: _crafted(path / "meta.pt", torch.save, {"step": _RunsCode()})
    ),
    "lightning_ckpt_metadata_runs_code": lambda work_dir: _changed_and_loaded(
        work_dir, lambda path: _crafted(path / ".metadata", _pickle_to, _RunsCode())
    ),
    "lightning_ckpt_changed_shard": lambda work_dir: _changed_and_loaded(
        work_dir, lambda path: _flip_a_byte(path / "__1_0.distcp")
    ),
    "lightning_ckpt_truncated_shard": lambda work_dir: _changed_and_loaded(
        work_dir, lambda path: _flip_a_byte(path / "__2_0.distcp", truncate=True)
    ),
    "lightning_ckpt_without_metadata": lambda work_dir: _changed_and_loaded(
        work_dir, lambda path: (path / ".metadata").unlink()
    ),
    "lightning_ckpt_a_temporary": _ckpt_a_temporary,
    "load_from_a_deeper_model": _load_from_a_deeper_model,
    "lightning_timeout_not_a_timedelta": lambda: ZeroPPStrategy(timeout=60),
    "accelerate_indivisible_loader": lambda: _accelerate(batch=6, pp_size=2, num_microbatches=4),
}
_NEEDS_DIR = {
    "lightning_ckpt_of_another_size",
    "lightning_full_ckpt_of_another_depth",
    "lightning_ckpt_not_from_lightning",
    "lightning_ckpt_missing",
    "lightning_ckpt_of_a_deeper_model",
    "lightning_ckpt_meta_runs_code",
    "lightning_ckpt_metadata_runs_code",
    "lightning_ckpt_changed_shard",
    "lightning_ckpt_truncated_shard",
    "lightning_ckpt_without_metadata",
    "lightning_ckpt_a_temporary",
    "load_from_a_deeper_model",
}


# Attempts run only by the slow test (and bench/bench_faults.py): variants of ones CI runs, or
# checked in one process by unit tests (tests/unit/test_checkpoint_trust.py, test_no_hang.py).
SLOW_ATTEMPTS = {
    "accelerate_split_points_differ_per_rank",
    "lightning_pp_size_differs_per_rank",
    "lightning_schedule_differs_per_rank",
    "accelerate_param_dtype_differs_per_rank",
    "accelerate_quantized_weights_differ_per_rank",
    "model_depth_differs_per_rank",
    "lightning_ckpt_metadata_runs_code",
    "lightning_ckpt_truncated_shard",
    "lightning_ckpt_without_metadata",
    "lightning_ckpt_a_temporary",
    "load_from_a_deeper_model",
    "lightning_timeout_not_a_timedelta",
}


def attempt_all(work_dir: str, only: list[str] | None = None, slow: bool = False) -> dict[str, str]:
    """Each attempt's error, as 'Type: message' (or 'no error'). `work_dir`: a directory every
    rank shares, for the checkpoints the attempts write; `only`: these attempts, else those CI
    runs (`slow`: those the slow test runs, `SLOW_ATTEMPTS`)."""
    out = {}
    for name, fn in ATTEMPTS.items():
        if only is not None and name not in only:
            continue
        if only is None and (name in SLOW_ATTEMPTS) != slow:
            continue
        try:
            if name in _NEEDS_DIR:
                folder = Path(work_dir) / name
                folder.mkdir(parents=True, exist_ok=True)
                fn(folder)
            else:
                fn()
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the test inspects what was raised
            out[name] = f"{type(err).__name__}: {err}"
    return out
