"""Training or evaluation, as TRL's trainers read it: off `self.model`; and TRL's fused LM head
taken off a PEFT model's base model.

TRL 1.16's `log` (SFT, Reward, DPO) picks the metrics of "train" or "eval" by
`self.model.training`. Under `ZeroPPTrainer` the Trainer switches the pipeline it trains
(`model_wrapped`) between `train()` and `eval()`; the model object passed in holds no weights and
is never switched, so it keeps the mode it came in (a `from_pretrained` model: eval), and TRL
would log an empty "eval" set in training. The model's mode follows the pipeline's before each
log.

TRL 1.16's SFT and DPO trainers patch the (base) model's `forward` on the instance with a fused
LM head (`trl.trainer.utils.add_fused_lm_head`), a closure over the original model's bound
forward. A pipeline stage is a copy of the model called through its class's forward, so the patch
is never reached, except under PEFT: the `PeftModel`'s class forward calls the base model's
instance forward, whose closure then runs the original model, whose weights moved into the
stages (meta tensors: "Tensor.item() cannot be called on meta tensors"). The pipelined losses
compute from the logits and never ask for the fused head, so it is taken off again.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["drop_fused_head", "follow_pipeline_mode"]

# the code name of TRL's patched forward (add_fused_lm_head); `functools.wraps` gives the
# function itself the class forward's `__name__`
_FUSED = "_fused_forward"


def follow_pipeline_mode(model: nn.Module | None, pipeline: Any) -> None:
    """Put `model` (the released model TRL reads) in the pipeline's mode, once it is built."""
    if model is not None and pipeline is not None and model.training != pipeline.training:
        model.train(pipeline.training)


def drop_fused_head(model: nn.Module | None) -> None:
    """Take TRL's fused-LM-head forward off a PEFT model's base model (the class's forward
    again), so that the stages' copies call their own modules, not the original model's."""
    get_base = getattr(model, "get_base_model", None)
    if not callable(get_base):  # not PEFT: the stages call the class's forward already
        return
    base = get_base()
    patched = base.__dict__.get("forward")
    code = getattr(getattr(patched, "__func__", None), "__code__", None)
    if code is not None and code.co_name == _FUSED:
        del base.__dict__["forward"]
