"""Stock KDA decode core for Kimi K3 built from fla 0.6.0 library kernels (the Hopper baseline).

What it computes (docs/k3-layer.md §7.2 steps 2-8, one decode token per sequence, one TP rank with H local
heads, D = head_dim, P = H*D): short conv + SiLU on [q|k|v], q/k L2 norm (eps 1e-6) and q*D**-0.5, the
lower-bounded decay lam = lower_bound*sigmoid(exp(A_log[h])*(f + dt_bias)), beta = sigmoid(b), the gated delta
rule on the FP32 state S[v, k] (decay, e = v - S k, S += beta e k^T, o = S q), and the sigmoid-gated output
RMSNorm. The projections before and the o_proj after are not part of this function.

fla 0.6.0 pieces used (fla-core 0.6.0 wheel; see notes/fla_kda_api.md):
  * fla.modules.causal_conv1d.causal_conv1d_update     conv update + SiLU (Triton, autotuned on (D, W))
  * fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd gate + beta sigmoid + q/k L2 norm + scale + delta rule,
    state updated IN PLACE through ssm_state_indices, V-first ([N, H, V, K]) state via state_v_first=True,
    lower-bounded gate via use_gate_in_kernel=True + lower_bound (Triton, fixed num_warps=4, BV=32)
  * fla.modules.norm.fused_norm_gate.layer_norm_gated_fwd  gated RMSNorm, activation="sigmoid" (Triton,
    autotuned); this is the kernel behind fla's rms_norm_gated / FusedRMSNormGated.
  The public wrapper fla.ops.kda.fused_recurrent_kda is NOT usable for serving: it forces
  inplace_final_state=False and silently drops ssm_state_indices (it only forwards named arguments), so the
  internal fused_recurrent_kda_fwd is called directly, as vLLM-style serving code does. No transposes are
  needed: state_v_first=True reads/writes the vLLM [slots, H, V, K] layout directly.

Torch glue that remains (fla has no equivalent):
  * conv: fla's update kernel has no slot indices and keeps a W=4-wide cache [N, D, 4] (it reads columns 1..3,
    writes all 4). The [slots, 3P, 3] state is gathered, widened to 4 columns (column 0 is never read),
    updated by the kernel, and scattered back. The three projections form one [B, 3P] input (a strided view
    when they are adjacent slices of a packed projection output, else one concatenation).
  * padding (slot < 0): fla's recurrent kernel has no PAD_SLOT check (a negative index is dereferenced), so
    padded rows must never reach it with their slot. Default path: compaction. Valid tokens are scattered to
    the front and cu_seqlens = [0, cumsum(valid)] gives padded sequences length 0; the kernel returns before
    touching their state ("T == 0 and IS_CONTINUOUS_BATCHING") and their output rows stay zero. The conv
    write-back redirects padded rows to duplicate the last valid row's (slot, value) so that the scatter has
    no conflicting duplicates (all-padded batch: slot 0 gets its own old value back).
    Optional `null_slot=s` path (vLLM's convention: a reserved scratch slot that no live request uses): padded
    rows read and write slot s (garbage there is harmless), no compaction, padded outputs zeroed by a where.
  * the recurrent kernel addresses q/k/v/g/beta as contiguous [tokens, H, D]; the compaction scatter (default
    path) or one transpose-copy (null-slot path) produces contiguous q/k/v from the [B, 3P] conv output.
All of it is CUDA-graph capturable: no .item(), no host syncs, no data-dependent shapes (Triton autotuning of
the conv and norm kernels must happen in a warm-up call before capture).

Numerics (rounding points): conv output rounded to BF16 (RTNE) by the conv kernel; gate/beta/L2 norm/recurrence
in FP32 registers, state FP32; o rounded to BF16 when stored by the recurrent kernel (fla's default `out` is
zeros_like(v)) unless o_fp32=True; gated norm computed in FP32, stored BF16. fla sums the 4 conv taps with
tl.sum (tree order) and uses tl.exp (libdevice fast expf only when FLA_USE_FAST_OPS=1).

stock_kda_core_torch has the same signature and runs the same glue with plain-torch emulations of the three fla
kernels (same rounding points), so the glue can be tested on CPU; the fla kernels themselves are Triton and need
a GPU (or TRITON_INTERPRET=1).

Version log
  v1: fla 0.6.0 conv update + fused_recurrent_kda_fwd (in place, V-first, gate/beta/l2 in kernel) + gated norm,
      torch glue for the slot-indexed conv state and for padding (compaction or null slot).
"""

