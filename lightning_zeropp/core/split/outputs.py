"""A stage's output as the pipeline runtime carries it: tensors only. A last stage whose model
returns a structure (an HF `ModelOutput`, a dict) sends its tensor leaves, and the loss gets the
structure back (`restore_output`); a whole-model stage (one stage) is made to do the same
(`flatten_outputs`), as call stages (`call_stages`) do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_zeropp.core._torch_private import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["OUTPUTS_ATTR", "Outputs", "flatten_outputs", "restore_output"]


class Outputs:
    """A last stage's output structure when it is not tensors (an HF `ModelOutput`, a dict):
    the pipeline runtime takes tensors only, so the leaves travel and the loss gets the
    structure back (`restore_output`)."""

    def __init__(self) -> None:
        self.spec: TreeSpec | None = None

    def flat(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in out)
        ):
            self.spec = None
            return out
        leaves, self.spec = tree_flatten(out)
        odd = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if odd:
            raise TypeError(
                f"the model's output holds {odd} besides tensors; a pipeline's last stage can "
                "return tensors only (in a tuple, dict or output object). Return tensors, or turn "
                "off what adds the others (for HF models: config.use_cache = False)."
            )
        return tuple(leaves)

    def restore(self, output: Any) -> Any:
        if self.spec is None:
            return output
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        return tree_unflatten(leaves, self.spec)


OUTPUTS_ATTR = "_zeropp_outputs"


def flatten_outputs(module: nn.Module) -> None:
    """Make a whole-model stage (a single-stage pipeline) return tensors, as call stages do:
    its forward is wrapped on the instance, and `restore_output` undoes the flattening."""
    if hasattr(module, OUTPUTS_ATTR):
        return
    outputs, forward = Outputs(), module.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        return outputs.flat(forward(*args, **kwargs))

    object.__setattr__(module, OUTPUTS_ATTR, outputs)
    module.forward = run


def restore_output(stage: nn.Module, output: Any) -> Any:
    """A last stage's output as the model returned it (the runtime saw its tensor leaves)."""
    outputs = getattr(stage, OUTPUTS_ATTR, None)
    return output if outputs is None else outputs.restore(output)
