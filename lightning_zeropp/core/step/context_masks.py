"""Context parallelism's masks: which keys each of a rank's queries may attend to, decided here
for the runtime (`core.step.context`, `core.step.context_attention`) and the planner
(`plan.context`, which prices the mask `call_mask` makes on the meta device) alike.

Rows that are causal over the whole sequence (no mask, or right padding: with causal attention
no real token sees a later pad, and pads carry label -100) need no mask from the batch: the
attention call's causal mask over the rank's global positions does. Other rows keep their
meaning through a 4-D boolean mask (batch, 1, local queries, all keys), the form an HF model
takes as given, built as one process's model builds it:
- a 2-D `attention_mask` with left padding or holes: causal, and the key is not a pad;
- `position_ids` restarting within a row and no `attention_mask` (packed documents,
  `DataCollatorWithFlattening`): causal, and the key is in the query's document (HF's
  `find_packed_sequence_indices`: a document starts wherever the position does not rise by 1).
`position_ids` stay as given (the documents' own positions, for RoPE).
"""

from __future__ import annotations

import torch

__all__ = ["call_mask", "local_causal", "plain_rows", "row_mask"]


def plain_rows(mask: torch.Tensor | None, positions: torch.Tensor | None, length: int) -> bool:
    """Whether every row is causal over the whole sequence: no mask or a right-padded one (a
    row's ones first), and positions counting 0, 1, ... (or none)."""
    if mask is not None:
        keep = mask.bool()
        if bool((keep[:, 1:] & ~keep[:, :-1]).any()):  # a zero before a one
            return False
    if positions is not None:
        ramp = torch.arange(length, device=positions.device)
        if positions.shape[-1] != length or not bool((positions == ramp).all()):
            return False
    return True


def documents(positions: torch.Tensor) -> torch.Tensor:
    """Each token's document index in its row: a new one wherever the position does not rise
    by one (HF's packed-sequence rule)."""
    first = positions[..., :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def row_mask(
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    queries: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """(rows, 1, len(queries), length) bool, True where query `queries[i]` (a global position)
    may attend to key j: causal, and by the padding `mask` (keys that are pads are not), or
    without one by the documents of `positions`."""
    device = (mask if mask is not None else positions).device  # type: ignore[union-attr]
    q = queries.to(device)
    allowed = (q[:, None] >= torch.arange(length, device=device)[None, :])[None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, :]
    elif positions is not None:
        docs = documents(positions.reshape(-1, positions.shape[-1]))
        allowed = allowed & (docs[:, q, None] == docs[:, None, :])
    return allowed[:, None]


def call_mask(
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    query: torch.Tensor,
    positions: torch.Tensor,
    length: int,
) -> torch.Tensor | None:
    """The (local queries x all `length` keys) mask of a call, additive in the query's dtype,
    from the model's own and the causal mask over the queries' global `positions`. A causal
    mask the model built over its own chunk (`local_causal`) is read as `is_causal` by the
    callers first, which choose the attention path by it."""
    local = positions.shape[0]
    mask = attn_mask
    if mask is not None and mask.shape[-1] != length:
        raise ValueError(
            f"context parallelism needs an attention mask over all {length} keys; the "
            f"model gave one of shape {tuple(mask.shape)} (its own {local} keys only). "
            "Pass the padding as a (batch, sequence) attention_mask and let the model "
            "use is_causal, or set cp_size=1."
        )
    if mask is not None and mask.dtype == torch.bool:
        mask = _additive(mask, query.dtype)
    if is_causal:
        q_pos = positions.to(query.device)
        causal = q_pos[:, None] >= torch.arange(length, device=query.device)[None, :]
        if mask is None:
            mask = _additive(causal, query.dtype)
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
    if mask is not None and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    return mask


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as torch's kernels read it: 0 where True, -inf where False."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill(~allowed, float("-inf"))


def local_causal(mask: torch.Tensor, local: int) -> bool:
    """Whether `mask` is exactly the causal mask over `local` keys (bool: True where allowed;
    additive: 0 where allowed, a large negative number elsewhere)."""
    if mask.shape[-2:] != (local, local):
        return False
    if mask.is_meta:  # the planner's profile (no values): the mask a model builds over its chunk
        return True
    tril = torch.ones(local, local, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return torch.equal(mask, tril.expand_as(mask))
    allowed = mask == 0
    return torch.equal(allowed, tril.expand_as(mask)) and bool((mask[..., ~tril] < -1e4).all())
