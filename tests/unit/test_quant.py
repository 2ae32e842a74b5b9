"""The block codec of ZeRO++'s transport: round-trip error bounds, layout, exactness where raw."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zeropp.core.shard.quant import BlockCodec, Segment, quantize_error_bound


def _heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.randint(0, n, (max(n // 50, 1),), generator=g)] *= 30.0  # outliers
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_round_trip_error_is_within_half_a_step_of_each_block(bits: int, block: int) -> None:
    x = _heavy_tailed(1000)
    codec = BlockCodec([Segment(0, 1000, True)], torch.float32, bits, block)
    back = codec.decode(codec.encode(x.view(1, -1))).view(-1)
    # Independent bound: each block's largest magnitude over qmax, halved (plus fp32 slack).
    qmax = 127 if bits == 8 else 7
    for start in range(0, 1000, block):
        chunk = x[start : start + block]
        step = chunk.abs().max() / qmax
        err = (back[start : start + block] - chunk).abs().max()
        assert err <= step / 2 * (1 + 1e-5) + 1e-7
    assert torch.allclose(quantize_error_bound(x, bits, block), _bounds(x, bits, block))


def _bounds(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    qmax = 127 if bits == 8 else 7
    out = torch.empty_like(x)
    for start in range(0, x.numel(), block):
        out[start : start + block] = x[start : start + block].abs().max() / qmax / 2
    return out


def test_smaller_blocks_err_less_on_outliers() -> None:
    x = _heavy_tailed(4096, seed=3)
    errors = []
    for block in (64, 256, 2048, 4096):
        codec = BlockCodec([Segment(0, 4096, True)], torch.float32, 8, block)
        back = codec.decode(codec.encode(x.view(1, -1))).view(-1)
        errors.append(float((back - x).norm() / x.norm()))
    assert errors == sorted(errors), errors
    assert errors[0] < 0.02


def test_blocks_never_straddle_segments() -> None:
    # A large weight beside a tiny norm scale: a shared block would zero the small values.
    big, small = torch.randn(300) * 100.0, torch.randn(5) * 1e-3 + 1e-3
    x = torch.cat([big, small]).view(1, -1)
    codec = BlockCodec([Segment(0, 300, True), Segment(300, 5, True)], torch.float32, 4, 256)
    back = codec.decode(codec.encode(x)).view(-1)
    rel = (back[300:] - small).abs().max() / small.abs().max()
    assert rel <= 1 / 7 / 2 + 1e-6  # within half an INT4 step of its own block


def test_raw_segments_are_exact_and_sized_by_dtype() -> None:
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    segments = [Segment(0, 32, True), Segment(32, 8, False)]  # a matrix shard, then a bias
    codec = BlockCodec(segments, torch.bfloat16, 8, 16)
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, codec.width_bytes)
    assert codec.width_bytes == 32 + 4 * 2 + 8 * 2  # INT8 payload, 2 fp32 scales, raw bf16
    back = codec.decode(packed)
    assert torch.equal(back[:, 32:], x[:, 32:].float())
    assert not torch.equal(back[:, :32], x[:, :32].float())  # the matrix part was quantized


def test_full_precision_mode_is_exact() -> None:
    x = torch.randn(4, 50)
    codec = BlockCodec([Segment(0, 30, True), Segment(30, 20, True)], torch.float32, None, 8)
    assert codec.width_bytes == 50 * 4
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("n", [1, 2, 3, 17])
def test_segments_smaller_than_a_block_and_odd_int4_lengths(n: int) -> None:
    x = torch.randn(2, n) + 0.5
    codec = BlockCodec([Segment(0, n, True)], torch.float32, 4, 256)
    assert codec.width_bytes == math.ceil(n / 2) + 4
    back = codec.decode(codec.encode(x))
    step = x.abs().amax(dim=1, keepdim=True) / 7
    assert ((back - x).abs() <= step / 2 + 1e-6).all()


def test_zero_block_decodes_to_zero_and_rows_are_independent() -> None:
    x = torch.zeros(2, 64)
    x[1] = torch.linspace(-1, 1, 64)
    codec = BlockCodec([Segment(0, 64, True)], torch.float32, 8, 32)
    back = codec.decode(codec.encode(x))
    assert torch.equal(back[0], torch.zeros(64))
    assert (back[1] - x[1]).abs().max() <= 1 / 127 / 2 + 1e-7
    # A row's scales come from that row only.
    solo = codec.decode(codec.encode(x[1:]))
    assert torch.equal(solo[0], back[1])


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="bits=3"):
        BlockCodec([], torch.float32, 3, 8)
    with pytest.raises(ValueError, match="block=0"):
        BlockCodec([], torch.float32, 8, 0)


def test_a_narrower_wire_dtype_rounds_raw_values_to_it() -> None:
    x = torch.randn(2, 30)
    codec = BlockCodec([Segment(0, 30, False)], torch.bfloat16, None, 8)
    assert codec.width_bytes == 30 * 2
    assert torch.equal(codec.decode(codec.encode(x)), x.to(torch.bfloat16).float())
