"""Routed experts of Kimi K3's Stable LatentMoE: MXFP4 w1 / w3 -> SiTU-GLU -> w2 -> late routing weight ->
deterministic FP32 combine, in one persistent CuTe DSL kernel for sm_90a.

Replaces k3ref.moe.routed_experts (docs/k3-layer.md section 11, the routed half of the latent MoE; section 10 for the
late weights, section 11.1 for the MXFP4 format):

    for e in T(m):  a = bf16(z W1_e^T), c = bf16(z W3_e^T), h = bf16(SiTU(a, c)), y_e = bf16(h W2_e^T)
    r[m] = bf16( sum_j topk_w[m, j] * fp32(y_{ids[m, j]}) )           (j in slot order 0..15)

with SiTU(a, c) = [4 tanh(a/4) sigmoid(a)] * [25 tanh(c/25)] in FP32. The design, its measurements and the version
table are in docs/kernels/moe_mxfp4_experts.md; what follows is what the code relies on.

Work items. The kernel is persistent: a grid of Q clusters of C = 2 CTAs (TPC pairs: all 66 fit on a 132-SM GPU at
once), one CTA of 16 warps per SM, and cluster q takes work items q, q + Q, ... in a static order. Every CTA first
sorts the M x 16 (token, slot) pairs by expert in shared memory (a counting sort, re-ranked by pair index so that
every CTA of a cluster puts a pair in the same column), or at M = 1 takes the token's 16 pairs as 16 segments
straight from the ids (no sort). The items, by batch bucket (item_kind):

  "rows"    bucket 1 where the row blocks split the w2 tiles evenly (rank16, full width): each expert is NH parts
            of I for FC1 (default_parts: every part gets a cluster); its NH x C CTAs publish their h columns to
            global memory, wait on the segment's counter, and each computes whole w2 tiles over all of I (FC2 split
            by output rows), so y_e leaves FC2 complete.
  "parts"   bucket 1 otherwise (rank8), bucket 2, and the alternate items at buckets 4 / 8: NH parts of I per expert;
            h is exchanged inside the cluster through DSMEM; FC2 over the part's K steps writes fp32 partials, and the
            pair's last part adds them in part order and rounds y_e to bf16 once (the part reduction).
  "passes"  buckets above 2: one item per pass (an expert and <= NT of its pairs), so that a few hot experts spread
            their passes over every cluster. At buckets 4 / 8 the same binary also carries "parts" items with
            ALT_PARTS parts of I and runs them when ALT_PARTS x #passes <= Q (few hot experts); every CTA counts the
            same passes, so the whole grid takes the same branch.

Each item runs FC1 (w13 tiles split over the cluster's CTAs and the CTA's warps, K split S ways where the tiles are
fewer than the warps), SiTU, the h exchange, FC2, and the combine: the 16th arrival of (token, row block) sums the
16 slots' y rows in slot order (acq_rel counters that re-arm themselves, so CUDA-graph replays need no memset).

Weight streams. A lane loads 16 bytes per step (4 MMAs' A fragments) into a register ring of D1 / D2 slots, consumes
the slot (decode) before it issues the slot's refill, and refills the scale word after its last use: the loop carries
no register copies of loads in flight. Each ring is as deep as fits its K steps per unit without a per-step division
(KernelCfg.D1 / D2: K % d == 0 or d % K == 0, d <= 8; rank8 FC1 7, FC2 6). Weights are read with L1::no_allocate, z of the
pass is staged in shared memory with cp.async.

Bytes that must be read (MXFP4 data + E8M0 scales, distinct experts only; MB = 1e6 B) and floors at 4.3 TB/s:

  per expert: w13 2*I*dL/2 * (1 + 1/16), w2 dL*I/2 * (1 + 1/16)
  config      I     per expert   batch 1 (16)        batch 8 (~119)       batch 64 (~610)
  k3_rank16   256   1.462 MB     23.4 MB -> 5.4 us   174 MB -> 40.4 us    892 MB -> 207 us
  k3_rank8    384   2.193 MB     35.1 MB -> 8.2 us   261 MB -> 60.7 us    1338 MB -> 311 us
  full (TP1)  3072  17.55 MB     281 MB -> 65 us     2088 MB -> 486 us    10.7 GB -> 2.49 ms
  Activations (z, h, y workspace, r) add < 8 MB at batch 64 and live in L2.

Layout (prepare_mxfp4_experts, once at load time): weights are tiled in 16-row MMA tiles; for w13 a tile holds 8 w1
rows and the 8 w3 rows of the same outputs (rows g and g+8 of the fragment: a thread owns a and c of an output). For
each (expert, tile, 64-wide K step) the 32 lanes each load 16 contiguous bytes = the A fragments of 4 MMAs (2 MXFP4
blocks x 2 k16 steps); the K index inside a block is permuted identically on the A and B sides, so a lane's B operand
is 16 contiguous bytes of z (or h). One 32-bit word holds 8 codes = one A fragment, in one of two layouts:

  "rot"     (the default) register j of a word is (rotl(w, r) & mask) over one or two pieces (ROT_PIECES): 9 ALU ops
            per word give code * 2^-126 as bf16, and one bf16x2 multiply by 2^(E-1) = 2^126 * scale gives the exact
            weight, so the MMAs accumulate straight into the fp32 accumulator. Needs every E8M0 byte <= 128.
  "nibble"  (prepare_mxfp4_experts falls back to it when a scale byte is > 128) nibble n holds a 3-bit magnitude,
            decoded by a PRMT table lookup, and its bit 3 holds the sign of a *different* code chosen so that
            (word << 4j) & 0x80008000 are the two signs of output register j; the E8M0 scale multiplies the fp32
            partial of each block's two MMAs.

Scales: per (expert, tile, K step) 8 words, word g = bytes (row g, block 0), (row g+8, block 0), (row g, block 1),
(row g+8, block 1).

Numerics: decoded weights are exact bf16; MMAs accumulate in fp32; the power-of-two scales are exact. The nibble
layout treats E8M0 byte 0 as scale 0 (2^-127 is not an fp32 normal; it only matters for all-zero blocks), the rot
layout keeps it exact; 255 (NaN) is not special-cased. a, c, h, y are rounded to bf16 where the reference rounds. The
combine is deterministic (fixed slot order, no float atomics), so the bf16 output is bit-reproducible run to run.
"parts" items sum NH fp32 chains over I / NH before y_e's single rounding: within a bf16 ulp of the whole-I chain.

Contracts: launched with PDL; everything (ids, weights, z) is read after griddepcontrol.wait, because the routing
decides which weights to read. The workspace's counters must start at zero (make_workspace) and stay owned by one
stream at a time. A token may list the same expert twice (both slots are computed and summed). The "rows" items
spin on a counter until all CTAs of an expert arrived, which needs them co-resident: the grid is at most one CTA per
SM, and a PDL dependent launches only after every CTA of this grid ran its trigger.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ._dsl import (PDL, SMEM_PER_CTA_MAX, TVM_FFI, check_tensor, compile_cached, fake_stream, fake_tensor, import_cute,
                   l1_kb, weight_load_atom)

E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# bf16 bytes of the 8 magnitudes (hi = sign/exponent byte, lo = exponent lsb + mantissa byte), little-endian words
_LUT_HI = (0x3F3F3F00, 0x40404040)   # magnitudes 0..3, 4..7
_LUT_LO = (0xC0800000, 0xC0804000)
# nibble n of a stored word carries (bit 3) the sign of code _SIGN_OF_NIBBLE[n]
_SIGN_HOLDER = (3, 7, 2, 6, 1, 5, 0, 4)          # code c -> nibble whose bit 3 holds its sign
_SIGN_OF_NIBBLE = tuple(_SIGN_HOLDER.index(n) for n in range(8))
# nibble n <- (row half hr, kk) : n = 4*(kk//2) + 2*hr + kk%2
_NIB_HR = tuple((n // 2) % 2 for n in range(8))
_NIB_KK = tuple(2 * (n // 4) + n % 2 for n in range(8))

# "rot" layout: a stored word is decoded to its 4 bf16x2 A registers by rotations and masks alone. Register j's
# bits at ROT_S (signs 15/31, e1 e0 m at 8..6 / 24..22) are (rotl(word, r) & mask) over the pieces of ROT_PIECES[j];
# the four images tile ROT_S and the sources tile the 32 bits (a search over all rotation sets: at most three full
# translates of ROT_S are disjoint, so one register needs two pieces; 9 ALU ops per word). The result is
# code * 2^-126 as a bf16 (codes 0.5 are subnormals); one bf16x2 multiply by 2^(E-1) = 2^126 * the E8M0 scale then
# gives the exact dequantised weight, which needs E <= 128 (scale <= 2): prepare_mxfp4_experts falls back to the
# "nibble" layout when a checkpoint has a larger scale.
ROT_S = 0x81C081C0
ROT_PIECES = (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((10, 0x81C081C0),), ((6, 0x80C080C0), (14, 0x01000100)))
ROT_MAX_SCALE = 128
LAYOUTS = ("nibble", "rot")
# target bit (mod 16) -> code bit: sign, e1, e0, m
_ROT_CODE_BIT = {15: 3, 8: 2, 7: 1, 6: 0}

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_M = 64
TOPK = 16
CLUSTER = 2             # CTAs per cluster: TPC pairs, all 66 co-resident on a 132-SM GPU; a grid of 33 clusters
#                         of 4 ran its last cluster as a second wave (rank16 b64 1045 us against 485 at C = 2)
WARPS = 16              # warps per CTA (512 threads: ptxas caps them at 128 registers; one CTA per SM)
RING_DEPTH = 8          # the deepest register ring (16-byte weight loads in flight per lane)
SMALL_BATCH_MAX_MB = 2  # buckets <= 2 split each expert into parts of I ("rows" / "parts" items)
PARTS_MAX_MB = 8        # the largest bucket "parts" items serve: their part counters, below
# "passes" items at buckets 4 / 8 also carry "parts" items with ALT_PARTS parts of I, taken on the device when
# ALT_PARTS x #passes <= Q (few hot experts). Measured against the passes alone (H100 kernel bench): skewed routing
# full b8 272.9 -> 166.8 us, rank16 b8 42.8 -> 38.6; uniform -0.6 to +1.2 % except rank16 b8, +4.3 % (the second
# item loop in the binary; its shared memory was ruled out). The passes alone stay the contender (alt_parts=0).
ALT_PARTS = 2
# Counters in the workspace's MAX_M * 8: the combine's (token * RB + row block < 64 * 2, or < 8 for "rows" at
# bucket 1); the part reduction's (PART_COUNTERS + pair * C + rank < 256 + 128 * 2 at bucket 8); the h exchange's
# of "rows" items (H_COUNTERS + segment, 16 segments at bucket 1: arrivals, then departures). The last two ranges
# overlap, which is harmless: one launch runs one kind of item, every counter is back at 0 when its launch ends
# (the last arrival re-arms it), and launches sharing a workspace run in stream order.
PART_COUNTERS = 256
H_COUNTERS = 320
ITEM_KINDS = ("passes", "parts", "rows")


# ----------------------------------------------------------------------------------------------- host-side layout

@dataclass(frozen=True)
class PreparedExperts:
    """Kernel layout of the routed experts (see module docstring).  All int32, contiguous."""
    w13q: torch.Tensor     # [E, I/8, dL/64, 32, 4]
    w13s: torch.Tensor     # [E, I/8, dL/64, 8]
    w2q: torch.Tensor      # [E, dL/16, I/64, 32, 4]
    w2s: torch.Tensor      # [E, dL/16, I/64, 8]
    layout: str = "rot"    # how a word holds its 8 codes: "rot" (see ROT_PIECES) or "nibble" (PRMT-table decode)

    @property
    def dims(self) -> tuple[int, int, int]:
        E, t1, kb1 = self.w13q.shape[:3]
        return E, 8 * t1, 64 * kb1          # E, I, dL


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] codes 0..15 (low nibble = even column)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _rot_word(nib_codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes in register order (code 2j + h -> half h of A register j) -> int64 words of the rot layout."""
    word = torch.zeros(nib_codes.shape[:-1], dtype=torch.int64, device=nib_codes.device)
    for j, pieces in enumerate(ROT_PIECES):
        for r, mask in pieces:
            for q in range(32):
                if mask >> q & 1:
                    bit = (nib_codes[..., 2 * j + q // 16] >> _ROT_CODE_BIT[q % 16]) & 1
                    word |= bit << ((q - r) % 32)
    return word


def _rot_codes(word: torch.Tensor) -> torch.Tensor:
    """Inverse of _rot_word: int64 words -> [..., 8] codes in register order."""
    codes = torch.zeros(*word.shape, 8, dtype=torch.int64, device=word.device)
    for j, pieces in enumerate(ROT_PIECES):
        for r, mask in pieces:
            for q in range(32):
                if mask >> q & 1:
                    bit = (word >> ((q - r) % 32)) & 1
                    codes[..., 2 * j + q // 16] |= bit << _ROT_CODE_BIT[q % 16]
    return codes


def rot_decode_reference(word: torch.Tensor) -> torch.Tensor:
    """The kernel's rot-layout decode, step for step on int64 (CPU tests): [...] words -> [..., 4] bf16x2 bit
    patterns (code * 2^-126 in each half)."""
    w = word & 0xFFFFFFFF
    outs = []
    for pieces in ROT_PIECES:
        o = torch.zeros_like(w)
        for r, mask in pieces:
            rot = ((w << r) | (w >> ((32 - r) % 32))) & 0xFFFFFFFF if r else w
            o |= rot & mask
        outs.append(o)
    return torch.stack(outs, dim=-1)


def _pack_tiles(codes: torch.Tensor, scales: torch.Tensor, layout: str = "nibble"):
    """codes [E, T, 16, K] uint8 (0..15), scales [E, T, 16, K/32] uint8 -> (q [E,T,K/64,32,4] i32, s [E,T,K/64,8] i32)."""
    E, T, R, K = codes.shape
    assert R == 16 and K % 64 == 0
    KB = K // 64
    c = codes.to(torch.int64).reshape(E, T, 2, 8, KB, 2, 4, 2, 4)        # hr g kb bb t s2 kk
    c = c.permute(0, 1, 4, 3, 6, 5, 7, 2, 8)                              # E T kb g t bb s2 hr kk
    nib_codes = torch.stack([c[..., _NIB_HR[n], _NIB_KK[n]] for n in range(8)], dim=-1)   # [..., 8]
    if layout == "rot":
        word = _rot_word(nib_codes)
    else:
        mag = nib_codes & 7
        sign = nib_codes >> 3
        word = torch.zeros(nib_codes.shape[:-1], dtype=torch.int64, device=codes.device)
        for n in range(8):
            nib = mag[..., n] | (sign[..., _SIGN_OF_NIBBLE[n]] << 3)
            word |= nib << (4 * n)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    q = word.reshape(E, T, KB, 32, 4).contiguous()                       # lane = 4g + t, word = 2bb + s2
    s = scales.to(torch.int64).reshape(E, T, 2, 8, KB, 2)                 # hr g kb bb
    s = s.permute(0, 1, 4, 3, 5, 2)                                       # E T kb g bb hr  (byte = 2bb + hr)
    sw = s[..., 0, 0] | (s[..., 0, 1] << 8) | (s[..., 1, 0] << 16) | (s[..., 1, 1] << 24)
    sw = torch.where(sw >= 2 ** 31, sw - 2 ** 32, sw).to(torch.int32).contiguous()
    return q, sw


def _unpack_tiles(q: torch.Tensor, sw: torch.Tensor, layout: str = "nibble"):
    """Inverse of _pack_tiles: -> codes [E, T, 16, K] uint8, scales [E, T, 16, K/32] uint8."""
    E, T, KB = q.shape[:3]
    w = q.to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(E, T, KB, 8, 4, 2, 2)                                   # kb g t bb s2
    if layout == "rot":
        codes_n = _rot_codes(w)
    else:
        nibs = torch.stack([(w >> (4 * n)) & 0xF for n in range(8)], dim=-1)
        codes_n = torch.empty_like(nibs)
        for n in range(8):
            holder = _SIGN_HOLDER[n]                                      # code n's sign sits in nibble `holder`
            codes_n[..., n] = (nibs[..., n] & 7) | (nibs[..., holder] & 8)
    out = torch.empty(E, T, KB, 8, 4, 2, 2, 2, 4, dtype=torch.int64, device=q.device)     # ... hr kk
    for n in range(8):
        out[..., _NIB_HR[n], _NIB_KK[n]] = codes_n[..., n]
    out = out.permute(0, 1, 7, 3, 2, 5, 4, 6, 8).reshape(E, T, 16, KB * 64)   # E T hr g kb bb t s2 kk
    s = sw.to(torch.int64) & 0xFFFFFFFF
    sb = torch.stack([(s >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(E, T, KB, 8, 2, 2)  # bb hr
    sb = sb.permute(0, 1, 5, 3, 2, 4).reshape(E, T, 16, KB * 2)          # E T hr g kb bb
    return out.to(torch.uint8), sb.to(torch.uint8)


def prepare_mxfp4_experts(w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                          layout: str = "auto") -> PreparedExperts:
    """Checkpoint layout -> kernel layout (run once at load time; CPU or GPU tensors, result on the same device).

    w1/w3_packed [E, I, dL/2] u8, w1/w3_scale [E, I, dL/32] u8, w2_packed [E, dL, I/2] u8, w2_scale [E, dL, I/32] u8.
    layout: "rot", "nibble" or "auto": "rot" when every E8M0 scale byte is <= ROT_MAX_SCALE (the rot decode's
    multiplier 2^(E-1) must be a finite bf16), else "nibble" (see the module docstring).
    """
    if layout not in LAYOUTS + ("auto",):
        raise ValueError(f"layout must be one of {LAYOUTS + ('auto',)}, got {layout!r}")
    for n, t in [("w1_packed", w1_packed), ("w1_scale", w1_scale), ("w3_packed", w3_packed),
                 ("w3_scale", w3_scale), ("w2_packed", w2_packed), ("w2_scale", w2_scale)]:
        check_tensor(n, t, dtype=torch.uint8, contiguous=False, align=0)
        if t.dim() != 3:
            raise ValueError(f"{n}: expected 3 dims, got {list(t.shape)}")
    E, I, half = w1_packed.shape
    dL = 2 * half
    if I % 64 or dL % 64:
        raise ValueError(f"I={I} and dL={dL} must be multiples of 64")
    for n, t, shp in [("w1_scale", w1_scale, (E, I, dL // 32)), ("w3_packed", w3_packed, (E, I, dL // 2)),
                      ("w3_scale", w3_scale, (E, I, dL // 32)), ("w2_packed", w2_packed, (E, dL, I // 2)),
                      ("w2_scale", w2_scale, (E, dL, I // 32))]:
        if tuple(t.shape) != shp:
            raise ValueError(f"{n}: expected shape {list(shp)}, got {list(t.shape)}")
    max_scale = max(int(t.max()) for t in (w1_scale, w3_scale, w2_scale))
    if layout == "auto":
        layout = "rot" if max_scale <= ROT_MAX_SCALE else "nibble"
    elif layout == "rot" and max_scale > ROT_MAX_SCALE:
        raise ValueError(f"layout 'rot' needs every E8M0 scale byte <= {ROT_MAX_SCALE} (scale <= 2), got {max_scale}: "
                         f"use layout='nibble' or 'auto'")
    # chunks of experts keep the int64 temporaries small, and each chunk lands in the preallocated result, so the
    # peak is the result plus one chunk's temporaries (at full width the result alone is ~30 GB per layer); runs on
    # the tensors' device (GPU: ~1 s for K3)
    outs = None
    step = max(1, (1 << 24) // (I * dL))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        n = e1 - e0
        c1 = _unpack_codes(w1_packed[e0:e1]).reshape(n, I // 8, 8, dL)
        c3 = _unpack_codes(w3_packed[e0:e1]).reshape(n, I // 8, 8, dL)
        sc1 = w1_scale[e0:e1].reshape(n, I // 8, 8, dL // 32)
        sc3 = w3_scale[e0:e1].reshape(n, I // 8, 8, dL // 32)
        gate_up = _pack_tiles(torch.cat([c1, c3], dim=2), torch.cat([sc1, sc3], dim=2), layout)    # (words, scales)
        del c1, c3
        c2 = _unpack_codes(w2_packed[e0:e1]).reshape(n, dL // 16, 16, I)
        sc2 = w2_scale[e0:e1].reshape(n, dL // 16, 16, I // 32)
        down = _pack_tiles(c2, sc2, layout)
        del c2
        chunk = gate_up + down
        if outs is None:
            outs = [torch.empty((E,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device) for t in chunk]
        for o, t in zip(outs, chunk):
            o[e0:e1].copy_(t)
    return PreparedExperts(*outs, layout=layout)


def _dequant_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K] and E8M0 bytes [..., K/32] -> exact float32 weights [..., K]."""
    codes = codes.to(torch.int64)
    mag = torch.tensor(E2M1_MAG, dtype=torch.float32, device=codes.device)[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    return val * torch.exp2(scale.to(torch.float32) - 127.0).repeat_interleave(32, dim=-1)


def dequant_checkpoint(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact MXFP4 dequant of a checkpoint tensor [..., R, K/2] + [..., R, K/32] -> float32 [..., R, K]."""
    return _dequant_codes(_unpack_codes(packed), scale)


def dequant_prepared(prep: PreparedExperts):
    """Exact float32 dequant of the kernel layout -> (w1 [E,I,dL], w3 [E,I,dL], w2 [E,dL,I]) (for tests)."""
    E, I, dL = prep.dims
    c13, sc13 = _unpack_tiles(prep.w13q, prep.w13s, prep.layout)          # [E, I/8, 16, dL]
    c2, s2 = _unpack_tiles(prep.w2q, prep.w2s, prep.layout)              # [E, dL/16, 16, I]
    w13 = _dequant_codes(c13, sc13)
    w1 = w13[:, :, :8].reshape(E, I, dL)
    w3 = w13[:, :, 8:].reshape(E, I, dL)
    w2 = _dequant_codes(c2, s2).reshape(E, dL, I)
    return w1, w3, w2


def expert_bytes(dL: int, I: int) -> int:
    """MXFP4 data + E8M0 scale bytes of one expert (w1, w3, w2)."""
    return 3 * (I * dL // 2 + I * dL // 32)


def distinct_expert_bytes(topk_ids: torch.Tensor, cfg_dims) -> int:
    """Bytes of expert weights that must be read for this routing: distinct experts x expert_bytes.

    cfg_dims: (dL, I) or a K3Config (uses routed_expert_hidden_size and expert_intermediate).  CPU ok; syncs.
    """
    if hasattr(cfg_dims, "routed_expert_hidden_size"):
        dL, I = cfg_dims.routed_expert_hidden_size, cfg_dims.expert_intermediate
    else:
        dL, I = cfg_dims
    n = int(torch.unique(topk_ids.reshape(-1)).numel())
    return n * expert_bytes(dL, I)


# ----------------------------------------------------------------------------------------------- configuration

def m_bucket(M: int) -> int:
    for b in M_BUCKETS:
        if M <= b:
            return b
    raise ValueError(f"batch M={M} exceeds {MAX_M}")


def default_parts(I: int, MB: int, nsm: int = 132) -> int:
    """Parts of I per expert at buckets <= 2: the most parts (each a multiple of 64 outputs) whose work items, one
    per part of each of the bucket's 16 MB experts, all get a cluster at once: rank16 (I = 256) b1 4 (64 clusters
    of 2 = 128 SMs), b2 2; rank8 (I = 384) b1 3, b2 2; full width b1 4."""
    best = 1
    for p in range(1, I // 64 + 1):
        if I % (64 * p) == 0 and p * TOPK * MB * CLUSTER <= nsm:
            best = p
    return best


def item_kind(MB: int, I: int, dL: int, nsm: int = 132) -> str:
    """The work items at batch bucket MB (module docstring): "passes" above bucket 2; at bucket 1 "rows" where its
    NH x C row blocks split the dL / 16 w2 tiles evenly (rank16, full width), else "parts" (rank8, bucket 2).

    Measured against "parts" at bucket 1 (MoE half in the layer, H200): rank16 58.3 -> 56.7, 57.9 -> 56.6 and
    58.8 -> 58.0 us in three runs. At bucket 2 the kernel gained (26.8 -> 25.5 us) but the layer did not (+0.4 /
    +0.6 us, inside the 1.0 us two rows of one kernel differed by); rank8's uneven row blocks gained 0.5 us in the
    MoE half and nothing at the tail's end."""
    if MB > SMALL_BATCH_MAX_MB:
        return "passes"
    if MB == 1 and (dL // 16) % (default_parts(I, MB, nsm) * CLUSTER) == 0:
        return "rows"
    return "parts"


@dataclass(frozen=True)
class KernelCfg:
    """One compile key (compile_key builds it; the properties derive the tiling)."""
    E: int
    dL: int
    I: int
    MB: int          # batch bucket (max M this binary accepts)
    items: str       # ITEM_KINDS: "passes", "parts" or "rows" (module docstring)
    parts: int = 1   # "parts" / "rows": work items per expert (parts of I); "passes": 1
    alt_parts: int = 0  # "passes" at buckets 4 / 8: the alternate "parts" items' parts of I (0: passes only)
    layout: str = "rot"  # the PreparedExperts layout it decodes
    nsm: int = 132
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    C = CLUSTER
    W = WARPS
    D = RING_DEPTH

    def __post_init__(self):
        if self.items not in ITEM_KINDS:
            raise ValueError(f"items must be one of {ITEM_KINDS}, got {self.items!r}")
        if self.dL % 64 or self.I % 64:
            raise ValueError(f"dL={self.dL} and I={self.I} must be multiples of 64")
        if self.parts < 1 or self.I % (64 * self.parts) or (self.items == "passes" and self.parts != 1):
            raise ValueError(f"parts={self.parts}: 'parts' / 'rows' items split I = {self.I} into parts of a "
                             f"multiple of 64, 'passes' items take parts=1 (items={self.items!r})")
        if self.IH % (8 * self.C) or (self.dL // 16) % self.C or self.IH % 64:
            raise ValueError(f"cluster size {self.C} does not divide the tiles (I={self.I}, dL={self.dL}, "
                             f"I/{self.NH} per work item)")
        if self.E > 1024 * 4:
            raise ValueError(f"E={self.E} too large for the in-CTA routing sort (at most 4096)")
        if self.NKB1 % self.S:
            raise ValueError(f"the FC1 K split S={self.S} does not divide the {self.NKB1} K steps")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.items == "passes" and self.MB <= SMALL_BATCH_MAX_MB:
            raise ValueError(f"'passes' items serve batch buckets > {SMALL_BATCH_MAX_MB}, got MB={self.MB}")
        if self.items == "parts" and self.MB > PARTS_MAX_MB:
            raise ValueError(f"'parts' items serve batch buckets <= {PARTS_MAX_MB} (their part counters), "
                             f"got MB={self.MB}")
        if self.items == "rows":
            if self.MB != 1 or (self.dL // 16) % self.RB:
                raise ValueError(f"'rows' items serve batch bucket 1 where the {self.NH * self.C} row blocks split "
                                 f"the {self.dL // 16} w2 tiles evenly, got MB={self.MB}, parts={self.parts}")
            if self.Q < self.NH:
                # the spin waits for all NH items of a segment at once: a cluster holding two of them would wait
                # on itself. Q >= NH also keeps the grid (Q C <= nsm CTAs, one per SM) co-resident.
                raise ValueError(f"'rows' items need a cluster per part of an expert: Q = {self.Q} clusters < "
                                 f"NH = {self.NH} parts (nsm = {self.nsm})")
        if self.alt_parts and (self.items != "passes" or self.alt_parts < 2 or self.MB > PARTS_MAX_MB):
            raise ValueError(f"alt_parts={self.alt_parts}: the alternate 'parts' items need 'passes' items, >= 2 "
                             f"parts and batch bucket <= {PARTS_MAX_MB}; got items={self.items!r}, MB={self.MB}")

    @property
    def route_direct(self) -> bool:
        """Batch bucket 1: the token's 16 pairs are the segments, read from the ids without the counting sort (a
        repeated expert becomes two segments of one pair). Which CTA computes a segment does not change its
        arithmetic, and the reductions sum in part and slot order, so the output is the sorted routing's."""
        return self.MB == 1

    def _fit(self, K: int) -> int:
        """The deepest ring <= D that step_split divides once per ring turn or never (K % d == 0 or d % K == 0).
        Per-step divisions were 478 of rank8 b64's 1063 FC1 loop instructions per 8 steps; fitted, the loops run
        98.6 / 102 SASS instructions per step instead of 133 / 147 (rank8 b64 633 -> 518 us, b8 119 -> 92)."""
        return next(d for d in range(self.D, 0, -1) if K % d == 0 or d % K == 0)

    @property
    def D1(self):           # FC1's ring depth (K steps per unit: KS1)
        return self._fit(self.KS1)

    @property
    def D2(self):           # FC2's ring depth (K steps per work item: NKB2H)
        return self._fit(self.NKB2H)

    @property
    def NH(self):           # work items per expert (parts of I)
        return self.parts

    @property
    def IH(self):           # intermediate outputs per work item
        return self.I // self.NH

    @property
    def T1(self):           # FC1 tiles (16 rows = 8 outputs) per CTA
        return self.IH // (8 * self.C)

    @property
    def S(self):            # FC1 K-split so that T1 * S is a multiple of W
        return self.W // math.gcd(self.T1, self.W)

    @property
    def U1(self):
        return self.T1 * self.S // self.W

    @property
    def NKB1(self):
        return self.dL // 64

    @property
    def KS1(self):
        return self.NKB1 // self.S

    @property
    def RB(self):           # row blocks of w2 (and of y, the combine's chunks): one per CTA of an expert's item(s)
        return self.NH * self.C if self.items == "rows" else self.C

    @property
    def T2(self):           # w2 tiles (16 rows) per CTA (RB divides the dL / 16 tiles: __post_init__)
        return self.dL // 16 // self.RB

    @property
    def U2(self):
        return -(-self.T2 // self.W)

    @property
    def NKB2(self):         # 64-wide K steps of a whole w2 row (the stride of the w2 stream's tiles)
        return self.I // 64

    @property
    def NKB2H(self):        # FC2 K steps of one work item ("parts": its part's; "rows": all, K = I)
        return self.I // 64 if self.items == "rows" else self.IH // 64

    @property
    def GMAX(self):         # 8-column MMA groups per pass
        return 1 if self.MB <= 8 else 2

    @property
    def NT(self):           # pairs per pass
        return 8 * self.GMAX

    @property
    def PMAX(self):
        return TOPK * self.MB

    @functools.cached_property       # (computed once per key: Q, regions and the host's workspace views read it)
    def alt(self) -> "KernelCfg | None":    # the alternate "parts" items of a "passes" key
        if not self.alt_parts:
            return None
        return dataclasses.replace(self, items="parts", parts=self.alt_parts, alt_parts=0)

    @property
    def Q(self):            # clusters in the grid
        if self.alt_parts:
            return self.alt.Q   # >= the passes' own (NH x PMAX >= PMAX): their items stride over the same grid
        if self.items == "passes":
            return max(1, min(self.PMAX, self.nsm // self.C))
        return max(1, min(self.NH * self.PMAX, self.nsm // self.C))

    @property
    def HW(self):           # h row stride in 32-bit words (64 B pad: conflict-free 16 B loads); "rows": all of I
        return (self.I if self.items == "rows" else self.IH) // 2 + 16

    @property
    def ZW(self):           # staged z row stride in 32-bit words (64 B pad: conflict-free 16 B loads)
        return self.dL // 2 + 16

    @property
    def threads(self):
        return 32 * self.W

    # shared memory carve-up (bytes, all 16-aligned)
    @property
    def n_part(self):       # K-split partials (fp32 words)
        return self.T1 * self.S * self.GMAX * 32 * 4 if self.S > 1 else 4

    @property
    def n_stage(self):      # this CTA's h columns (int32 words)
        return self.NT * (self.IH // self.C) // 2

    @property
    def n_hz(self):         # the pass's z rows are staged in the h region (z is only read in FC1, h only written
        #                     after cluster barrier A, i.e. after every CTA of the cluster finished FC1)
        return max(self.NT * self.HW, self.NT * self.ZW)

    @property
    def regions(self) -> tuple[int, int, int]:
        """(n_hz, n_stage, n_part): the item loops' shared-memory regions, each the larger of the passes' and the
        alternate items' (one branch runs per launch, so they share the same bytes)."""
        own = (self.n_hz, self.n_stage, self.n_part)
        if not self.alt_parts:
            return own
        a = self.alt
        return tuple(max(x, y) for x, y in zip(own, (a.n_hz, a.n_stage, a.n_part)))

    @property
    def smem_bytes(self):
        n_hz, n_stage, n_part = self.regions
        sizes = [4 * self.E, 4 * self.PMAX, 4 * (self.PMAX + 4),
                 4 * self.PMAX, 4 * self.PMAX, 4 * self.PMAX, 4 * 64, 4 * n_hz, 4 * n_stage,
                 4 * n_part]
        return sum(-(-b // 16) * 16 for b in sizes) + 256

    @property
    def l1_kb(self):
        """The L1 the driver's carve-out leaves beside one CTA per SM. The in-flight weight loads (16 warps x 32
        lanes x 7-8 x 16 B = 56-64 KB per SM) land there: at 28 KB of L1 rank8 b64 lost 1.2-1.9 %, so a change
        that takes a key one carve-out step up is measured first (tests/compile pins each key's L1)."""
        return l1_kb(self.smem_bytes)


# ----------------------------------------------------------------------------------------------- the kernel

def _build_kernel_class():
    cutlass, cute = import_cute()
    from cutlass import Float32, Int32, BFloat16, const_expr
    from cutlass.cutlass_dsl import T
    from cutlass._mlir.dialects import llvm

    def _i(x):
        return Int32(x).ir_value()

    def prmt(a, b, sel):
        return Int32(llvm.inline_asm(T.i32(), [_i(a), _i(b), _i(sel)], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                     has_side_effects=False, is_align_stack=False,
                                     asm_dialect=llvm.AsmDialect.AD_ATT))

    def mma(a, b0, b1, c):
        """mma.sync m16n8k16 bf16 -> fp32; a: 4 x i32 (bf16x2), b0/b1: i32, c: 4 x f32."""
        st = llvm.StructType.get_literal([T.f32()] * 4)
        r = llvm.inline_asm(
            st, [_i(a[0]), _i(a[1]), _i(a[2]), _i(a[3]), _i(b0), _i(b1)] + [Float32(x).ir_value() for x in c],
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(4)]

    def st_cluster_v4(local_addr, rank, v):
        llvm.inline_asm(None, [_i(local_addr), _i(rank), _i(v[0]), _i(v[1]), _i(v[2]), _i(v[3])],
                        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, $0, $1;\n"
                        "st.shared::cluster.v4.b32 [ra], {$2, $3, $4, $5};\n}",
                        "r,r,r,r,r,r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    def expert_ptr(m, ex, bytes_per_expert, align):
        """Int32 pointer to expert ``ex``'s slice of ``m``: 64-bit byte arithmetic (at full width w13 is 9.9 GB,
        past the reach of a 32-bit element index), alignment restated."""
        addr = m.iterator.toint() + cutlass.Int64(ex) * bytes_per_expert
        return cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=align)

    def decode8(w, lut):
        """nibble layout: 8 stored codes -> 4 bf16x2 A registers (see module docstring for the bit layout)."""
        m = w & 0x77777777
        mh = (m >> 16) & 0xFFFF
        hA = prmt(lut[0], lut[1], m)
        lA = prmt(lut[2], lut[3], m)
        hB = prmt(lut[0], lut[1], mh)
        lB = prmt(lut[2], lut[3], mh)
        sm = Int32(-2147450880)     # 0x80008000
        o0 = prmt(lA, hA, 0x5140) | (w & sm)
        o1 = prmt(lA, hA, 0x7362) | ((w << 4) & sm)
        o2 = prmt(lB, hB, 0x5140) | ((w << 8) & sm)
        o3 = prmt(lB, hB, 0x7362) | ((w << 12) & sm)
        return [o0, o1, o2, o3]

    def shf_rot(x, r):
        return Int32(llvm.inline_asm(T.i32(), [_i(x), _i(x)], f"shf.l.wrap.b32 $0, $1, $2, {r};", "=r,r,r",
                                     has_side_effects=False, is_align_stack=False,
                                     asm_dialect=llvm.AsmDialect.AD_ATT))

    def mul_bf16x2(a, b):
        return Int32(llvm.inline_asm(T.i32(), [_i(a), _i(b)], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r",
                                     has_side_effects=False, is_align_stack=False,
                                     asm_dialect=llvm.AsmDialect.AD_ATT))

    def decode_rot(w):
        """rot layout: 8 stored codes -> 4 bf16x2 A registers holding code * 2^-126 (ROT_PIECES): 9 ALU ops."""
        outs = []
        for pieces in ROT_PIECES:
            o = None
            for r, mask in reversed(pieces):
                v = (w if r == 0 else shf_rot(w, r)) & Int32(mask - (1 << 32) if mask >= 1 << 31 else mask)
                o = v if o is None else o | v
            outs.append(o)
        return outs

    def rot_multiplier(sw, byte):
        """E8M0 byte ``byte`` of the scale word -> bf16x2 2^(E-1) in both halves, i.e. 2^126 * scale: the byte
        moved to bits 0-7 (PRMT with a zero register), then one IMAD: E * 0x00800080 + (126 << 7) * 0x00010001.
        E <= ROT_MAX_SCALE keeps it a finite bf16 (prepare_mxfp4_experts)."""
        e = prmt(sw, Int32(0), 0x4440 + byte)
        return e * Int32(0x00800080) + Int32(0x3F003F00)

    def scale_f32(sw, j):
        """nibble layout: E8M0 byte j of the scale word -> fp32 2^(s-127) (bits s << 23)."""
        if const_expr(j == 3):
            bits = (sw >> 1) & 0x7F800000
        else:
            bits = (sw << (23 - 8 * j)) & 0x7F800000
        return bits.bitcast(Float32) if hasattr(bits, "bitcast") else Int32(bits).bitcast(Float32)

    @cute.jit
    def last_arrival(mCnt, idx, arrivals: cutlass.Constexpr):
        """One acq_rel gpu-scope arrival on counter idx: True for the arrivals-th of this launch, which resets the
        counter to 0 for the next launch / graph replay (no memset between replays)."""
        old = cute.arch.atomic_add(mCnt.iterator + idx, Int32(1), sem="acq_rel", scope="gpu")
        last = old == arrivals - 1
        if last:
            mCnt[idx] = Int32(0)
        return last

    def fc1_row(c, warp, t1_base, s_):
        """16-byte-row index (per lane: * 32 + lane) of FC1 step s_ of this warp: unit uu = warp + W*i, i = s_ // KS1
        (tile uu // S, K part uu % S), K step s_ - i*KS1 within the part."""
        i_ = s_ // c.KS1
        uu_ = warp + c.W * i_
        return (t1_base + uu_ // c.S) * c.NKB1 + (uu_ % c.S) * c.KS1 + (s_ - i_ * c.KS1)

    def fc2_row(c, warp, t2_base, s_, koff=0):
        """The same for FC2 step s_: tile warp + W*i (clamped to the last tile; its results are not stored). A work
        item takes NKB2H of a tile's NKB2 K steps, from step koff (a part's; else all of them from 0)."""
        i_ = s_ // c.NKB2H
        return (t2_base + cutlass.min(warp + c.W * i_, c.T2 - 1)) * c.NKB2 + koff + (s_ - i_ * c.NKB2H)

    def load_slot(c, wld, eWq, eWs, row_, lane, g, ringW, ringS, d, scale=True):
        """Fill ring slot d from 16-byte weight row row_: one 16-byte load per lane (L1::no_allocate) and, when
        ``scale``, the slot's E8M0 word (inside the loops it is refilled later, after its last use)."""
        cute.copy(wld, eWq[row_ * 32 + lane, None], ringW[d, None])
        if const_expr(scale):
            ringS[d] = eWs[row_ * 8 + g]

    def fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, NS2, lane, g, ringW, ringS):
        """FC2's first ring turn: slots d < min(D2, NS2) from the warp's first steps."""
        for d in range(min(c.D2, NS2)):      # trace-time constants (helpers are not preprocessed)
            row_ = fc2_row(c, warp, t2_base, d, koff)
            load_slot(c, wld, eW2q, eW2s, row_, lane, g, ringW, ringS, d)

    def consume_slot(c, lut, wv, sv):
        """Decode a ring slot's words and scales before its refill is issued, so the slot's old values are dead
        when the refill lands and the ring needs no register copies at the loop's back edge. The rot layout returns
        the A registers already multiplied by their block's 2^126 * scale (word w is k16 half w % 2 of block w // 2;
        register j is row g for even j, g + 8 for odd j), and no separate scale factors."""
        if const_expr(c.layout == "rot"):
            mult = [rot_multiplier(sv, b) for b in range(4)]       # byte 2 * bb + hr
            return [[mul_bf16x2(o, mult[2 * (w // 2) + j % 2]) for j, o in enumerate(decode_rot(wv[w]))]
                    for w in range(4)], []
        return [decode8(wv[j], lut) for j in range(4)], [scale_f32(sv, j) for j in range(4)]

    def mma_block_any(c, a, bv, sf, bb, acc, gi):
        """The two k16 MMAs of MXFP4 block bb into acc: straight into acc with pre-scaled A registers (rot layout),
        or through a fresh fp32 partial and its scale factors (nibble layout)."""
        if const_expr(c.layout == "rot"):
            for h in range(2):
                r = mma(a[2 * bb + h], bv[2 * h], bv[2 * h + 1], [acc[gi * 4 + x] for x in range(4)])
                for x in range(4):
                    acc[gi * 4 + x] = r[x]
        else:
            mma_block_scaled(a, bv, sf[2 * bb], sf[2 * bb + 1], bb, acc, gi)

    def step_split(s0, d, K, D):
        """(i, k) = divmod(s0 + d, K) for s0 a multiple of D and d < D a trace-time constant, with one division per
        D steps (the compiler shares s0 // K between the D unrolled steps) or none, where K and D allow it."""
        if const_expr(K % D == 0):
            i = s0 // K
            return i, s0 - i * K + d
        if const_expr(D % K == 0):
            return s0 // K + d // K, d % K
        i = (s0 + d) // K
        return i, s0 + d - i * K

    def mma_block_scaled(a, bv, fg, fg8, bb, acc, gi):
        """nibble layout: the two k16 MMAs of block bb (fresh fp32 partial), then acc += partial * the block's two
        scale factors (rows g and g+8)."""
        zero = [Float32(0.0)] * 4
        tmp = mma(a[2 * bb], bv[0], bv[1], zero)
        tmp = mma(a[2 * bb + 1], bv[2], bv[3], tmp)
        acc[gi * 4 + 0] = acc[gi * 4 + 0] + tmp[0] * fg
        acc[gi * 4 + 1] = acc[gi * 4 + 1] + tmp[1] * fg
        acc[gi * 4 + 2] = acc[gi * 4 + 2] + tmp[2] * fg8
        acc[gi * 4 + 3] = acc[gi * 4 + 3] + tmp[3] * fg8

    def emit_h(stage_bf, hcols, c, tile, gg, tt, gi, a0, a1, c0, c1):
        """h = bf16(SiTU(bf16(a), bf16(c))) for local output 8*tile+gg, pair columns 8gi+2tt(+1) -> stage."""
        for q in range(2):
            av = (a0 if q == 0 else a1).to(BFloat16).to(Float32)
            cv = (c0 if q == 0 else c1).to(BFloat16).to(Float32)
            act = (c.situ_beta * cute.math.tanh(av * (1.0 / c.situ_beta))) / (1.0 + cute.math.exp(-av))
            up = c.situ_linear_beta * cute.math.tanh(cv * (1.0 / c.situ_linear_beta))
            stage_bf[(gi * 8 + 2 * tt + q) * hcols + tile * 8 + gg] = (act * up).to(BFloat16)

    class MoeMxfp4Experts:
        def __init__(self, cfg: KernelCfg):
            self.cfg = cfg
            c = cfg
            self.EPT = -(-c.E // c.threads)
            self.n_hz, self.n_stage, self.n_part = c.regions
            self.smem_bytes = c.smem_bytes
            if self.smem_bytes > SMEM_PER_CTA_MAX:
                raise ValueError(f"{cfg}: {self.smem_bytes} B of shared memory per CTA, over {SMEM_PER_CTA_MAX}")

        @cute.jit
        def __call__(self, mZ, mIds, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb, mCnt, mOut, stream):
            c = self.cfg
            self.kernel(mZ, mIds, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb, mCnt, mOut).launch(
                grid=[c.Q * c.C, 1, 1], block=[c.threads, 1, 1], cluster=[c.C, 1, 1],
                smem=self.smem_bytes, stream=stream, use_pdl=PDL)

        @cute.kernel
        def kernel(self, mZ, mIds, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb, mCnt, mOut):
            c = self.cfg
            W, NT = c.W, c.NT
            passes = c.items == "passes"      # the routing also packs each expert's first pass
            tid, _, _ = cute.arch.thread_idx()
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            P = cute.size(mZ, mode=[0]) * TOPK

            smem = cutlass.memory.SmemAllocator()
            cnt_s = smem.allocate_tensor(Int32, cute.make_layout(c.E), 16)
            act_e = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            act_off = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX + 4), 16)
            slot_s = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            sorted_s = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            tmp_s = smem.allocate_tensor(Int32, cute.make_layout(c.PMAX), 16)
            scr = smem.allocate_tensor(Int32, cute.make_layout(64), 16)
            hz_s = smem.allocate_tensor(Int32, cute.make_layout(self.n_hz), 16)
            stage_s = smem.allocate_tensor(Int32, cute.make_layout(self.n_stage), 16)
            part_s = smem.allocate_tensor(Float32, cute.make_layout(self.n_part), 16)

            # ---------------------------------------------------------------- routing
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            if const_expr(c.route_direct):
                # one token: pair p = slot p is segment p of expert ids[0, p] (KernelCfg.route_direct)
                if tid < TOPK:
                    act_e[tid] = mIds[0, tid]
                    act_off[tid] = tid
                    sorted_s[tid] = tid
                if tid == TOPK:
                    act_off[TOPK] = Int32(TOPK)
                cute.arch.barrier()
                n_active = Int32(TOPK)
                n_pass = Int32(TOPK)
            else:
                # counting sort by expert
                for e in cutlass.range(tid, c.E, c.threads):
                    cnt_s[e] = Int32(0)
                cute.arch.barrier()
                for p in cutlass.range(tid, P, c.threads):
                    ex = mIds[p // TOPK, p % TOPK]
                    slot_s[p] = cute.arch.atomic_add(cnt_s.iterator + ex, Int32(1), scope="cta")
                cute.arch.barrier()
                # block scan over experts: thread owns experts [tid*EPT, tid*EPT+EPT); packs (#active << 16 | #pairs),
                # for "passes" (#passes << 21 | #active << 11 | #pairs): pairs <= 1024 and passes <= 1024 take 11 bits
                # each, active experts <= 896 take 10
                loc = Int32(0)
                for k in cutlass.range_constexpr(self.EPT):
                    e = tid * self.EPT + k
                    if e < c.E:
                        n = cnt_s[e]
                        if const_expr(passes):
                            loc = loc + n + ((n > 0).to(Int32) << 11) + (((n + NT - 1) // NT) << 21)
                        else:
                            loc = loc + n + ((n > 0).to(Int32) << 16)
                incl = loc
                for sh in cutlass.range_constexpr(5):
                    o = cute.arch.shuffle_sync_up(incl, 1 << sh)
                    if lane >= (1 << sh):
                        incl = incl + o
                if lane == 31:
                    scr[warp] = incl
                cute.arch.barrier()
                base = Int32(0)
                for w2 in cutlass.range_constexpr(W):
                    if w2 < warp:
                        base = base + scr[w2]
                excl = base + incl - loc
                if const_expr(passes):
                    ua = (excl >> 11) & 0x3FF
                    pa = excl & 0x7FF
                    qa = (excl >> 21) & 0x7FF
                else:
                    ua = excl >> 16
                    pa = excl & 0xFFFF
                    qa = Int32(0)
                for k in cutlass.range_constexpr(self.EPT):
                    e = tid * self.EPT + k
                    if e < c.E:
                        n = cnt_s[e]
                        if n > 0:
                            if const_expr(passes):
                                # the expert's first pass in the high half (e < 2^16, passes <= 1024): packed here
                                # rather than in a table of its own, whose 4 KB put rank8 b64 over the 196 KB
                                # carve-out step (KernelCfg.l1_kb)
                                act_e[ua] = e | (qa << 16)
                                qa = qa + (n + NT - 1) // NT
                            else:
                                act_e[ua] = e
                            act_off[ua] = pa
                            cnt_s[e] = pa + (n << 16)           # segment offset | length (both <= 1024)
                            ua = ua + 1
                            pa = pa + n
                if tid == c.threads - 1:
                    if const_expr(passes):
                        scr[32] = ua | (qa << 16)               # #active | #passes << 16
                    else:
                        scr[32] = ua
                    act_off[ua] = pa
                cute.arch.barrier()
                # The atomics above order an expert's pairs by arrival, which differs between the CTAs of a cluster
                # once pairs of one expert come from different warps (P > 32).  Every CTA of a cluster must put the
                # same pair in the same column (h columns are exchanged by position through DSMEM and y rows are
                # written by position), so each segment is re-ranked by pair index: deterministic, CTA-independent.
                for p in cutlass.range(tid, P, c.threads):
                    ex = mIds[p // TOPK, p % TOPK]
                    tmp_s[(cnt_s[ex] & 0xFFFF) + slot_s[p]] = p
                cute.arch.barrier()
                for p in cutlass.range(tid, P, c.threads):
                    ex = mIds[p // TOPK, p % TOPK]
                    seg = cnt_s[ex]
                    o = seg & 0xFFFF
                    rk = Int32(0)
                    for k in cutlass.range(o, o + (seg >> 16)):
                        rk = rk + (tmp_s[k] < p).to(Int32)
                    sorted_s[o + rk] = p
                n_active = scr[32]
                n_pass = n_active
                if const_expr(passes):
                    n_active = scr[32] & 0xFFFF
                    n_pass = scr[32] >> 16
                cute.arch.barrier()

            # ---------------------------------------------------------------- the work items
            weights = (mZ, mTw, mW13q, mW13s, mW2q, mW2s)
            tables = (mCnt, mOut, act_e, act_off, sorted_s, scr, hz_s, stage_s, part_s, n_active, n_pass)
            if const_expr(c.alt_parts > 0):
                # every CTA counted the same passes, so the whole grid takes one branch (the cluster barriers and
                # the arrival counters need that). The passes' y rows go to the bf16 rows mYb; mY holds the parts'
                # fp32 partials.
                if n_pass * c.alt_parts <= c.Q:
                    self.items(c.alt, True, *weights, mY, mYb, *tables)
                else:
                    self.items(c, True, *weights, mYb, mYb, *tables)
            else:
                self.items(c, passes, *weights, mY, mYb, *tables)

        @cute.jit
        def items(self, c: cutlass.Constexpr, packed: cutlass.Constexpr, mZ, mTw, mW13q, mW13s, mW2q, mW2s, mY, mYb,
                  mCnt, mOut, act_e, act_off, sorted_s, scr, hz_s, stage_s, part_s, n_active, n_pass):
            """The work items of one launch under cfg c, after the routing: FC1, the h exchange, FC2, the part
            reduction ("parts") and the combine. packed: act_e holds each expert's first pass in its high half (the
            routing of "passes" keys, also when their alternate "parts" items run)."""
            W, D, GMAX, NT, C = c.W, c.D, c.GMAX, c.NT, c.C
            passes = c.items == "passes"
            parts = c.items == "parts"
            rows = c.items == "rows"
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            g = lane // 4
            t = lane % 4
            rank = bid % C
            qid = bid // C
            h_s = cute.make_tensor(hz_s.iterator, cute.make_layout((NT, c.HW), stride=(c.HW, 1)))
            z_s = cute.make_tensor(hz_s.iterator, cute.make_layout((NT, c.ZW), stride=(c.ZW, 1)))
            lut = [Int32(_LUT_HI[0]), Int32(_LUT_HI[1]), Int32(-1065353216), Int32(-1065336832)]
            # (0xC0800000, 0xC0804000 as signed int32; the nibble layout's table)

            # views: 16-byte rows of the weight streams, 4-word chunks of z / h, 8-wide bf16 chunks of y / out
            gZ = cute.flat_divide(mZ, (1, 4))            # (1, 4, M, dL/8)
            gH = cute.flat_divide(h_s, (1, 4))           # (1, 4, NT, HW/4)
            gZs = cute.flat_divide(z_s, (1, 4))          # (1, 4, NT, ZW/4)
            wld = weight_load_atom(Int32)
            zcp = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                      Int32, num_bits_per_copy=128)
            gY = cute.flat_divide(mY, (1, 8))            # (1, 8, rows, dL/8)
            gYb = cute.flat_divide(mYb, (1, 8))          # the bf16 y_e rows of "parts" / "rows" items
            gYsum = gY if passes else gYb                # the bf16 y rows the combine sums
            gO = cute.flat_divide(mOut, (1, 8))
            # y rows were written by other CTAs during this launch: read them from L2 (.cg), never from L1
            ycg = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                                      load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            ycg32 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                        load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            gY4 = cute.flat_divide(mY, (1, 4))           # "parts": (1, 4, rows, dL/4); "rows": (1, 4, pairs, I/8) of hG
            hcg = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                      load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            h4 = cute.make_rmem_tensor(cute.make_layout(4), Int32)
            y4a = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            NH = c.NH

            stage_bf = cute.recast_tensor(stage_s, BFloat16)
            ringW = cute.make_rmem_tensor(cute.make_layout((D, 4), stride=(4, 1)), Int32)
            ringS = cute.make_rmem_tensor(cute.make_layout(D), Int32)
            acc = cute.make_rmem_tensor(cute.make_layout(GMAX * 4), Float32)
            zrow = cute.make_rmem_tensor(cute.make_layout(GMAX), Int32)
            ypair = cute.make_rmem_tensor(cute.make_layout(GMAX * 2), Int32)
            bv = cute.make_rmem_tensor(cute.make_layout(4), Int32)

            # ---------------------------------------------------------------- item loop
            h_base = h_s.iterator.toint()
            hcols = c.IH // C
            NS1 = c.U1 * c.KS1
            D1, D2 = c.D1, c.D2     # the loops' ring depths (KernelCfg._fit)
            NS1_pad = -(-NS1 // D1) * D1
            NS2 = c.U2 * c.NKB2H
            NS2_pad = -(-NS2 // D2) * D2
            NV = c.dL // 8 // c.RB                      # 8-wide y / r vectors per row block (the combine's chunk)
            s8 = cute.make_rmem_tensor(cute.make_layout(8), Float32)
            ry = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            ro = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            R13 = c.I // 8 * c.NKB1                      # 16-byte rows of one expert's w13 stream / 32
            R2 = c.dL // 16 * c.NKB2
            # Work items: single passes (expert, <= NT pairs), or (expert, part of I) with the part's cluster running
            # all passes of the expert. Each pass reads the expert's weights once either way.
            n_work = n_pass if const_expr(passes) else NH * n_active       # "parts" / "rows": wi = NH u + hI
            for wi in cutlass.range(qid, n_work, c.Q):
                u = wi
                hI = Int32(0)
                if const_expr(not passes):
                    u = wi // NH
                    hI = wi - NH * u
                if const_expr(passes):
                    # the expert whose passes contain item wi: first(lo) <= wi < first(hi), first(u) = act_e[u] >> 16
                    # (mid < hi <= n_active: the search never reads past the last active expert)
                    lo = Int32(0)
                    hi = n_active
                    for _ in cutlass.range_constexpr(11):   # n_active <= 1024
                        mid = (lo + hi) // 2
                        if (act_e[mid] >> 16) <= wi:
                            lo = mid
                        else:
                            hi = mid
                    u = lo
                ex = act_e[u]
                if const_expr(packed):
                    ex = act_e[u] & 0xFFFF
                off = act_off[u]
                n_e = act_off[u + 1] - off
                pb0 = Int32(0)
                pb1 = n_e
                if const_expr(passes):
                    pb0 = (wi - (act_e[u] >> 16)) * NT
                    pb1 = pb0 + 1
                eW13q = cute.make_tensor(expert_ptr(mW13q, ex, R13 * 32 * 4 * 4, 16),
                                         cute.make_layout((R13 * 32, 4), stride=(4, 1)))
                eW13s = cute.make_tensor(expert_ptr(mW13s, ex, R13 * 8 * 4, 4), cute.make_layout(R13 * 8))
                eW2q = cute.make_tensor(expert_ptr(mW2q, ex, R2 * 32 * 4 * 4, 16),
                                        cute.make_layout((R2 * 32, 4), stride=(4, 1)))
                eW2s = cute.make_tensor(expert_ptr(mW2s, ex, R2 * 8 * 4, 4), cute.make_layout(R2 * 8))
                for pb in cutlass.range(pb0, pb1, NT):
                    npass = cutlass.min(n_e - pb, NT)
                    # this lane's B-operand rows (pair column g of each group) and y columns (2t, 2t+1)
                    for gi in cutlass.range_constexpr(GMAX):
                        nn = cutlass.min(gi * 8 + g, npass - 1)
                        zrow[gi] = nn                               # row of the staged z
                        for q in cutlass.range_constexpr(2):
                            n2 = gi * 8 + 2 * t + q
                            ypair[gi * 2 + q] = Int32(-1)
                            if n2 < npass:
                                ypair[gi * 2 + q] = sorted_s[off + pb + n2]

                    # ======================= FC1: CTA-local tiles [0, T1) of w13 (global rank*T1 + tile), K = dL.
                    # Warp w streams units uu = w + W*i (tile = uu // S, K part ks = uu % S), KS1 steps each; the
                    # 16-byte loads of step s + D1 are issued right after step s is decoded (register ring).
                    # The pass's z rows -> smem (cp.async, overlapped with the weight ring's first loads). Safe to
                    # overwrite: this CTA's FC2 of the previous pass is behind the combine barriers, and the other
                    # CTAs write h here only after cluster barrier A of this pass.
                    for idx in cutlass.range(tid, npass * (c.dL // 8), c.threads):
                        n_ = idx // (c.dL // 8)
                        v_ = idx - n_ * (c.dL // 8)
                        tok = sorted_s[off + pb + n_] // TOPK
                        cute.copy(zcp, gZ[0, None, tok, v_], gZs[0, None, n_, v_])
                    cute.arch.cp_async_commit_group()
                    t1_base = rank * c.T1
                    if const_expr(not passes):
                        t1_base = hI * (c.IH // 8) + rank * c.T1     # w13 tiles of part hI: [hI IH/8, (hI+1) IH/8)
                    # FC2: CTA-local tiles [0, T2) of w2 (rows 16*(rank*T2 + tile)), K = I; "parts": the part's K;
                    # "rows": row block rbi = hI C + rank of the expert's NH C, all of K
                    rbi = rank
                    if const_expr(rows):
                        rbi = hI * C + rank
                    t2_base = rbi * c.T2
                    koff = 0
                    if const_expr(parts):
                        koff = hI * c.NKB2H                          # the part's K steps of each w2 tile
                    for d in cutlass.range_constexpr(D1):
                        if const_expr(d < NS1):
                            row_ = fc1_row(c, warp, t1_base, d)
                            load_slot(c, wld, eW13q, eW13s, row_, lane, g, ringW, ringS, d)
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.barrier()
                    for s0 in cutlass.range(0, NS1_pad, D1):
                        for d in cutlass.range_constexpr(D1):
                            s = s0 + d
                            if s < NS1:
                                wv = [ringW[d, j] for j in range(4)]
                                sv = ringS[d]
                                if const_expr(c.layout == "rot"):
                                    i, kk = step_split(s0, d, c.KS1, D1)
                                else:
                                    i = s // c.KS1
                                    kk = s - i * c.KS1
                                uu = warp + W * i
                                tile = uu // c.S
                                kb = (uu - tile * c.S) * c.KS1 + kk
                                if kk == 0:
                                    acc.fill(0.0)
                                a, sf = consume_slot(c, lut, wv, sv)
                                if const_expr(c.layout == "rot"):
                                    i_, k_ = step_split(s0 + D1, d, c.KS1, D1)
                                    uu_ = warp + W * i_
                                    row_ = (t1_base + uu_ // c.S) * c.NKB1 + (uu_ % c.S) * c.KS1 + k_
                                else:
                                    row_ = fc1_row(c, warp, t1_base, s + D1)     # the refill of this slot
                                if s + D1 < NS1:
                                    load_slot(c, wld, eW13q, eW13s, row_, lane, g, ringW, ringS, d, scale=False)
                                for gi in cutlass.range_constexpr(GMAX):
                                    if gi * 8 < npass:
                                        for bb in cutlass.range_constexpr(2):
                                            cute.autovec_copy(gZs[0, None, zrow[gi], kb * 8 + bb * 4 + t], bv)
                                            mma_block_any(c, a, bv, sf, bb, acc, gi)
                                # the scale word is refilled after its last use (the MMAs' scale factors)
                                if s + D1 < NS1:
                                    ringS[d] = eW13s[row_ * 8 + g]
                                if kk == c.KS1 - 1:
                                    if const_expr(c.S > 1):
                                        for x in cutlass.range_constexpr(GMAX * 4):
                                            part_s[(uu * GMAX * 32 + lane) * 4 + (x // 4) * 128 + x % 4] = acc[x]
                                    else:
                                        for gi in cutlass.range_constexpr(GMAX):
                                            emit_h(stage_bf, hcols, c, tile, g, t, gi, acc[gi * 4 + 0],
                                                   acc[gi * 4 + 1], acc[gi * 4 + 2], acc[gi * 4 + 3])

                    # cluster barrier A: every CTA of the cluster finished reading h_s of the previous pass ("rows":
                    # this CTA's warps finished FC1, whose z rows share h_s's region; h goes through global memory)
                    if const_expr(rows):
                        cute.arch.barrier()
                    else:
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                    if const_expr(c.S > 1):
                        # deterministic K-split reduction (fixed ks order), then SiTU
                        for idx in cutlass.range(tid, c.T1 * GMAX * 32, c.threads):
                            ln = idx % 32
                            gi_r = (idx // 32) % GMAX
                            tile_r = idx // (32 * GMAX)
                            s4 = [Float32(0.0)] * 4
                            for ks in cutlass.range_constexpr(c.S):
                                uu_r = tile_r * c.S + ks
                                for x in cutlass.range_constexpr(4):
                                    s4[x] = s4[x] + part_s[((uu_r * GMAX + gi_r) * 32 + ln) * 4 + x]
                            emit_h(stage_bf, hcols, c, tile_r, ln // 4, ln % 4, gi_r, s4[0], s4[1], s4[2], s4[3])
                        cute.arch.barrier()
                    if const_expr(rows):
                        # the expert's h is exchanged through global memory between all NH C CTAs of its items (a
                        # cluster of NH C = 8 is not co-resident; these CTAs are, one per SM). Each publishes its h
                        # columns of every pair (rows of hG, bf16 [pairs, I]) and arrives on the segment's counter;
                        # FC2's first ring loads do not depend on h and go out before the spin.
                        for idx in cutlass.range(tid, npass * c.T1, c.threads):
                            ch = idx % c.T1
                            n = idx // c.T1
                            pr = sorted_s[off + pb + n]
                            src = n * (c.T1 * 4) + ch * 4
                            for x in cutlass.range_constexpr(4):
                                mY[pr, hI * (c.IH // 2) + rank * (hcols // 2) + ch * 4 + x] = stage_s[src + x]
                        # release: the CTA barrier orders every thread's h stores before thread 0's release arrival
                        # (cumulativity), so no thread fences: each serial gpu-scope round trip in this exchange adds
                        # to the b1 chain (fences per thread and after the spin cost 0.6 us there)
                        cute.arch.barrier()
                        if tid == 0:
                            cute.arch.atomic_add(mCnt.iterator + H_COUNTERS + u, Int32(1), sem="release", scope="gpu")
                        fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, NS2, lane, g, ringW, ringS)
                        if tid == 0:
                            # every CTA of the segment's items is resident (one per SM, grid <= SMs; a PDL dependent
                            # launches only once all of them ran their trigger), so the spin ends. Departures count
                            # on past NH C after FC2; the last one re-arms the counter for the next launch / replay.
                            hc = cute.arch.load(mCnt.iterator + H_COUNTERS + u, Int32, sem="acquire", scope="gpu")
                            while hc < NH * C:
                                hc = cute.arch.load(mCnt.iterator + H_COUNTERS + u, Int32, sem="acquire",
                                                    scope="gpu")
                        cute.arch.barrier()
                        # hG was written by other CTAs during this launch: read it from L2 (.cg), never from L1
                        for idx in cutlass.range(tid, npass * (c.I // 8), c.threads):
                            ch = idx % (c.I // 8)
                            n = idx // (c.I // 8)
                            pr = sorted_s[off + pb + n]
                            cute.copy(hcg, gY4[0, None, pr, ch], h4)
                            cute.autovec_copy(h4, gH[0, None, n, ch])
                        cute.arch.barrier()

                    else:
                        # this CTA's h columns -> every CTA of the cluster (16-byte DSMEM stores)
                        for idx in cutlass.range(tid, NT * c.T1 * C, c.threads):
                            dst = idx % C
                            ch = (idx // C) % c.T1
                            n = idx // (C * c.T1)
                            src = n * (c.T1 * 4) + ch * 4
                            v = [stage_s[src + x] for x in range(4)]
                            dword = n * c.HW + rank * (hcols // 2) + ch * 4
                            st_cluster_v4(h_base + dword * 4, dst, v)
                        # cluster barrier B: h complete in every CTA
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()

                    # ======================= FC2: CTA-local tiles [0, T2) of w2 (rows 16*(t2_base + tile)).
                    # The ring restarts here, one loaded HBM round trip after barrier B (issuing these loads from
                    # FC1's last steps instead was measured: no gain, slower at b64)
                    if const_expr(not rows):
                        fc2_fill(c, wld, eW2q, eW2s, warp, t2_base, koff, NS2, lane, g, ringW, ringS)
                    for s0 in cutlass.range(0, NS2_pad, D2):
                        for d in cutlass.range_constexpr(D2):
                            s = s0 + d
                            if s < NS2:
                                wv = [ringW[d, j] for j in range(4)]
                                sv = ringS[d]
                                if const_expr(c.layout == "rot"):
                                    i, kb = step_split(s0, d, c.NKB2H, D2)
                                else:
                                    i = s // c.NKB2H
                                    kb = s - i * c.NKB2H
                                tile = warp + W * i
                                if kb == 0:
                                    acc.fill(0.0)
                                a, sf = consume_slot(c, lut, wv, sv)
                                if const_expr(c.layout == "rot"):
                                    i_, k_ = step_split(s0 + D2, d, c.NKB2H, D2)
                                    row_ = (t2_base + cutlass.min(warp + W * i_, c.T2 - 1)) * c.NKB2 + koff + k_
                                else:
                                    row_ = fc2_row(c, warp, t2_base, s + D2, koff)     # the refill of this slot
                                if s + D2 < NS2:
                                    load_slot(c, wld, eW2q, eW2s, row_, lane, g, ringW, ringS, d, scale=False)
                                if tile < c.T2:
                                    for gi in cutlass.range_constexpr(GMAX):
                                        if gi * 8 < npass:
                                            for bb in cutlass.range_constexpr(2):
                                                cute.autovec_copy(gH[0, None, gi * 8 + g, kb * 8 + bb * 4 + t], bv)
                                                mma_block_any(c, a, bv, sf, bb, acc, gi)
                                    if kb == c.NKB2H - 1:
                                        r0 = (t2_base + tile) * 16 + g
                                        for gi in cutlass.range_constexpr(GMAX):
                                            for q in cutlass.range_constexpr(2):
                                                pr = ypair[gi * 2 + q]
                                                if pr >= 0:
                                                    if const_expr(rows):
                                                        # y_e over all of I: rounded once
                                                        mYb[pr, r0] = acc[gi * 4 + q].to(BFloat16)
                                                        mYb[pr, r0 + 8] = acc[gi * 4 + 2 + q].to(BFloat16)
                                                    elif const_expr(parts):
                                                        # the part's fp32 partial: y_e is rounded once, after the
                                                        # NH parts are added by the part reduction below
                                                        mY[pr * NH + hI, r0] = acc[gi * 4 + q]
                                                        mY[pr * NH + hI, r0 + 8] = acc[gi * 4 + 2 + q]
                                                    else:
                                                        mY[pr, r0] = acc[gi * 4 + q].to(BFloat16)
                                                        mY[pr, r0 + 8] = acc[gi * 4 + 2 + q].to(BFloat16)
                                # the scale word is refilled after its last use (the MMAs' scale factors)
                                if s + D2 < NS2:
                                    ringS[d] = eW2s[row_ * 8 + g]

                    if const_expr(rows):
                        # depart from the h exchange (every CTA passed its spin long ago). The last thread does it,
                        # so its wait for the atomic's result overlaps warp 0's combine arrivals below.
                        if tid == c.threads - 1:
                            old = cute.arch.atomic_add(mCnt.iterator + H_COUNTERS + u, Int32(1),
                                                       sem="relaxed", scope="gpu")
                            if old == 2 * NH * C - 1:
                                cute.arch.store(mCnt.iterator + H_COUNTERS + u, Int32(0), sem="relaxed",
                                                scope="gpu")
                    # every thread's y stores are visible at gpu scope before the arrivals
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.barrier()
                    if const_expr(parts):
                        # ======================= part reduction: the NH-th arrival of (pair, row chunk) adds the
                        # parts' fp32 partials in part order and rounds y_e to bf16 once (the reference's rounding),
                        # then arrives for the combine in its place. Spread over the CTAs that finish a pair last,
                        # so no single CTA reads all NH x 16 partial rows of a token.
                        if tid < npass:
                            pr = sorted_s[off + pb + tid]
                            lastp = Int32(-1)
                            if last_arrival(mCnt, PART_COUNTERS + pr * C + rank, NH):
                                lastp = pr
                            scr[41 + tid] = lastp
                        cute.arch.barrier()
                        for n in cutlass.range(0, npass):
                            pr = scr[41 + n]
                            if pr >= 0:
                                for v in cutlass.range(tid, NV, c.threads):
                                    vv = rank * NV + v
                                    s8.fill(0.0)
                                    for hp in cutlass.range_constexpr(NH):
                                        for q in cutlass.range_constexpr(2):
                                            cute.copy(ycg32, gY4[0, None, pr * NH + hp, 2 * vv + q], y4a)
                                            for x in cutlass.range_constexpr(4):
                                                s8[4 * q + x] = s8[4 * q + x] + y4a[x]
                                    ro.store(s8.load().to(BFloat16))
                                    cute.autovec_copy(ro, gYb[0, None, pr, vv])
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.barrier()
                    # ======================= combine: the 16th arrival of (token, row chunk) sums the slots in order
                    if tid < npass:
                        pr = sorted_s[off + pb + tid]
                        if const_expr(parts):
                            pr = scr[41 + tid]              # only the pairs this CTA reduced arrive (-1: none)
                        last = Int32(-1)
                        if pr >= 0:
                            m = pr // TOPK
                            if last_arrival(mCnt, m * c.RB + rbi, TOPK):
                                last = m
                        scr[33 + tid] = last
                    cute.arch.barrier()
                    for n in cutlass.range(0, npass):
                        m = scr[33 + n]
                        if m >= 0:
                            vb = rbi * NV
                            for v in cutlass.range(tid, NV, c.threads):
                                vv = vb + v
                                s8.fill(0.0)
                                for j in cutlass.range_constexpr(TOPK):
                                    wj = mTw[m, j]
                                    cute.copy(ycg, gYsum[0, None, m * TOPK + j, vv], ry)
                                    s8.store(s8.load() + ry.load().to(Float32) * wj)
                                ro.store(s8.load().to(BFloat16))
                                cute.autovec_copy(ro, gO[0, None, m, vv])
                    cute.arch.barrier()

    return MoeMxfp4Experts


# ----------------------------------------------------------------------------------------------- host entry points

_KERNEL_CLASS = None


def _kernel_class():
    global _KERNEL_CLASS
    if _KERNEL_CLASS is None:
        _KERNEL_CLASS = _build_kernel_class()
    return _KERNEL_CLASS


def _compile(cfg: KernelCfg, options: str = TVM_FFI):
    cutlass, cute = import_cute()
    from cutlass import BFloat16, Float32, Int32
    obj = _kernel_class()(cfg)
    M = cute.sym_int()
    R13, R2, S13, S2, RY, RYB = (cute.sym_int() for _ in range(6))
    rows = cfg.items == "rows"
    args = (
        fake_tensor(Int32, (M, cfg.dL // 2)),                  # z as bf16x2 words
        fake_tensor(Int32, (M, TOPK), align=4),                # topk_ids
        fake_tensor(Float32, (M, TOPK), align=4),              # topk_w
        fake_tensor(Int32, (R13, 4)),                          # w13q rows of 16 B
        fake_tensor(Int32, (S13,), align=4),                   # w13s words
        fake_tensor(Int32, (R2, 4)),
        fake_tensor(Int32, (S2,), align=4),
        # y: "passes" bf16 y rows [>= M*16, dL]; "parts" (also a "passes" key's alternate items) fp32 partials
        # [>= NH M*16, dL]; "rows" hG, the pairs' h as bf16x2 words [>= 16 MB, I/2]
        fake_tensor(Int32 if rows else Float32 if cfg.items == "parts" or cfg.alt_parts else BFloat16,
                    (RY, cfg.I // 2 if rows else cfg.dL)),
        fake_tensor(BFloat16, (RYB, cfg.dL)),                  # yb: bf16 y_e rows [>= M*16, dL]
        fake_tensor(Int32, (MAX_M * 8,), align=4),             # counters
        fake_tensor(BFloat16, (M, cfg.dL)),                    # r
    )
    return cute.compile(obj, *args, fake_stream(), options=options)


def compile_key(E: int, dL: int, I: int, M: int, *, nsm: int = 132, situ_beta: float = 4.0,
                situ_linear_beta: float = 25.0, layout: str = "rot", alt_parts: int | None = None) -> KernelCfg:
    """The kernel key for batch size M: item_kind and default_parts at its bucket; alt_parts None: ALT_PARTS
    alternate items at buckets 4 / 8 ("passes" keys whose I splits into them), 0: the passes alone (the contender);
    at other buckets both give the same key."""
    if alt_parts not in (None, 0, ALT_PARTS):
        raise ValueError(f"alt_parts must be None (the default, {ALT_PARTS}) or 0 (the passes alone), got {alt_parts!r}")
    MB = m_bucket(M)
    items = item_kind(MB, I, dL, nsm)
    parts = 1 if items == "passes" else default_parts(I, MB, nsm)
    alt = 0
    if items == "passes" and MB <= PARTS_MAX_MB and I % (64 * ALT_PARTS) == 0 and alt_parts is None:
        alt = ALT_PARTS
    return KernelCfg(E=E, dL=dL, I=I, MB=MB, items=items, parts=parts, alt_parts=alt, layout=layout, nsm=nsm,
                     situ_beta=float(situ_beta), situ_linear_beta=float(situ_linear_beta))


def compile_keys(cfg_or_dims, batches=M_BUCKETS, *, nsm: int = 132, alt_parts: int | None = None,
                 layout: str = "rot") -> list[KernelCfg]:
    """All compile keys one K3 config (or (E, dL, I)) needs for the given batch sizes (alt_parts, layout: as for
    compile_key)."""
    if hasattr(cfg_or_dims, "num_experts"):
        E, dL, I = cfg_or_dims.num_experts, cfg_or_dims.routed_expert_hidden_size, cfg_or_dims.expert_intermediate
        sb, slb = cfg_or_dims.situ_beta, cfg_or_dims.situ_linear_beta
    else:
        (E, dL, I), sb, slb = cfg_or_dims, 4.0, 25.0
    keys = []
    for M in batches:
        k = compile_key(E, dL, I, M, nsm=nsm, situ_beta=sb, situ_linear_beta=slb, layout=layout, alt_parts=alt_parts)
        if k not in keys:
            keys.append(k)
    return keys


def get_kernel(key: KernelCfg):
    return compile_cached(("moe_mxfp4_experts", key), lambda: _compile(key))


def warmup(cfg_or_dims, batches=M_BUCKETS, *, nsm: int | None = None, alt_parts: int | None = None,
           layout: str = "rot") -> list[KernelCfg]:
    """Compile every key needed before CUDA-graph capture (layout: the PreparedExperts' layout)."""
    if nsm is None:
        nsm = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    keys = compile_keys(cfg_or_dims, batches, nsm=nsm, alt_parts=alt_parts, layout=layout)
    for k in keys:
        get_kernel(k)
    return keys


@dataclass
class MoeWorkspace:
    y: torch.Tensor          # [64*16, dL] bf16: per-(token, slot) expert outputs (viewed per item kind: _y_views)
    counters: torch.Tensor   # [64*8] int32, zero between launches (self-resetting)


def make_workspace(dL: int, device) -> MoeWorkspace:
    return MoeWorkspace(y=torch.empty(MAX_M * TOPK, dL, dtype=torch.bfloat16, device=device),
                        counters=torch.zeros(MAX_M * 8, dtype=torch.int32, device=device))


_NSM: dict = {}


def _num_sms(device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NSM:
        _NSM[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NSM[idx]


def _validate(z, topk_ids, topk_w, prep: PreparedExperts):
    E, I, dL = prep.dims
    check_tensor("z", z, dtype=torch.bfloat16)
    if z.dim() != 2 or z.shape[1] != dL:
        raise ValueError(f"z: expected shape [M, {dL}], got {list(z.shape)}")
    M = z.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"z: batch M={M} outside [1, {MAX_M}]")
    dev = z.device
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, shape=(M, TOPK), device=dev, align=4)
    check_tensor("topk_w", topk_w, dtype=torch.float32, shape=(M, TOPK), device=dev, align=4)
    for n, t in [("w13q", prep.w13q), ("w13s", prep.w13s), ("w2q", prep.w2q), ("w2s", prep.w2s)]:
        check_tensor(n, t, dtype=torch.int32, device=dev)
    if tuple(prep.w2q.shape) != (E, dL // 16, I // 64, 32, 4) or tuple(prep.w13s.shape) != (E, I // 8, dL // 64, 8):
        raise ValueError("prepared expert tensors have inconsistent shapes")
    return E, I, dL, M


def _y_views(key: KernelCfg, ws: MoeWorkspace, M: int):
    """The kernel's y and yb arguments, carved out of workspace.y per item kind."""
    dL, I = key.dL, key.I
    flat = ws.y.view(-1)
    if key.items == "rows":
        # hG, the pairs' h rows (bf16 as int32 words, [16 MB, I/2]), then the bf16 y_e rows [M 16, dL]
        n_h = key.PMAX * I
        return flat[:n_h].view(torch.int32).view(key.PMAX, I // 2), flat[n_h: n_h + M * TOPK * dL].view(M * TOPK, dL)
    if key.items == "parts" or key.alt_parts:
        # the parts' fp32 partials, rows NH pair + part: NH x M x 16 x dL x 4 B, inside the bf16 workspace's
        # MAX_M x 16 x dL x 2 B (MB <= 8, NH <= 4); the bf16 y_e rows follow them (a "passes" key's y rows too)
        split = key.alt or key
        n32 = split.NH * M * TOPK * dL
        if 2 * n32 + M * TOPK * dL > flat.numel():
            raise ValueError(f"{split.NH} parts of I at M={M} need more than workspace.y's {flat.numel()} elements")
        return flat.view(torch.float32)[:n32].view(split.NH * M * TOPK, dL), \
            flat[2 * n32: 2 * n32 + M * TOPK * dL].view(M * TOPK, dL)
    return ws.y, ws.y


def moe_mxfp4_experts(z, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *,
                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0, out=None, workspace=None,
                      layout: str | None = None, alt_parts: int | None = None):
    """Routed-expert output r [M, dL] bf16 (see module docstring).

    w13_packed / w13_scale / w2_packed / w2_scale are the four tensors of prepare_mxfp4_experts (a PreparedExperts
    may also be passed as w13_packed with the other three None; the four tensors alone need ``layout``).  topk_ids
    values must lie in [0, E) (not checked: that would need a host sync).  workspace: MoeWorkspace from
    make_workspace (allocated per call if None).  alt_parts: None runs the alternate "parts" items at buckets 4 / 8
    when few experts are hot (ALT_PARTS); 0 runs the passes alone there (the contender; module docstring).
    """
    if isinstance(w13_packed, PreparedExperts):
        prep = w13_packed
        if layout is not None and layout != prep.layout:
            raise ValueError(f"layout={layout!r} given for experts prepared with layout {prep.layout!r}")
    else:
        if layout not in LAYOUTS:
            raise ValueError(f"moe_mxfp4_experts with the four prepared tensors needs layout= one of {LAYOUTS} "
                             f"(PreparedExperts.layout), got {layout!r}")
        prep = PreparedExperts(w13_packed, w13_scale, w2_packed, w2_scale, layout=layout)
    E, I, dL, M = _validate(z, topk_ids, topk_w, prep)
    if not z.is_cuda:
        raise ValueError("moe_mxfp4_experts runs on CUDA tensors only")
    if out is None:
        out = torch.empty(M, dL, dtype=torch.bfloat16, device=z.device)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(M, dL), device=z.device)
    if workspace is None:
        workspace = make_workspace(dL, z.device)
    check_tensor("workspace.y", workspace.y, dtype=torch.bfloat16, device=z.device)
    check_tensor("workspace.counters", workspace.counters, dtype=torch.int32, shape=(MAX_M * 8,), device=z.device)
    if workspace.y.dim() != 2 or workspace.y.shape[1] != dL or workspace.y.shape[0] < M * TOPK:
        raise ValueError(f"workspace.y: expected [>= {M * TOPK}, {dL}], got {list(workspace.y.shape)}")
    key = compile_key(E, dL, I, M, nsm=_num_sms(z.device), situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                      layout=prep.layout, alt_parts=alt_parts)
    fn = get_kernel(key)
    y, yb = _y_views(key, workspace, M)
    fn(z.view(torch.int32), topk_ids, topk_w, prep.w13q.view(-1, 4), prep.w13s.view(-1), prep.w2q.view(-1, 4),
       prep.w2s.view(-1), y, yb, workspace.counters, out)
    return out
