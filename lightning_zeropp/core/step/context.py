"""Context parallelism's batch: each sequence split over the CP group, positions kept global.

The `cp` ranks of one data-parallel group read the same batch; each keeps two of its `2 cp`
equal chunks along the sequence, chunks `r` and `2 cp - 1 - r` on CP rank `r` (causal load
balance: under a causal mask every rank then attends over as many query-key pairs). Splitting
happens once per step, before the micro-batches are cut, so every micro-batch is split alike.

What the model computes from positions keeps the global ones: `position_ids` are split with the
sequence (or made, global, for a forward that takes them); a `labels` keyword is shifted on the
whole sequence before the split (HF's convention: the pair straddling a shard boundary stays),
and given as `shift_labels` too, so an HF loss does not shift it again; a 2-D `attention_mask`
whose rows are right-padded becomes a mask of ones (with causal attention no real token sees a
later pad, and pads carry no label; HF would read global position_ids without a mask as packed
documents); left padding, holes and packed documents become the 4-D mask over all keys one
process's model would build (`core.step.context_masks`). Positions a model makes itself
(`torch.arange` into an embedding, a table sliced `[:T]`) are made global by
`core.step.context_attention` while the stages run.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_zeropp.core.step.context_masks import plain_rows, row_mask

__all__ = ["ContextSplit", "attention_refusal", "takes_positions"]

IGNORE = -100  # the label of a position with no target (torch's and HF's ignore_index)
SPLIT_KEYS = ("labels", "shift_labels", "position_ids", "attention_mask")


class ContextSplit:
    """This rank's part of every sequence of a batch, for CP rank `rank` of `size`."""

    def __init__(self, size: int, rank: int, model: nn.Module) -> None:
        self.size, self.rank = size, rank
        params = inspect.signature(_called(model).forward).parameters
        self.takes_positions = takes_positions(model)
        self.takes_mask = "attention_mask" in params
        self.names = {name: i for i, name in enumerate(params)}
        self.length = 0  # the global sequence length of the current batch
        self.positions = torch.zeros(0, dtype=torch.long)  # its local tokens' global positions
        self.order = torch.zeros(0, dtype=torch.long)  # gathered row of each global position
        # set by the engine: its stages are traced (a graph made with the example's mask form)
        self.traced = False

    # ------------------------------------------------------------------ positions
    def local_positions(self, rank: int, length: int) -> torch.Tensor:
        """Global positions of CP rank `rank`'s tokens: chunks rank and 2 cp - 1 - rank."""
        chunk = length // (2 * self.size)
        first = torch.arange(rank * chunk, (rank + 1) * chunk)
        last = 2 * self.size - 1 - rank
        return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk)])

    def check_length(self, length: int) -> None:
        """A sequence of `length` tokens splits into 2 cp equal chunks, or is refused."""
        if length % (2 * self.size):
            raise ValueError(
                f"the sequence length {length} does not split into 2 x cp_size = "
                f"{2 * self.size} equal chunks (context parallelism gives each of the "
                f"{self.size} CP ranks two chunks, for causal load balance); pad every batch to "
                f"a multiple of {2 * self.size} tokens (or use seq_buckets that are), or "
                "choose another cp_size."
            )

    def set_length(self, length: int) -> None:
        """Prepare the positions and gather order for sequences of `length` tokens."""
        self.check_length(length)
        if length != self.length:
            self.length = length
            self.positions = self.local_positions(self.rank, length)
            every = torch.cat([self.local_positions(r, length) for r in range(self.size)])
            self.order = torch.argsort(every)  # global position p sits at gathered row order[p]

    def set_rank(self, rank: int) -> None:
        """This process's CP rank, once the mesh says it (the example was split as rank 0's:
        only its shapes were read)."""
        self.rank, self.length = rank, 0

    @property
    def local_length(self) -> int:
        return self.length // self.size

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """`x`'s entries at this rank's positions along `dim`."""
        return x.index_select(dim, self.positions.to(x.device))

    # ------------------------------------------------------------------ batches
    def split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """This rank's part of a batch: every tensor of the sequence's length along dim 1
        split, `labels` shifted first, `position_ids` kept global, a right-padded
        `attention_mask` taken out. Raises ValueError naming the problem and its fix."""
        length = self.sequence_length(args, kwargs)
        self.set_length(length)
        kwargs = dict(kwargs)
        special = {k: kwargs.pop(k) for k in SPLIT_KEYS if k in kwargs}
        out_args = tuple(self._split_value(a, length) for a in args)
        out_kwargs = {k: self._split_value(v, length) for k, v in kwargs.items()}
        mask = special.pop("attention_mask", None)
        self._check_mask_shape(mask)
        first = next(v for v in (*out_args, *out_kwargs.values()) if isinstance(v, torch.Tensor))
        rows, device = first.shape[0], first.device
        positions = special.get("position_ids")
        if positions is not None:
            out_kwargs["position_ids"] = self.local(positions)
        elif self.takes_positions:
            out_kwargs["position_ids"] = self.positions.to(device).expand(rows, -1)
        if not plain_rows(mask, positions, length):
            # left padding, holes or packed documents: the mask one process's model builds,
            # over this rank's queries and all keys (`context_masks.row_mask`)
            self._check_row_masks()
            allowed = row_mask(mask, positions, self.positions, length)
            out_kwargs["attention_mask"] = allowed.expand(rows, -1, -1, -1)  # rows of its own
        elif mask is not None or (self.takes_mask and "position_ids" in out_kwargs):
            # A mask of ones, not none: HF reads position_ids that jump (chunks r and
            # 2 cp - 1 - r) without a mask as packed documents, and would mask across the jump.
            dtype = mask.dtype if mask is not None else torch.long
            out_kwargs["attention_mask"] = torch.ones(rows, self.local_length, dtype=dtype)
        labels, shifted = special.get("labels"), special.get("shift_labels")
        if labels is not None or shifted is not None:
            if shifted is None:  # shift on the whole sequence: the boundary pairs stay
                assert labels is not None
                shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], 1)
            shifted = self.local(shifted)
            if labels is not None:  # `shift_labels` alone computes no loss, as in one process
                out_kwargs["labels"] = shifted
            out_kwargs["shift_labels"] = shifted
        if "num_items_in_batch" in out_kwargs:
            # after shift_labels, whether the batch had labels or shift_labels: HF's loss
            # keywords in one order (TRL's SFT forward re-adds them so), which the blocks get
            # and split='call' checks
            out_kwargs["num_items_in_batch"] = out_kwargs.pop("num_items_in_batch")
        # in the forward's own order: a traced stage takes its inputs in the order it was traced
        # with, and the keywords added here must not shift the others
        last = len(self.names)
        out_kwargs = dict(sorted(out_kwargs.items(), key=lambda kv: self.names.get(kv[0], last)))
        return out_args, out_kwargs, self._split_value(target, length)

    def sequence_length(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The batch's sequence length: dim 1 of its first tensor of two or more dimensions."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return value.shape[1]
        raise ValueError(
            "context parallelism (cp_size > 1) cannot find the batch's sequence dimension: "
            "no input is a tensor of shape (batch, sequence, ...); pass the token ids as a "
            "(batch, sequence) tensor."
        )

    def _split_value(self, value: Any, length: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            return self.local(value)
        return value

    def _check_mask_shape(self, mask: Any) -> None:
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                "context parallelism takes an attention_mask of shape (batch, sequence) only "
                f"(got {type(mask).__name__} of shape {getattr(mask, 'shape', None)}); pass the "
                "padding mask as (batch, sequence), or none."
            )

    def _check_row_masks(self) -> None:
        """Rows whose mask is not causal over the whole sequence reach the model as the 4-D
        mask HF models take as given: a model without an `attention_mask` argument (or a traced
        pipeline, whose graph was made with the 2-D one) cannot take it."""
        if not self.takes_mask or self.traced:
            where = "is traced into pipeline stages" if self.traced else "takes no attention_mask"
            raise ValueError(
                "context parallelism (cp_size > 1) takes left-padded rows, holes and packed "
                "documents (position_ids restarting within a row) only through a forward taking "
                f"attention_mask that runs as called, and this model {where}; pad on the "
                "right (tokenizer.padding_side = 'right', label -100 on the pads) with one "
                'document per row, use split="call" (or pp_size=1), or set cp_size=1.'
            )


def _called(model: nn.Module) -> nn.Module:
    """The module whose forward a call of `model` runs: a `torch.compile`d model's original."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else model


def takes_positions(model: nn.Module) -> bool:
    """Whether `model`'s forward takes `position_ids` (by name, or a PEFT model's, passed down)."""
    called = _called(model)
    named = "position_ids" in inspect.signature(called.forward).parameters
    return named or _passes_down(called, "position_ids")


def _rotary_from_positions(model: nn.Module) -> str | None:
    """The class of a module of `model` that turns `position_ids` into rotary angles (HF's
    `*RotaryEmbedding`), if any: it reads the positions it is given, not the tokens' own."""
    for module in model.modules():
        kind = type(module).__name__
        if (
            kind.endswith("RotaryEmbedding")
            and "position_ids" in inspect.signature(module.forward).parameters
        ):
            return kind
    return None


