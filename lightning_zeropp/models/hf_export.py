"""`export_hf`: a trained HF causal LM's full state dict written as an ordinary HF directory
(`config.json` + `model.safetensors`) that `AutoModelForCausalLM.from_pretrained(path)` loads,
committed atomically (`core.weights.export.save_consolidated`). The state dict is checked
against the model the config describes: none of its tensors missing, the tied weights' pipelined
copies equal, the buffers the traced stages registered dropped. Re-exported by `models.hf`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from lightning_zeropp.core.split.tied import tied_groups
from lightning_zeropp.core.weights.export import save_consolidated

__all__ = ["export_hf"]

_WEIGHTS = "model.safetensors"


def export_hf(path: str | Path, state_dict: dict[str, torch.Tensor], config: Any) -> Path:
    """Collective: write `state_dict` (full, on global rank 0) and `config` as an HF directory.

    Every rank calls it; rank 0 writes `config.json` and `model.safetensors` into a temporary
    sibling directory and renames it to `path` (the previous export, if any, is replaced only when
    the new one is complete). Other ranks' `state_dict` is ignored (pass what
    `full_state_dict` returned there: an empty dict).

    A tied model (`config.tie_word_embeddings`) is written as `save_pretrained` writes it: the
    first name of each tied weight only, after checking its pipelined copies (embedding on the
    first stage, head on the last, `core.split.tied`) are equal.
    """
    config = copy.deepcopy(config)
    config.use_cache = True  # turned off for tracing only; generation wants it back

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        state = _hf_state(state_dict, config)
        config.save_pretrained(tmp)
        save_file(state, str(tmp / _WEIGHTS), metadata={"format": "pt"})

    return save_consolidated(path, write)


def _hf_state(state_dict: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The tensors an HF model of `config` expects, checked: none missing, extras dropped."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = list(model.state_dict())
    missing = [k for k in expected if k not in state_dict]
    if missing:
        raise ValueError(
            f"the state dict lacks {len(missing)} of the model's tensors (e.g. {missing[:3]}); "
            "pass the full state dict from ZeroPPStrategy.full_state_dict() or "
            "core.weights.export.full_state_dict(), which is complete on global rank 0 only."
        )
    for first, *others in tied_groups(model, frozen=True):
        for other in others:
            if not torch.equal(state_dict[first], state_dict[other]):
                raise ValueError(
                    f"config.tie_word_embeddings is True but '{first}' and '{other}' differ: "
                    "the model was trained untied. Set config.tie_word_embeddings = False "
                    "before exporting."
                )
            expected.remove(other)  # HF's loader ties it back to `first`
    # Extras are constant buffers the traced stages registered (e.g. rotary frequencies), which
    # HF recomputes from the config.
    return {k: state_dict[k].contiguous() for k in expected}