from __future__ import annotations

import torch

__all__ = [
    "KERNELS_EXPECTED",
    "KERNELS_EXPECTED_NULL_SLOT",
    "pack_conv_weight",
    "stock_kda_core",
    "stock_kda_core_torch",
]

# Launches per call, default (compaction) path, in stream order. "fla:" = fla Triton kernels, the rest are
# small torch kernels on [B]-sized index tensors or [B, <=3P(,4)] activations. With w["conv_qkv"] packed
# (pack_conv_weight) there is no per-call weight concatenation.
KERNELS_EXPECTED = [
    "torch ge: valid = slots >= 0",
    "torch zeros: cu_seqlens [B+1] int64",
    "torch cumsum: cu_seqlens[1:] = cumsum(valid)",
    "torch where: dest = valid ? cu[:-1] : B (compacted row of each token)",
    "torch copy: slots -> int64 (none if slots is already int64)",
    "torch where: read slot = valid ? slot : 0",
    "torch index_select: old conv window = conv_state[read slot]  [B, 3P, 3]",
    "torch copy: widen to the 4-column cache fla expects  [B, 3P, 4]",
    "torch cat: x = [zq | zk | zv]  [B, 3P] (none when they are adjacent slices of one packed output)",
    "fla: causal_conv1d_update_kernel (conv + SiLU, cache shifted in place)",
    "torch argmax: last valid row j",
    "torch arange: row ids",
    "torch where: src = valid ? row : j",
    "torch where: new window for valid rows, old for padded",
    "torch index_select: window rows by src",
    "torch index_select: write slots by src",
    "torch index_copy_: conv_state[write slot] = window",
    "torch index_copy_: compact q|k|v into [3, B+1, P]",
    "torch index_copy_: compact f into [B+1, P]",
    "torch index_copy_: compact b into [B+1, H]",
    "torch zeros: o buffer [B+1, H, D]",
    "fla: fused_recurrent_kda_fwd_kernel (gate, beta, L2 norm, delta rule, in-place state by slot)",
    "torch index_select: un-compact o (padded rows -> zero row B)",
    "fla: layer_norm_gated_fwd_kernel (RMSNorm * o_norm * sigmoid(g_out))",
]
# (+1 "torch reshape copy of g_out" when g_out is a strided column slice of a packed projection output.)

KERNELS_EXPECTED_NULL_SLOT = [
    "torch ge: valid = slots >= 0",
    "torch copy: slots -> int64 (none if slots is already int64)",
    "torch where: slot = valid ? slot : null_slot",
    "torch index_select: old conv window = conv_state[slot]",
    "torch copy: widen to the 4-column cache",
    "torch cat: x = [zq | zk | zv] (none when they are adjacent slices of one packed output)",
    "fla: causal_conv1d_update_kernel",
    "torch index_copy_: conv_state[slot] = new window (padded rows all hit null_slot)",
    "torch copy: [B, 3P] -> contiguous [3, B, P] (q, k, v)",
    "(torch copies of f / b only if they are strided slices)",
    "fla: fused_recurrent_kda_fwd_kernel (in place via ssm_state_indices = slot)",
    "torch where: zero the padded rows of o",
    "fla: layer_norm_gated_fwd_kernel",
]


