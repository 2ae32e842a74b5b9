"""Context parallelism (`cp_size`), priced: what one CP rank of a layout holds, computes and moves.

The runtime (`core.step.context`, `core.step.context_attention`) gives each of the `cp` ranks of a
sequence two of its `2 cp` chunks (chunks r and 2 cp - 1 - r: under a causal mask every rank then
attends over as many query-key pairs), and runs each `scaled_dot_product_attention` call as this
rank's queries against every rank's keys and values: K and V all-gathered along the sequence in
the forward, their gradients reduce-scattered in the backward, with the causal mask over global
positions built as a (local queries x all keys) mask once per micro-batch (every layer's call
shares it). So one CP rank:

- saves for backward what the model saves at `seq_len / cp` tokens, except that each attention
  call keeps the gathered K and V (the whole sequence, K/V heads only), and the first call of a
  micro-batch its mask (additive, in the query's dtype), which the later calls share. On the
  CPU a call with no mask of the model's runs by blocks (`core.step.context_blocks`) and keeps
  neither: just its own tensors and a log-sum-exp row, as at cp 1 (`device_type="cpu"`);
- computes 1/cp of the model's FLOPs (its queries against all keys: the load balance makes the
  ranks equal);
- per attention call and micro-batch, all-gathers its K and V (ring: (cp - 1) hops of its own
  K/V bytes) in the forward (again where a block recomputes) and reduce-scatters their
  gradients in the backward; the runtime waits for each before the attention runs, so neither
  overlaps compute (priced as exposed). Masked: K and V in two calls each way, the gathered
  ones kept for the backward. By blocks (the CPU): one all-gather of K and V stacked in the
  forward, the same again in the backward (nothing gathered is kept), and one reduce-scatter
  of their stacked gradients in the blocks' accumulation dtype (fp32 for a bf16 or fp16 run)
  (`kv_traffic`);
- holds 1/(dp_shard x cp) of its stages' model state: FSDP shards over dp_shard x cp (`fsdp_view`).

All of it is measured the planner's way: the model runs on the meta device at `seq_len / cp`
tokens (`plan.profile`) with its attention calls answered as the runtime's (`_MetaContext`).
The pricing assumes one attention call per block (a decoder layer), of the K/V size the first
call shows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zeropp.core._torch_private import is_fused_attention
from lightning_zeropp.core.settings.layout import ZeroPPLayout
from lightning_zeropp.core.step.context_blocks import blocks_apply
from lightning_zeropp.core.step.context_masks import call_mask, local_causal
from lightning_zeropp.plan.profile import ModelProfile, lm_loss, profile_model

__all__ = ["KVTraffic", "check_length", "fsdp_view", "kv_bytes", "kv_traffic", "rank_profile"]


def fsdp_view(cfg: ZeroPPLayout) -> ZeroPPLayout:
    """The layout as FSDP sees it: sharded over dp_shard x cp (the mesh's flattened axis, its
    ranks consecutive: cp varies fastest), with no CP axis. Model state, weight gathers and
    gradient reductions of a CP layout are those of this view; rows and activations are not."""
    if cfg.cp_size == 1:
        return cfg
    return dataclasses.replace(cfg, dp_shard_size=cfg.dp_shard_size * cfg.cp_size, cp_size=1)


def check_length(seq_len: int, cp: int) -> None:
    """A sequence the runtime can split over `cp` ranks (2 cp equal chunks), or a ValueError."""
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} does not split into 2 x cp_size = {2 * cp} equal chunks; use a "
            f"seq_len that is a multiple of {2 * cp}, or another cp_size."
        )


class _MetaContext(TorchFunctionMode):
    """On the meta device, each fused attention call as the runtime's CP attention runs it.

    Masked (`core.step.context_attention`): the local queries against keys and values of `cp`
    times the local length (new tensors, as the gather makes them), under a (queries x keys)
    mask in the query's dtype: one tensor for every call given the same mask of the model's (or
    none), as the runtime shares it over the layers of a micro-batch.

    By blocks (`blocks`: the runtime's path on the CPU for a call with no mask of the model's,
    `core.step.context_blocks`): the FLOPs of the local queries against all keys, and saved
    what that path saves, the call's own query, keys and values, its output and log-sum-exp.

    Records each call's local K + V bytes (what this rank hands to the all-gathers), whether it
    ran by blocks, and K's element size."""

    def __init__(self, cp: int, blocks: bool = False) -> None:
        super().__init__()
        self.cp, self.blocks = cp, blocks
        self.kv: list[tuple[int, bool, int]] = []
        self._last: tuple[tuple[Any, ...], torch.Tensor] | None = None  # the micro-batch's mask

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if not is_fused_attention(func):
            return func(*args, **kwargs)
        query, key, value, dropout_p, is_causal = (*args, 0.0, False)[:5]
        kv = _nbytes(key) + _nbytes(value)
        gathered = [
            torch.empty((*t.shape[:-2], t.shape[-2] * self.cp, t.shape[-1]), dtype=t.dtype,
                        device=t.device, requires_grad=t.requires_grad)
            for t in (key, value)
        ]  # fmt: skip
        source = kwargs.get("attn_mask")
        if source is not None and not is_causal and local_causal(source, query.shape[-2]):
            source, is_causal = None, True  # the runtime reads it as causal over all keys
        gqa = bool(kwargs.get("enable_gqa")) or query.shape[1] != key.shape[1]
        by_blocks = self.blocks and blocks_apply(query, key, value, source, dropout_p, gqa, "cpu")
        self.kv.append((kv, by_blocks, key.element_size()))
        if by_blocks:
            with torch.no_grad():  # counted as the masked path counts: queries x all keys
                out, lse = func(query, *gathered, 0.0, False, scale=kwargs.get("scale"))
            return _KeepsLocal.apply(query, key, value, out, lse), lse
        if is_causal or source is not None:
            local, length = query.shape[-2], gathered[0].shape[-2]
            made_from = (source, (local, length), query.dtype, query.device)
            last = self._last
            if last is None or last[0][0] is not source or last[0][1:] != made_from[1:]:
                # the runtime's own mask (`call_mask`), made on the meta device: its shape and
                # dtype are what the runtime keeps
                positions = torch.arange(local, device=query.device)
                mask = call_mask(source, is_causal, query, positions, length)
                assert mask is not None  # causal, or the model's own
                last = made_from, mask
                self._last = last
            kwargs["attn_mask"] = last[1]
        return func(query, *gathered, dropout_p, False, **kwargs)


