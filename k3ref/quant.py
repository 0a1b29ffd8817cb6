"""MXFP4: E2M1 codes, two per byte (low nibble first), one E8M0 exponent per 32 values (section 11.1).

Only K3's routed experts are stored this way (compressed-tensors ``mxfp4-pack-quantized``). Every
dequantised value is exactly representable in BF16 (a 2-bit mantissa times a power of two), so the
reference dequantises to BF16 without loss.
"""
from __future__ import annotations

import torch

GROUP = 32
# E2M1 magnitudes indexed by the low 3 bits of a code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(dtype=torch.float32, device=None) -> torch.Tensor:
    """The 16 code values: codes 0-7 positive, 8-15 their negatives (code 8 is -0.0).

    Built arithmetically on ``device`` (code m = e1 e0 mant: m < 2 is subnormal m/2, else
    2^(e-1) * (1 + mant/2)) so no host-to-device copy happens, which CUDA-graph capture forbids."""
    c = torch.arange(16, device=device, dtype=torch.float32)
    m = torch.remainder(c, 8)
    e, mant = torch.floor(m / 2), torch.remainder(m, 2)
    mag = torch.where(m < 2, m / 2, torch.exp2(e - 1) * (1 + mant / 2))
    return torch.where(c < 8, mag, -mag).to(dtype)


def unpack_e2m1(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 [..., n/2] -> code values [..., n]; the LOW nibble is the even (first) column."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed MXFP4 data must be uint8, got {packed.dtype}")
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)           # [..., n] interleaved lo, hi
    return e2m1_table(dtype, packed.device)[codes]


def e8m0_to_float(scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """E8M0 byte s -> 2^(s - 127). Byte 255 is NaN in the OCP spec; K3 never stores it."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scale.dtype}")
    return torch.exp2(scale.to(torch.float64) - 127.0).to(dtype)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Dequantise one MXFP4 matrix: packed [..., rows, cols/2] uint8, scale [..., rows, cols/32] uint8
    -> [..., rows, cols] in ``dtype`` (exact in bf16/fp32/fp64 for scales in the BF16 exponent range)."""
    cols = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != cols:
        raise ValueError(f"MXFP4 shapes disagree: packed {list(packed.shape)} holds {cols} columns, "
                         f"scale {list(scale.shape)} must be [..., {cols // GROUP}]")
    vals = unpack_e2m1(packed, torch.float32)
    s = e8m0_to_float(scale, torch.float32).repeat_interleave(GROUP, dim=-1)
    return (vals * s).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 quantisation of w [..., rows, cols] (cols % 32 == 0).

    The block exponent is chosen so the block's largest magnitude maps to at most 6 (the E2M1
    maximum): s = ceil(log2(amax / 6)). Used to write realistic random checkpoints; the model itself
    was trained with MXFP4 QAT and ships packed weights."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the column count to be a multiple of {GROUP}, got {w.shape[-1]}")
    w = w.to(torch.float32)
    blocks = w.unflatten(-1, (-1, GROUP))                             # [..., rows, cols/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(e)
    table = e2m1_table(torch.float32, w.device)                       # nearest code (ties to the lower code index)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
    packed = pack_codes(codes.flatten(-2))                            # [..., rows, cols/2]
    scale = (e.squeeze(-1) + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (values 0-15) -> packed bytes [..., n/2], low nibble first."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