# ----------------------------------------------------------------------------------------------------------
# weights and argument checks
# ----------------------------------------------------------------------------------------------------------

def _field(w, name, default=None):
    if isinstance(w, dict):
        return w.get(name, default)
    return getattr(w, name, default)


def pack_conv_weight(w) -> torch.Tensor:
    """[3P, 4] FP32 contiguous conv weight in [q | k | v] channel order (do this once at load time and store it
    as w["conv_qkv"] / w.conv_qkv; otherwise every call pays one concatenation launch)."""
    return torch.cat([_field(w, "conv_q"), _field(w, "conv_k"), _field(w, "conv_v")], 0).float().contiguous()


def _check(zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, D):
    if zq.dim() != 2:
        raise ValueError(f"zq must be [B, P], got {tuple(zq.shape)}")
    B, P = zq.shape
    if B < 1:
        raise ValueError("empty batch")
    if P % D:
        raise ValueError(f"P={P} is not a multiple of head_dim={D}")
    H = P // D
    dev = zq.device
    for name, t, shape in (("zk", zk, (B, P)), ("zv", zv, (B, P)), ("g_out", g_out, (B, P)), ("f", f, (B, P)),
                           ("b", b, (B, H))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
    for name, t in (("zq", zq), ("zk", zk), ("zv", zv), ("g_out", g_out), ("f", f), ("b", b)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected {dev}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (3 * P, 3) or conv_state.dtype != torch.bfloat16:
        raise ValueError(f"conv_state must be [slots, {3 * P}, 3] bf16, got {tuple(conv_state.shape)} "
                         f"{conv_state.dtype}")
    if rec_state.dim() != 4 or rec_state.shape[1:] != (H, D, D) or rec_state.dtype != torch.float32:
        raise ValueError(f"rec_state must be [slots, {H}, {D}, {D}] fp32, got {tuple(rec_state.shape)} "
                         f"{rec_state.dtype}")
    if conv_state.shape[0] != rec_state.shape[0]:
        raise ValueError("conv_state and rec_state must have the same number of slots")
    # the kernels index states as base + slot * stride(0) with a packed [3P, 3] / [H, V, K] row.
    if not conv_state.is_contiguous() or not rec_state.is_contiguous():
        raise ValueError("conv_state and rec_state must be contiguous (they are updated in place by slot)")
    if conv_state.device != dev or rec_state.device != dev:
        raise ValueError("states must be on the activations' device")
    if slots.dim() != 1 or slots.shape[0] != B or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be [B] int32/int64, got {tuple(slots.shape)} {slots.dtype}")
    if slots.device != dev:
        raise ValueError("slots must be on the activations' device")

    conv_w = _field(w, "conv_qkv")
    if conv_w is None:
        for name in ("conv_q", "conv_k", "conv_v"):
            t = _field(w, name)
            if t is None or tuple(t.shape) != (P, 4):
                raise ValueError(f"w.{name} must be [{P}, 4]")
        conv_w = pack_conv_weight(w)  # one extra launch; pre-pack with pack_conv_weight()
    if tuple(conv_w.shape) != (3 * P, 4) or conv_w.dtype != torch.float32 or not conv_w.is_contiguous():
        raise ValueError(f"conv weight must be contiguous [{3 * P}, 4] fp32, got {tuple(conv_w.shape)} {conv_w.dtype}")
    A_log = _field(w, "A_log")
    dt_bias = _field(w, "dt_bias")
    o_norm = _field(w, "o_norm")
    # the checkpoint A_log has 128 entries of which the first 96 (per rank: H) are used (docs/k3-layer.md §16, item 1).
    if A_log is None or A_log.dim() != 1 or A_log.shape[0] < H or A_log.dtype != torch.float32:
        raise ValueError(f"w.A_log must be fp32 with at least H={H} entries")
    if dt_bias is None or dt_bias.numel() != P or dt_bias.dtype != torch.float32:
        raise ValueError(f"w.dt_bias must be [{P}] fp32")
    if o_norm is None or tuple(o_norm.shape) != (D,) or o_norm.dtype != torch.float32:
        raise ValueError(f"w.o_norm must be [{D}] fp32")
    for name, t in (("conv weight", conv_w), ("A_log", A_log), ("dt_bias", dt_bias), ("o_norm", o_norm)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected {dev}")
    return B, P, H, conv_w, A_log[:H].contiguous(), dt_bias.reshape(P).contiguous(), o_norm.contiguous()


# ----------------------------------------------------------------------------------------------------------
# kernel back ends: fla (GPU, Triton) and plain-torch emulations with the same contracts and rounding points
# ----------------------------------------------------------------------------------------------------------

class _FlaOps:
    @staticmethod
    def conv_update(x, cache, weight):
        from fla.modules.causal_conv1d import causal_conv1d_update
        # x [N, C] bf16, cache [N, C, 4] (updated in place: cols 1..3 read, [x(t-3), x(t-2), x(t-1), x(t)] written),
        # weight [C, 4] fp32; y [N, C] bf16 = silu(sum_j w[:, j] * window[:, j]).
        y, _ = causal_conv1d_update(x=x, cache=cache, residual=None, weight=weight, bias=None, activation="silu")
        return y

    @staticmethod
    def recurrent(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, state, indices, cu_seqlens, out):
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
            initial_state=state, scale=scale,
            output_final_state=False, inplace_final_state=True, state_v_first=True,
            cu_seqlens=cu_seqlens, ssm_state_indices=indices, num_accepted_tokens=None,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=False, lower_bound=lower_bound, out=out,
        )

    @staticmethod
    def gated_norm(x2d, g2d, weight, eps):
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
        # Same kernel as fla's rms_norm_gated(x, g, weight, None, activation="sigmoid", eps=eps) but without the
        # autograd wrapper, and with out_dtype so an FP32 o still gives a BF16 y in one launch. NB: fla's
        # rms_norm_gated default eps is 1e-6; K3 needs 1e-5 (passed explicitly).
        y, _, _, _ = layer_norm_gated_fwd(x=x2d, g=g2d, weight=weight, bias=None, activation="sigmoid", eps=eps,
                                          residual=None, out_dtype=torch.bfloat16, is_rms_norm=True)
        return y


class _TorchOps:
    """Plain-torch emulations of the three fla kernels (same inputs, in-place effects and rounding points).
    The recurrence emulation uses boolean indexing, so it is for CPU testing only (not graph-capturable)."""

    @staticmethod
    def conv_update(x, cache, weight):
        W = weight.shape[1]
        window = torch.cat([cache[..., 1:W].float(), x.float().unsqueeze(-1)], -1)  # [N, C, W]
        y = (window * weight.float()).sum(-1)
        y = y * torch.sigmoid(y)
        cache.copy_(window.to(cache.dtype))
        return y.to(x.dtype)

    @staticmethod
    def recurrent(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, state, indices, cu_seqlens, out):
        # q/k/g [b, t, H, K], v/out [b, t, H, V], beta [b, t, H]; one token per active sequence (decode).
        H, K = q.shape[-2:]
        q, k, v, g, beta = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v, g, beta))
        o_flat = out.view(-1, *out.shape[2:])
        N = indices.shape[0]
        if cu_seqlens is not None:
            lens = cu_seqlens[1:] - cu_seqlens[:-1]
            if bool((lens > 1).any()):
                raise NotImplementedError("emulation handles decode (T <= 1) only")
            active = lens > 0
            tok = cu_seqlens[:-1]
        else:
            active = torch.ones(N, dtype=torch.bool, device=q.device)
            tok = torch.arange(N, device=q.device)
        seq = active.nonzero().flatten()
        t_idx = tok[seq].long()
        s_idx = indices[seq].long()
        qf, kf, vf, gf, bf = (x[t_idx].float() for x in (q, k, v, g, beta))
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * scale
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
        gk = lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * (gf + dt_bias.float().view(H, K)))
        bt = torch.sigmoid(bf)
        S = state[s_idx].float()                                     # [n, H, V, K]
        S = S * gk.exp()[:, :, None, :]
        e = (vf - (S * kf[:, :, None, :]).sum(-1)) * bt[..., None]   # [n, H, V]
        S = S + e[..., None] * kf[:, :, None, :]
        o = (S * qf[:, :, None, :]).sum(-1)
        state[s_idx] = S.to(state.dtype)
        o_flat[t_idx] = o.to(out.dtype)

    @staticmethod
    def gated_norm(x2d, g2d, weight, eps):
        xf = x2d.float()
        rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
        return (xf * rstd * weight.float() * torch.sigmoid(g2d.float())).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# shared glue
