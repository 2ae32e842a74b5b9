"""The Accelerate front: ZeroPP pipelines in an Accelerate training loop.

    engine, optimizer, train_dl, scheduler = prepare_pipeline(
        accelerator, model, optimizer, train_dl, scheduler, loss_fn=loss_fn
    )

The layout comes from `ZEROPP_*` environment variables (or `config=ZeroPPConfig(...)`); see
`lightning_zeropp.accelerate.env`. Needs the `accelerate` extra.
"""

from lightning_zeropp.accelerate.engine import ZeroPPAccelerateEngine
from lightning_zeropp.accelerate.env import CONFIG_VARS, SPLIT_VAR, config_from_env
from lightning_zeropp.accelerate.optim import PipelineScheduler
from lightning_zeropp.accelerate.plugin import prepare_pipeline

__all__ = [
    "CONFIG_VARS",
    "SPLIT_VAR",
    "PipelineScheduler",
    "ZeroPPAccelerateEngine",
    "config_from_env",
    "prepare_pipeline",
]