class _KeepsLocal(torch.autograd.Function):
    """The output of an attention by blocks, saving what `core.step.context_blocks` saves."""

    @staticmethod
    def forward(ctx: Any, query: Any, key: Any, value: Any, out: Any, lse: Any) -> Any:  # type: ignore[override]
        ctx.save_for_backward(query, key, value, out, lse)
        return out.view_as(out)  # the saved output itself, as the runtime returns it

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        raise NotImplementedError("a planner's profile runs no backward")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@functools.lru_cache(maxsize=16)
def _loss(cp: int, blocks: bool) -> Any:
    """A loss function object per cp and attention path: `profile_model` caches by its loss
    function, so a CP profile at `seq_len / cp` tokens never answers for a plain profile at
    that length, nor one path's for the other's."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, target)

    return loss


# (model, seq_len, dtype, cp, blocks) -> the first call's K + V bytes, path and element size
_KV: dict[tuple[Any, ...], tuple[int, bool, int]] = {}


def rank_profile(
    model: nn.Module,
    rows: int,
    seq_len: int,
    dtype: torch.dtype | None,
    cp: int,
    device_type: str = "cuda",
) -> ModelProfile:
    """`profile_model` for one CP rank of `cp` (`profile_model` itself when cp is 1): one
    micro-batch of `rows` sequences of `seq_len` tokens, this rank's part of them, its
    attention as the runtime runs it on a `device_type` device (by blocks on the CPU)."""
    if cp == 1:
        return profile_model(model, rows, seq_len, dtype)
    check_length(seq_len, cp)
    blocks = device_type == "cpu"
    mode = _MetaContext(cp, blocks)
    with mode:
        out = profile_model(model, rows, seq_len // cp, dtype, _loss(cp, blocks))
    if mode.kv:  # run now (not cached): its first call is the one-row run's
        _KV[model, seq_len, dtype, cp, blocks] = mode.kv[0]
    return out


def kv_bytes(model: nn.Module, seq_len: int, dtype: torch.dtype | None, cp: int) -> int:
    """Bytes of K and V one CP rank hands to an attention call's all-gathers, per row (0 when
    cp is 1 or the model has no fused attention call)."""
    return kv_traffic(model, seq_len, dtype, cp).share


@dataclasses.dataclass(frozen=True)
class KVTraffic:
    """One block's CP attention traffic per micro-batch and row, on one CP rank.

    `share`: this rank's K + V bytes, what the all-gathers of one forward (or one backward)
    take from it in all; `forward_calls` / `backward_calls`: all-gathers in a forward (2 masked:
    K and V; 1 by blocks: stacked) and in a backward (0 masked: kept; 1 by blocks: gathered
    again); `reduce_calls`: reduce-scatters of their gradients in a backward (2; 1 stacked);
    `reduce_share`: this rank's share of those, in the dtype they are summed in (fp32 by blocks
    for a 2-byte run: the blocks accumulate in fp32 and reduce before the cast)."""

    share: int = 0
    forward_calls: int = 0
    backward_calls: int = 0
    reduce_calls: int = 0
    reduce_share: int = 0


def kv_traffic(
    model: nn.Module, seq_len: int, dtype: torch.dtype | None, cp: int, device_type: str = "cuda"
) -> KVTraffic:
    """`KVTraffic` of the model's first attention call as the runtime runs it on a `device_type`
    device (nothing when cp is 1 or the model has no fused attention call)."""
    if cp == 1:
        return KVTraffic()
    blocks = device_type == "cpu"
    rank_profile(model, 1, seq_len, dtype, cp, device_type)
    share, by_blocks, size = _KV.get((model, seq_len, dtype, cp, blocks), (0, False, 4))
    if not share:
        return KVTraffic()
    if not by_blocks:
        return KVTraffic(share, 2, 0, 2, share)
    return KVTraffic(share, 1, 1, 1, share * 4 // size if size < 4 else share)