# ----------------------------------------------------------------------------------------------------------

def _qkv_input(zq, zk, zv):
    """[B, 3P] conv input. When q|k|v are adjacent column slices of one packed projection output (vLLM's
    in_proj_qkvgfab layout) this is a strided view (fla's conv kernel takes row/column strides); otherwise one
    concatenation launch."""
    B, P = zq.shape
    if (zq.dtype == zk.dtype == zv.dtype and zq.stride() == zk.stride() == zv.stride()
            and zq.stride(1) == 1 and (B == 1 or zq.stride(0) >= 3 * P)
            and zq.untyped_storage().data_ptr() == zk.untyped_storage().data_ptr() == zv.untyped_storage().data_ptr()
            and zk.storage_offset() == zq.storage_offset() + P and zv.storage_offset() == zq.storage_offset() + 2 * P):
        return zq.as_strided((B, 3 * P), (zq.stride(0), 1))
    return torch.cat([zq, zk, zv], 1)


def _core(ops, zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, D, lower_bound, eps, null_slot, o_fp32):
    B, P, H, conv_w, A_log, dt_bias, o_norm = _check(zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, D)
    dev = zq.device
    o_dtype = torch.float32 if o_fp32 else torch.bfloat16
    scale = D ** -0.5
    if null_slot is not None and not 0 <= int(null_slot) < conv_state.shape[0]:
        raise ValueError(f"null_slot={null_slot} is outside [0, {conv_state.shape[0]})")
    valid = slots >= 0

    # ---- conv state: gather, widen to fla's 4-column cache (col 0 is never read), update, scatter back ----
    if null_slot is None:
        rslot = torch.where(valid, slots.long(), 0)
    else:
        rslot = torch.where(valid, slots.long(), int(null_slot))
    old = conv_state.index_select(0, rslot)                      # [B, 3P, 3]
    cache = torch.empty(B, 3 * P, 4, dtype=conv_state.dtype, device=dev)
    cache[..., 1:].copy_(old)
    x = _qkv_input(zq, zk, zv)                                   # [B, 3P]
    y = ops.conv_update(x, cache, conv_w)                        # [B, 3P] bf16
    new = cache[..., 1:]                                         # [x(t-2), x(t-1), x(t)]

    g2d = g_out.reshape(B * H, D)                                # copies only if g_out is a strided slice

    if null_slot is not None:
        # padded rows all write the reserved null slot (conflicting duplicates there are harmless)
        conv_state.index_copy_(0, rslot, new)
        qkv = y.view(B, 3, P).transpose(0, 1).contiguous()       # [3, B, P]: the kernel wants dense q/k/v
        out = torch.empty(B, 1, H, D, dtype=o_dtype, device=dev)
        ops.recurrent(
            qkv[0].view(B, 1, H, D), qkv[1].view(B, 1, H, D), qkv[2].view(B, 1, H, D),
            f.contiguous().view(B, 1, H, D), b.contiguous().view(B, 1, H),
            A_log, dt_bias, scale, lower_bound, rec_state, rslot, None, out)
        o = torch.where(valid[:, None, None], out.view(B, H, D), 0.0)
        return ops.gated_norm(o.reshape(B * H, D), g2d, o_norm, eps).view(B, P)

    # ---- default path: compaction so that padded sequences get length 0 in the varlen kernel ----
    cu = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    torch.cumsum(valid, 0, out=cu[1:])                           # cu[i] = number of valid rows before i
    dest = torch.where(valid, cu[:-1], B)                        # compacted token row; padded -> dummy row B

    # conv write-back without conflicting duplicates: a padded row re-writes the last valid row's slot with
    # the same bytes; if no row is valid, row 0 writes slot 0's old window back to slot 0.
    j = cu[1:].argmax()                                          # first index of the max = last valid row
    src = torch.where(valid, torch.arange(B, device=dev), j)
    window = torch.where(valid[:, None, None], new, old)
    conv_state.index_copy_(0, rslot.index_select(0, src), window.index_select(0, src))

    qkv = torch.empty(3, B + 1, P, dtype=y.dtype, device=dev)
    qkv.index_copy_(1, dest, y.view(B, 3, P).transpose(0, 1))
    f_c = torch.empty(B + 1, P, dtype=f.dtype, device=dev).index_copy_(0, dest, f)
    b_c = torch.empty(B + 1, H, dtype=b.dtype, device=dev).index_copy_(0, dest, b)
    # rows >= number of valid tokens are never read (uninitialised is fine) and never written (stay zero)
    out = torch.zeros(B + 1, H, D, dtype=o_dtype, device=dev)
    ops.recurrent(
        qkv[0, :B].view(1, B, H, D), qkv[1, :B].view(1, B, H, D), qkv[2, :B].view(1, B, H, D),
        f_c[:B].view(1, B, H, D), b_c[:B].view(1, B, H),
        A_log, dt_bias, scale, lower_bound, rec_state, slots, cu, out[:B].view(1, B, H, D))
    o = out.index_select(0, dest)                                # padded rows read the zero row B
    return ops.gated_norm(o.view(B * H, D), g2d, o_norm, eps).view(B, P)


