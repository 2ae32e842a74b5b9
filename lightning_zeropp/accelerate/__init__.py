"""The Accelerate front: ZeroPP pipelines in an Accelerate training loop.

    accelerator = ZeroPPAccelerator(zeropp_plugin=ZeroPPPlugin(pp_size=2))
    model, optimizer, train_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, scheduler
    )

and the loop stays as it is (see `ZeroPPAccelerator`). Settings left out of the plugin come from
`ZEROPP_*` environment variables (`lightning_zeropp.core.settings.env`). `prepare_pipeline` is the
lower-level entry (the loop calls `engine.step(batch)` with its own `loss_fn`). Needs the
`accelerate` extra.
"""

from lightning_zeropp.accelerate.accelerator import ZeroPPAccelerator
from lightning_zeropp.accelerate.build import prepare_pipeline
from lightning_zeropp.accelerate.engine import ZeroPPAccelerateEngine
from lightning_zeropp.accelerate.optim import PipelineScheduler
from lightning_zeropp.accelerate.settings import ZeroPPPlugin
from lightning_zeropp.accelerate.steps import PipelineModel, PipelineOutput
from lightning_zeropp.core.settings.env import CONFIG_VARS, SPLIT_VAR, config_from_env

__all__ = [
    "CONFIG_VARS",
    "SPLIT_VAR",
    "PipelineModel",
    "PipelineOutput",
    "PipelineScheduler",
    "ZeroPPAccelerateEngine",
    "ZeroPPAccelerator",
    "ZeroPPPlugin",
    "config_from_env",
    "prepare_pipeline",
]
