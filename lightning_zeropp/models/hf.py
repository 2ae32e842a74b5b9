"""HF decoder-only causal LMs (Llama, Mistral, Qwen2, Qwen3) under ZeroPP, and their export.

The adapter between `transformers` and the library; the core never imports transformers.

- `build_causal_lm(family, **overrides)` builds a `*ForCausalLM` from a config (no download);
  `from_pretrained(path)` loads one from a local directory. Both return the model ready for
  pipelining (`prepare_causal_lm`), with its parameter names and forward untouched.
- `prepare_causal_lm(model)` makes any model of that shape pipelinable: it refuses (or, asked to,
  unties) tied embeddings, turns off the KV cache, makes the rotary embedding traceable and attaches
  a `CausalLMCallAdapter`, so a training step that calls `model(input_ids, labels=labels).loss` or
  `model(input_ids).logits` works unchanged under `ZeroPPStrategy`.
- `export_hf(path, state_dict, config)` (`models.hf_export`, re-exported here) writes a
  consolidated HF directory (`config.json` + `model.safetensors`) that
  `AutoModelForCausalLM.from_pretrained(path)` loads; the state dict comes from
  `ZeroPPStrategy.full_state_dict()` or `core.weights.export.full_state_dict(...)`.

Two ways in. A plain `AutoModelForCausalLM` (no preparation) is cut by the call split: it takes
`attention_mask` and `position_ids`, keeps tied embeddings tied (`core.split.tied`), and its loss is
HF's own, token-weighted through `fronts.hf_loss`. A model passed through `prepare_causal_lm` is
cut by `split="trace"` with one micro-batch of `input_ids` as the example: the stages keep HF's
names (`model.layers.3.mlp.up_proj.weight`, `lm_head.weight`); the rotary cos/sin and causal mask
the first stage computes travel with the hidden states (relayed by `core.split.chain` past two stages).
A traced graph takes fixed-length `input_ids` only (mark padding in `labels` with -100) and
cannot keep a tied weight's copies apart, so tied models must be untied there. `split="stack"`
does not apply: HF's decoder forward calls `embed_tokens`, `norm` and `lm_head` unconditionally
and takes token ids, not hidden states, so a pruned copy cannot run a middle stage.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.split.blocks import find_blocks
from lightning_zeropp.core.split.methods import SPLIT_ATTR
from lightning_zeropp.core.weights.materialize import empty_parameters
from lightning_zeropp.fronts.call_adapter import CallAdapter, set_call_adapter
from lightning_zeropp.models.hf_export import export_hf

__all__ = [
    "FAMILIES",
    "LOSS_KWARGS",
    "CausalLMCallAdapter",
    "build_causal_lm",
    "export_hf",
    "from_pretrained",
    "prepare_causal_lm",
]

# The families tested end to end; others of the same shape pass `prepare_causal_lm`'s checks.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Arguments of a causal LM's forward that only its loss reads: never fed to the first stage.
LOSS_KWARGS = ("labels", "shift_labels", "num_items_in_batch", "ignore_index")

_BLOCKS = "model.layers"


def build_causal_lm(
    family: str,
    *,
    seed: int | None = None,
    untie_embeddings: bool = False,
    empty: bool = False,
    **overrides: Any,
) -> nn.Module:
    """A freshly initialised `*ForCausalLM` of `family` from its config class and `overrides`.

    Example: `build_causal_lm("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)`. `tie_word_embeddings`
    defaults to False (pipeline stages cannot share the embedding with `lm_head`). `empty`:
    parameters on the meta device, initialized by each rank on its own shards at setup (HF's
    `_init_weights`, see `core.weights.materialize`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    key = family.lower()
    if key not in FAMILIES:
        raise ValueError(
            f"family={family!r} is not supported; use one of {list(FAMILIES)} or load another "
            "decoder of the same shape with from_pretrained(path)."
        )
    overrides.setdefault("tie_word_embeddings", False)
    config = AutoConfig.for_model(key, **overrides)
    if seed is not None:
        torch.manual_seed(seed)  # HF initialises from the global generator
    with empty_parameters() if empty else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config)
    return prepare_causal_lm(model, untie_embeddings=untie_embeddings)


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    untie_embeddings: bool = False,
    empty: bool = False,
    **config_overrides: Any,
) -> nn.Module:
    """Load a `*ForCausalLM` from a local HF directory (no download), ready for pipelining.

    fp32 by default: these are the master weights FSDP2 shards (use
    `ZeroPPStrategy(param_dtype="bf16")` for bf16 compute). `empty`: read the config only and
    build with parameters on the meta device; pass the directory as the front's `load_from`
    (`ZeroPPStrategy(load_from=path)`, `ZeroPPPlugin(load_from=path)`) and each rank reads only
    its own shards of the safetensors files.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json; pass a local directory written by save_pretrained or "
            "export_hf (downloads are not attempted)."
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True, **config_overrides)
    _check_untied(config, untie_embeddings)  # before reading any weights
    if empty:
        if untie_embeddings and getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                "from_pretrained(empty=True) reads the weights by name at setup, and the file "
                "stores a tied head once: untie_embeddings=True would leave 'lm_head.weight' "
                "with nothing to load. Load it whole (empty=False), or export it untied first."
            )
        with empty_parameters():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return prepare_causal_lm(model, untie_embeddings=untie_embeddings)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, local_files_only=True
    )
    return prepare_causal_lm(model, untie_embeddings=untie_embeddings)


def prepare_causal_lm(model: nn.Module, *, untie_embeddings: bool = False) -> nn.Module:
    """Make an HF causal LM pipelinable in place (idempotent); returns it.

    Parameter names, values and the forward's arithmetic are unchanged.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise TypeError(
            f"prepare_causal_lm expects a transformers *ForCausalLM model, got "
            f"{type(model).__name__}; build one with build_causal_lm or from_pretrained."
        )
    container, _ = find_blocks(model)
    if container != _BLOCKS:
        raise ValueError(
            f"{type(model).__name__} keeps its blocks in '{container}', not '{_BLOCKS}': it is not "
            f"a decoder of the Llama shape ({', '.join(FAMILIES)}). Pass split=<callable> to the "
            "strategy to cut it by hand."
        )
    _check_untied(config, untie_embeddings)
    if untie_embeddings:
        _untie(model)
    # The KV cache is for generation; a traced training forward cannot return a cache object.
    config.use_cache = False
    _inline_grad_mode_decorators(model)
    # Ignored below: an HF model (checked above), typed nn.Module, whose __getattr__ mypy reads
    vocab_size = model.get_output_embeddings().out_features  # type: ignore[operator]
    # `loss_function` is a property returning a plain function: the adapter keeps no reference to
    # the whole model (which would pin every stage's weights after the split).
    set_call_adapter(model, CausalLMCallAdapter(model.loss_function, vocab_size))
    # The traced split relays HF's rotary tables and mask and maps its output object; ask for it.
    object.__setattr__(model, SPLIT_ATTR, "trace")
    return model