def stock_kda_core(zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, *, head_dim, lower_bound=-5.0,
                   eps=1e-5, null_slot=None, o_fp32=False) -> torch.Tensor:
    """KDA decode core on one TP rank from fla 0.6.0 kernels; returns y [B, P] bf16 (input of o_proj).

    zq, zk, zv, g_out, f: [B, P] bf16 (unit stride along P; column slices of a packed projection are fine);
    b: [B, H] bf16 beta logits; conv_state [slots, 3P, 3] bf16 ([q|k|v] channels, oldest first) and
    rec_state [slots, H, V, K] fp32 are updated in place; slots [B] int32/int64, < 0 = padding (no read, no
    write, zero output). w: dict or object with conv_q/conv_k/conv_v [P, 4] fp32 (or pre-packed conv_qkv
    [3P, 4]), A_log [>=H] fp32, dt_bias [P] fp32, o_norm [D] fp32.
    null_slot: optional reserved scratch slot for padded rows (cheaper path; see module docstring).
    o_fp32: keep the recurrent output o in FP32 for the norm (default: BF16, fla's default `out`).
    Needs fla-core 0.6.0 and a CUDA device; warm up once before CUDA-graph capture (Triton autotuning)."""
    return _core(_FlaOps, zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, head_dim, lower_bound, eps,
                 null_slot, o_fp32)


def stock_kda_core_torch(zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, *, head_dim,
                         lower_bound=-5.0, eps=1e-5, null_slot=None, o_fp32=False) -> torch.Tensor:
    """Same contract and glue as stock_kda_core, with plain-torch stand-ins for the three fla kernels
    (runs on CPU; used to test the glue)."""
    return _core(_TorchOps, zq, zk, zv, g_out, f, b, conv_state, rec_state, slots, w, head_dim, lower_bound, eps,
                 null_slot, o_fp32)
