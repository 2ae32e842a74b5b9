"""`ZeroPPPlugin`: the ZeroPP settings of a `ZeroPPAccelerator`, as Accelerate's plugins hold theirs.

Like `FullyShardedDataParallelPlugin`, whose unset fields come from `FSDP_*` variables that
`accelerate launch` exports, every setting left unset here comes from its `ZEROPP_*` variable,
then from `ZeroPPConfig`'s defaults: the one path every front takes (`fronts.settings`).
Settings are `ZeroPPConfig`'s fields (`pp_size=2`, `schedule="interleaved_1f1b"`, ...); a
misspelt one fails at construction, with the closest name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.split.methods import SplitMethod
from lightning_zeropp.core.weights.materialize import InitFn
from lightning_zeropp.fronts.packing import SeqBuckets, check_buckets
from lightning_zeropp.fronts.settings import (
    RunSettings,
    check_names,
    merge_settings,
    takes_settings,
)

__all__ = ["ZeroPPPlugin"]


class ZeroPPPlugin:
    """ZeroPP settings for `ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2, ...))`.

    Args:
        config: a whole `ZeroPPConfig` (then no other setting may be given).
        split: how the model is cut into stages ("auto", "call", "trace", "stack" or a
            callable; default `ZEROPP_SPLIT`, then "auto").
        eval_logits: in eval mode, return the logits on every rank (a broadcast from the last
            stage); turn off when the loop reads the loss only.
        load_from: weights each rank reads for its own shards only, after sharding: an HF model
            directory (safetensors, sharded or not) or a distributed checkpoint of any layout.
            Build the model under Accelerate's `init_empty_weights()` and the whole model never
            exists in one process.
        init: `init(module)` per module for a model built on the meta device without
            `load_from` (default: the model's own `_init_weights`, else `reset_parameters()`).
        seq_buckets: for causal LMs, pad each batch's length up to a bucket so that batches of
            changing length reuse a few pipeline schedules (each new shape builds one): None
            (default: lengths as they come), "pow2", an int k (multiples of k) or a list of
            lengths (`lightning_zeropp.fronts.packing`). Padding is masked out of the loss and
            attention: the numbers do not change.
        **settings: `ZeroPPConfig` fields; those left out come from `ZEROPP_*` variables.
    """

    @takes_settings
    def __init__(
        self,
        config: ZeroPPConfig | None = None,
        *,
        split: SplitMethod | None = None,
        eval_logits: bool = True,
        load_from: str | Path | None = None,
        init: InitFn | None = None,
        seq_buckets: SeqBuckets = None,
        **settings: Any,
    ) -> None:
        check_names(settings, "ZeroPPPlugin")
        if config is not None and settings:
            raise TypeError(
                f"ZeroPPPlugin got config=... and {sorted(settings)}; set them on the config."
            )
        self.config = config
        self.settings = settings
        self.split = split
        self.eval_logits = eval_logits
        self.load_from, self.init = load_from, init
        self.seq_buckets = check_buckets(seq_buckets)

    def run_settings(self) -> RunSettings:
        """The plugin's settings over the `ZEROPP_*` variables (read now: at `prepare`)."""
        given = self.config if self.config is not None else self.settings
        return merge_settings(given, split=self.split, owner="ZeroPPPlugin")

    def __repr__(self) -> str:
        shown = {"config": self.config} if self.config is not None else self.settings
        inner = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"ZeroPPPlugin({inner})"