def _passes_down(model: nn.Module, name: str) -> bool:
    """Whether `model` is a PEFT model (`get_base_model()`) whose forward hands its keyword
    arguments down to a base model taking `name`: PEFT's `PeftModelForCausalLM.forward` names
    no `position_ids`, yet passes them on; without them the base model's RoPE would read this
    CP rank's local positions (0 .. T/cp - 1) as its tokens' own."""
    base = getattr(model, "get_base_model", None)
    if not callable(base):
        return False
    params = inspect.signature(model.forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return False
    inner = base()
    return inner is not model and name in inspect.signature(inner.forward).parameters


def attention_refusal(model: nn.Module) -> str | None:
    """Why `model`'s attention cannot run under context parallelism (None when it can): CP
    attention takes over `F.scaled_dot_product_attention` calls, so an HF model must use its
    "sdpa" implementation; and a head that pools each row inside the forward sees this CP
    rank's part of it only."""
    pooled = next((n for m in model.modules() if (n := type(m).__name__).endswith(_POOLING)), None)
    if pooled is not None:
        # (batch, classes) out of the forward: no sequence dimension left to gather, and the
        # row's last non-pad token, which it reads, is on one CP rank
        return (
            f"{pooled} pools each row at its last non-pad token inside its own forward, which "
            "under context parallelism (cp_size > 1) sees one CP rank's part of the sequence "
            "only (that token is on one CP rank): its scores, and a loss over them (TRL's "
            "RewardTrainer), would be wrong. Set cp_size=1 for this model (pp_size or "
            "dp_shard_size for the ranks)."
        )
    rotary = _rotary_from_positions(model)
    if rotary is not None and not takes_positions(model):
        # the model inside would make positions 0 .. T/cp - 1 for this rank's tokens
        return (
            f"{type(model).__name__}.forward takes no position_ids, but {rotary} inside it "
            "computes rotary angles from the positions it is given: under context parallelism "
            "(cp_size > 1) each CP rank's tokens would be rotated as positions 0 .. T/cp - 1 "
            "instead of their own. Name position_ids in your module's forward and pass it to "
            "the model (or hand the library the model itself), or set cp_size=1."
        )
    config = getattr(model, "config", None)
    if (window := _sliding_window(config)) is not None:
        # CP attention builds causal, padding and document masks over whole sequences; a
        # sliding window would silently widen to the whole causal past.
        return (
            f"{type(model).__name__} attends within a sliding window of {window} tokens "
            "(config.sliding_window), which context parallelism (cp_size > 1) does not apply: "
            "its attention would reach the whole causal past. Set cp_size=1 for this model, "
            "or load it with sliding_window=None if it was trained without one."
        )
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if impl is None or impl == "sdpa":
        return None
    return (
        f"{type(model).__name__} uses attn_implementation={impl!r}, which context parallelism "
        "(cp_size > 1) cannot run: CP attention takes over torch's "
        'scaled_dot_product_attention. Load the model with attn_implementation="sdpa", or set '
        "cp_size=1."
    )


# HF heads that pool each row inside the model's forward (at its last non-pad token, or one per
# choice); FSDP2's `FSDP<name>` classes and PEFT's `PeftModelFor<task>` keep the suffix
_POOLING = ("ForSequenceClassification", "ForMultipleChoice")


def _sliding_window(config: Any) -> int | None:
    """The sliding window an HF-style config applies to some layer (None when none does): a
    `layer_types` list naming "sliding_attention", else a `sliding_window` that
    `use_sliding_window` (Qwen2's switch, off by default) does not turn off."""
    window = getattr(config, "sliding_window", None) if config is not None else None
    if not isinstance(window, int) or isinstance(window, bool):
        return None
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None
