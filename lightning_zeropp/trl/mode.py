"""Training or evaluation, as TRL's trainers read it: off `self.model`.

TRL 1.16's `log` (SFT, Reward, DPO) picks the metrics of "train" or "eval" by
`self.model.training`. Under `ZeroPPTrainer` the Trainer switches the pipeline it trains
(`model_wrapped`) between `train()` and `eval()`; the model object passed in holds no weights and
is never switched, so it keeps the mode it came in (a `from_pretrained` model: eval), and TRL
would log an empty "eval" set in training. The model's mode follows the pipeline's before each
log.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["follow_pipeline_mode"]


def follow_pipeline_mode(model: nn.Module | None, pipeline: Any) -> None:
    """Put `model` (the released model TRL reads) in the pipeline's mode, once it is built."""
    if model is not None and pipeline is not None and model.training != pipeline.training:
        model.train(pipeline.training)