class CausalLMCallAdapter(CallAdapter):
    """`model(input_ids, labels=..., ...)` under a pipeline, as HF's causal LM forward answers it.

    First stage: gets `input_ids` only (the traced forward was traced on them); loss arguments
    (`LOSS_KWARGS`) are kept back. Last stage: the call returns a `CausalLMOutputWithPast` whose
    `.logits` are the stage's output and whose `.loss` is the model's own `loss_function` on them
    when `labels` is given (HF's convention: `labels` are aligned with `input_ids` and shifted
    inside the loss, unless pre-shifted `shift_labels` are passed too).
    """

    def __init__(self, loss_function: Any, vocab_size: int) -> None:
        self.loss_function = loss_function
        self.vocab_size = vocab_size

    def stage_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        rest = {k: v for k, v in kwargs.items() if k not in LOSS_KWARGS}
        if "input_ids" in rest:
            if args:
                raise TypeError("input_ids was passed both positionally and as a keyword")
            args = (rest.pop("input_ids"),)
        if len(args) != 1 or rest:
            raise ValueError(
                f"a pipelined HF causal LM takes input_ids (and loss arguments {list(LOSS_KWARGS)}) "
                f"only; got {len(args)} positional arguments and keywords {sorted(rest)}. Feed "
                "fixed-length token ids (pad, and mark padding in labels with -100)."
            )
        return args, {}

    def stage_output(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits = _logits_of(output)
        loss = None
        labels = kwargs.get("labels")
        if labels is not None:
            extra = {k: kwargs[k] for k in LOSS_KWARGS[1:] if kwargs.get(k) is not None}
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.vocab_size, **extra
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


# ---------------------------------------------------------------------- helpers
def _check_untied(config: Any, untie_embeddings: bool) -> None:
    if getattr(config, "tie_word_embeddings", False) and not untie_embeddings:
        raise ValueError(
            "tie_word_embeddings=True: lm_head shares the input embedding's weight, and pipeline "
            "stages cannot share a parameter. Pass untie_embeddings=True (lm_head gets its own "
            "copy of the embedding; exports then say tie_word_embeddings=False), build the "
            "model with tie_word_embeddings=False, or pass the plain model without "
            "prepare_causal_lm: its default call split keeps the tie across stages."
        )


def _untie(model: Any) -> None:
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone(), emb.weight.requires_grad)
    model.config.tie_word_embeddings = False  # so that no later tie_weights() ties them again


def _inline_grad_mode_decorators(model: nn.Module) -> None:
    """Run parameter-free modules' `@torch.no_grad()` forwards without the decorator.

    HF's rotary embeddings decorate `forward` with `@torch.no_grad()`. torch 2.13's export keeps that
    grad-mode switch as a higher-order op whose body the pipeline splitter turns into a call of the
    module with no arguments, and the first stage fails ("Expected positional argument for
    parameter ..."). Without the decorator the same tensors come out: the rotary inputs (position
    ids and a constant buffer) never require grad, so there is nothing for autograd to record.
    Only parameter-free modules are touched, for that reason. The patch is per instance.
    """
    for module in model.modules():
        if "forward" in module.__dict__ or any(True for _ in module.parameters()):
            continue
        forward = type(module).forward
        inner = getattr(forward, "__wrapped__", None)
        # torch's grad-mode decorators (no_grad, enable_grad, inference_mode) live in this file.
        code = getattr(forward, "__code__", None)
        if inner is not None and code is not None and code.co_filename.endswith("_contextlib.py"):
            module.forward = types.MethodType(inner, module)


def _logits_of(output: Any) -> torch.Tensor:
    """The logits in a stage output: the traced last stage returns the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"cannot find logits in the last stage's output of type {type(output).__name__}; the "
        "last stage must end at lm_head."
    )
