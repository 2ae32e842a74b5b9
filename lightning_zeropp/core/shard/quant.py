"""Block quantization for ZeRO++'s transport: rows of a flat buffer packed to bytes and back.

A collective buffer of FSDP2 is a concatenation of parameter slices ("segments"). `BlockCodec`
packs a [rows, C] tensor into a [rows, W] uint8 tensor, one row per destination or source rank:

- a quantized segment is cut into blocks of `block` elements that never straddle two segments
  (a straddling block lets a large weight's scale zero a small LayerNorm's values); each block
  gets one fp32 scale, absmax / qmax, and symmetric integers in [-qmax, qmax]: INT8 (qmax 127,
  one per byte) or INT4 (qmax 7, two per byte);
- a segment that is not quantized (a 1-D parameter: biases and norms carry little volume and
  much of the error) travels as its raw bytes, as does everything when `bits` is None (the
  full-precision mode that checks layouts).

Quantization is for transport only: callers dequantize to fp32 before any sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["BITS", "Segment", "BlockCodec", "quantize_error_bound"]

BITS = {"int8": 8, "int4": 4}
_QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class Segment:
    """`numel` consecutive elements of a row starting at `offset`; `quantize` False keeps them raw."""

    offset: int
    numel: int
    quantize: bool


class BlockCodec:
    """Packs rows of `width_elements` values laid out as `segments` (see module doc); values that
    are not quantized travel as `dtype` (their own dtype, or a narrower one such as bf16)."""

    def __init__(
        self, segments: Sequence[Segment], dtype: torch.dtype, bits: int | None, block: int
    ) -> None:
        if bits is not None and bits not in _QMAX:
            raise ValueError(f"bits={bits} is not supported; use 8, 4 or None.")
        if block < 1:
            raise ValueError(f"block={block} must be a positive number of elements.")
        self.segments = list(segments)
        self.dtype = dtype
        self.bits = bits
        self.block = block
        self.width_elements = sum(s.numel for s in self.segments)
        self.width_bytes = sum(self._segment_bytes(s) for s in self.segments)

    def _quantized(self, seg: Segment) -> bool:
        return self.bits is not None and seg.quantize

    def _segment_bytes(self, seg: Segment) -> int:
        if not self._quantized(seg):
            return seg.numel * torch.empty((), dtype=self.dtype).element_size()
        payload = seg.numel if self.bits == 8 else math.ceil(seg.numel / 2)
        return payload + 4 * math.ceil(seg.numel / self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, C] values (C = width_elements) -> [rows, width_bytes] uint8."""
        assert x.dim() == 2 and x.shape[1] == self.width_elements, (x.shape, self.width_elements)
        parts = []
        for seg in self.segments:
            values = x[:, seg.offset : seg.offset + seg.numel]
            if not self._quantized(seg):
                parts.append(values.to(self.dtype).contiguous().view(torch.uint8))
                continue
            payload, scales = self._quantize(values)
            parts.append(payload)
            parts.append(scales.view(torch.uint8))
        return torch.cat(parts, dim=1) if parts else x.new_empty((x.shape[0], 0), dtype=torch.uint8)

    def decode(self, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, width_bytes] uint8 -> [rows, C] fp32 (or written into `out`, any float dtype)."""
        rows = packed.shape[0]
        if out is None:
            out = torch.empty(
                (rows, self.width_elements), dtype=torch.float32, device=packed.device
            )
        at = 0
        for seg in self.segments:
            target = out[:, seg.offset : seg.offset + seg.numel]
            size = self._segment_bytes(seg)
            chunk = packed[:, at : at + size]
            at += size
            if not self._quantized(seg):
                # A fresh copy: a view's byte offset need not suit a wider element.
                target.copy_(chunk.clone(memory_format=torch.contiguous_format).view(self.dtype))
                continue
            n_payload = size - 4 * math.ceil(seg.numel / self.block)
            scales = (
                chunk[:, n_payload:]
                .clone(memory_format=torch.contiguous_format)
                .view(torch.float32)
            )
            target.copy_(self._dequantize(chunk[:, :n_payload], scales, seg.numel))
        return out

    # ------------------------------------------------------------------ one segment
    def _blocks(self, values: torch.Tensor) -> torch.Tensor:
        """[rows, n] -> [rows, n_blocks, block] fp32, zero-padded at the end."""
        rows, n = values.shape
        n_blocks = math.ceil(n / self.block)
        padded = values.new_zeros((rows, n_blocks * self.block), dtype=torch.float32)
        padded[:, :n] = values
        return padded.view(rows, n_blocks, self.block)

    def _quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.bits is not None
        qmax = _QMAX[self.bits]
        rows, n = values.shape
        blocks = self._blocks(values)
        scales = blocks.abs().amax(dim=2) / qmax
        # An all-zero block keeps scale 0 on the wire (it decodes to zeros); divide by 1 instead.
        q = torch.round(blocks / torch.where(scales > 0, scales, 1.0).unsqueeze(2))
        q = q.clamp_(-qmax, qmax).view(rows, -1)[:, :n]
        if self.bits == 8:
            return q.to(torch.int8).view(torch.uint8), scales
        nibbles = (q + 8).to(torch.uint8)  # 1..15
        if n % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((rows, 1), 8)], dim=1)
        return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales

    def _dequantize(self, payload: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        rows = payload.shape[0]
        if self.bits == 8:
            q = payload.contiguous().view(torch.int8).to(torch.float32)
        else:
            low = (payload & 0x0F).to(torch.float32) - 8
            high = (payload >> 4).to(torch.float32) - 8
            q = torch.stack([low, high], dim=2).view(rows, -1)[:, :n]
        n_blocks = scales.shape[1]
        padded = q.new_zeros((rows, n_blocks * self.block))
        padded[:, :n] = q
        return (padded.view(rows, n_blocks, self.block) * scales.unsqueeze(2)).view(rows, -1)[:, :n]


def quantize_error_bound(values: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Largest possible absolute round-trip error per element: half a step of its block."""
    codec = BlockCodec([Segment(0, values.numel(), True)], values.dtype, bits, block)
    blocks = codec._blocks(values.reshape(1, -1))
    step = blocks.abs().amax(dim=2, keepdim=True) / _QMAX[bits]
    return (step / 2).expand_as(blocks).reshape(-1)[: values.numel()]
