"""Kimi Delta Attention (KDA) with a full-rank output gate and a lower-bounded decay (docs/k3-layer.md §7).

Layout conventions (shared with k3fast and the vLLM plug-in):

* one rank holds H heads of D = 128 channels; P = H*D;
* conv state ``[slots, 3P, 3]`` BF16: per channel of [q | k | v] the raw projections at t-3, t-2, t-1
  (index 0 oldest);
* recurrent state ``[slots, H, V, K]`` FP32, S[v, k] with k contiguous (vLLM's layout);
* a slot index < 0 is padding: its state is neither read nor written and its output rows are zero.

The recurrence is written twice: ``gated_delta_rule_recurrent`` is the specification (a token loop,
the order of operations of vLLM's ``fused_recurrent_kda`` decode kernel) and
``gated_delta_rule_chunked`` is the chunked (WY-style) form used for prefill. Tests check that the
two agree in fp64.
"""
from __future__ import annotations

import torch

from .norms import gated_rms_norm, l2_norm
from .precision import Precision


# ---------------------------------------------------------------------------- projections (7.2 step 1)

def kda_projections(x: torch.Tensor, w, P: Precision) -> dict[str, torch.Tensor]:
    """x: [N, d] (the input-RMSNorm output) -> raw projections, each rounded to BF16 as a GEMM output.

    Returns zq, zk, zv, g (output-gate logits): [N, H*D]; f (decay-gate pre-activation): [N, H*D],
    computed as (x W_fa^T) W_fb^T with the 128-wide intermediate rounded to BF16; b (beta logits): [N, H]."""
    fa = P.linear(x, w.f_a_proj)                  # [N, 128] BF16: the rounding point between f_a and f_b
    return dict(zq=P.linear(x, w.q_proj), zk=P.linear(x, w.k_proj), zv=P.linear(x, w.v_proj),
                g=P.linear(x, w.g_proj), f=P.linear(fa, w.f_b_proj), b=P.linear(x, w.b_proj))


# ---------------------------------------------------------------------------- short conv (7.2 step 2)

def short_conv(z: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, P: Precision):
    """Depthwise causal conv of width K=4 + SiLU over T new tokens, with its state.

    z: [N, T, C] raw projections (BF16 in the model); conv_state: [N, C, K-1] the K-1 previous raw
    inputs (oldest first; zeros at a sequence start); weight: [C, K] FP32, weight[:, K-1] multiplies
    the current token. Returns u: [N, T, C] in the compute dtype (silu output, not rounded: the fused
    decode kernels keep it in registers) and the new state [N, C, K-1] (the last K-1 raw inputs,
    stored in the io dtype: BF16 in the model)."""
    K = weight.shape[-1]
    window = torch.cat([conv_state.transpose(1, 2).to(P.compute), z.to(P.compute)], dim=1)  # [N, K-1+T, C]
    wt = weight.to(P.compute)
    T = z.shape[1]
    acc = sum(window[:, j:j + T, :] * wt[:, j] for j in range(K))
    u = torch.nn.functional.silu(acc)
    new_state = window[:, T:, :].transpose(1, 2)                                               # [N, C, K-1]
    return u, P.rnd(new_state).contiguous()


# ---------------------------------------------------------------------------- gates (7.2 steps 5, 6)

def decay_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Lower-bounded decay (log-space): lam = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)) in (lb, 0).

    f: [..., H, D] (compute dtype), a_log: [H], dt_bias: [H, D]. exp(lam) in (e^-5, 1) is the per
    key-channel decay factor. This is NOT Kimi-Linear's -exp(A_log)*softplus(.) form."""
    return lower_bound * torch.sigmoid(torch.exp(a_log.to(f.dtype))[:, None] * (f + dt_bias.to(f.dtype)))


# ---------------------------------------------------------------------------- the gated delta rule (7.2 step 7)

def gated_delta_rule_recurrent(q, k, v, lam, beta, state):
    """The specification of KDA's recurrence, one token at a time.

    q, k: [N, T, H, K] (L2-normalised, q already scaled by D^-1/2); v: [N, T, H, V]; lam: [N, T, H, K]
    log decay per key channel; beta: [N, T, H]; state: [N, H, V, K] (S[v, k]). For each token, in
    this order (vLLM fused_recurrent_kda_packed_decode_kernel):
        S <- S * exp(lam)[None, :]        decay along the key axis
        e  = v - S k                      prediction error
        S <- S + beta * e k^T             rank-1 delta update
        o  = S q                          read with the UPDATED state
    Returns o: [N, T, H, V] and the final state (new tensor)."""
    S = state.clone()
    outs = []
    for t in range(q.shape[1]):
        S = S * torch.exp(lam[:, t])[:, :, None, :]
        e = v[:, t] - torch.einsum("nhvk,nhk->nhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * e[..., :, None] * k[:, t][..., None, :]
        outs.append(torch.einsum("nhvk,nhk->nhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def gated_delta_rule_chunked(q, k, v, lam, beta, state, chunk: int = 16):
    """The same recurrence in chunks (prefill form). Same arguments and results as the token loop.

    Within a chunk of C tokens let g_t = sum_{s<=t} lam_s (cumulative log decay, per key channel, so
    g_t <= g_s for s <= t) and S_0 the state entering the chunk. Unrolling the loop gives
        S_t = S_0 diag(e^{g_t}) + sum_{s<=t} u_s (k_s * e^{g_t - g_s})^T
    with the "pseudo-values" u_s = beta_s (v_s - S'_s k_s), S'_s the decayed state before token s.
    Expanding S'_s k_s with the same formula makes u the solution of a unit lower-triangular system
        u_s + beta_s sum_{r<s} (k_s . (k_r * e^{g_s - g_r})) u_r = beta_s (v_s - S_0 (k_s * e^{g_s}))
    and then
        o_t = S_0 (q_t * e^{g_t}) + sum_{s<=t} (q_t . (k_s * e^{g_t - g_s})) u_s
        S_C = S_0 diag(e^{g_C}) + sum_s u_s (k_s * e^{g_C - g_s})^T.
    Every exponent is g_later - g_earlier <= 0, so nothing overflows whatever the chunk length."""
    N, T, H, K = q.shape
    S = state.clone()
    outs = []
    for c0 in range(0, T, chunk):
        qc, kc, vc = (x[:, c0:c0 + chunk].transpose(1, 2) for x in (q, k, v))   # [N, H, C, .]
        lc, bc = lam[:, c0:c0 + chunk].transpose(1, 2), beta[:, c0:c0 + chunk].transpose(1, 2)
        C = qc.shape[2]
        g = lc.cumsum(2)                                                            # [N, H, C, K]
        # pairwise decayed key products; diff[t, s] = g_t - g_s, used only for s <= t
        diff = g[:, :, :, None, :] - g[:, :, None, :, :]                            # [N, H, C, C, K]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal[:, :, None], torch.exp(diff.clamp(max=0)), torch.zeros((), dtype=q.dtype, device=q.device))
        kk = torch.einsum("nhtk,nhsk,nhtsk->nhts", kc, kc, decay)                   # k_t . (k_s e^{g_t-g_s})
        qk = torch.einsum("nhtk,nhsk,nhtsk->nhts", qc, kc, decay)                   # q_t . (k_s e^{g_t-g_s})
        A = torch.eye(C, dtype=q.dtype, device=q.device) + bc[..., None] * kk.tril(-1)
        rhs = bc[..., None] * (vc - torch.einsum("nhvk,nhsk->nhsv", S, kc * torch.exp(g)))
        u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [N, H, C, V]
        o = torch.einsum("nhvk,nhtk->nhtv", S, qc * torch.exp(g)) + qk @ u
        gC = g[:, :, -1]                                                            # [N, H, K]
        S = S * torch.exp(gC)[:, :, None, :] + torch.einsum("nhsv,nhsk->nhvk", u, kc * torch.exp(gC[:, :, None] - g))
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1), S


# ---------------------------------------------------------------------------- the whole KDA attention

def scatter_valid_rows(pool: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, new: torch.Tensor) -> None:
    """pool[idx[n]] = new[n] for the valid rows n only, without a data-dependent shape (so it can be
    captured in a CUDA graph): each padded row repeats the first valid row's (slot, value), and if no
    row is valid, slot idx[0] gets its own current value back. Untouched slots stay bit-identical."""
    N = idx.shape[0]
    first = torch.argmax(valid.to(torch.int32))                      # 0 when no row is valid
    src = torch.where(valid, torch.arange(N, device=idx.device), first)
    old = pool[idx]
    rows = torch.where(valid[src].view(-1, *([1] * (new.dim() - 1))), new[src].to(pool.dtype), old[src])
    pool.index_copy_(0, idx[src], rows)


def kda_core(pr: dict[str, torch.Tensor], w, conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
             T: int, cfg, P: Precision, *, chunked: bool = False) -> torch.Tensor:
    """Steps 2-8 of section 7.2 on the raw projections ``pr`` (see ``kda_projections``): short conv +
    SiLU, q/k L2 norms, decay gate, beta, the gated delta rule in place on the state at ``slots``, and
    the gated output RMSNorm. Returns y [N*T, P] (BF16 in the model); padding rows are zero."""
    H, D = cfg.kda_heads, cfg.kda_head_dim
    Pw = H * D
    N = slots.shape[0]
    valid = slots >= 0
    idx = slots.clamp_min(0).long()

    # state read: padded requests start from zeros and are never written back
    cs = torch.where(valid[:, None, None], conv_state[idx], torch.zeros((), dtype=conv_state.dtype, device=slots.device))
    S0 = torch.where(valid[:, None, None, None], rec_state[idx],
                     torch.zeros((), dtype=rec_state.dtype, device=slots.device)).to(P.state_dtype)

    z = torch.cat([pr["zq"], pr["zk"], pr["zv"]], dim=-1).view(N, T, 3 * Pw)
    conv_w = torch.cat([w.q_conv, w.k_conv, w.v_conv], dim=0).view(3 * Pw, -1)
    u, cs_new = short_conv(z, cs, conv_w, P)
    q, k, v = (t.reshape(N, T, H, D) for t in u.split(Pw, dim=-1))
    q = l2_norm(q) * D ** -0.5
    k = l2_norm(k)
    lam = decay_gate(P.f(pr["f"]).view(N, T, H, D), w.A_log, w.dt_bias.view(H, D), cfg.gate_lower_bound)
    beta = torch.sigmoid(P.f(pr["b"]).view(N, T, H))
    rule = gated_delta_rule_chunked if chunked else gated_delta_rule_recurrent
    o, S = rule(q.to(P.state_dtype), k.to(P.state_dtype), v.to(P.state_dtype), lam.to(P.state_dtype),
                beta.to(P.state_dtype), S0)

    # state write-back at valid slots only (padded slots stay bit-identical)
    scatter_valid_rows(conv_state, idx, valid, cs_new)
    scatter_valid_rows(rec_state, idx, valid, S)

    y = gated_rms_norm(o.to(P.compute), w.o_norm.to(P.compute), P.f(pr["g"]).view(N, T, H, D), cfg.rms_norm_eps)
    y = P.rnd(y.reshape(N * T, Pw))
    return y * valid.repeat_interleave(T)[:, None].to(y.dtype)          # padding rows: zero output


def kda_attention(x: torch.Tensor, w, conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                  T: int, cfg, P: Precision, *, chunked: bool = False) -> torch.Tensor:
    """KDA for N requests of T new tokens each, in place on the state (section 7.2 steps 1-9).

    x: [N*T, d] input-RMSNorm output, rows request-major (the T tokens of request n are rows
    n*T .. n*T+T-1). conv_state [S, 3P, 3] and rec_state [S, H, D, D] are updated in place at
    ``slots`` ([N] int64/int32); slot < 0 is padding. Returns a: [N*T, d], the o_proj output (on a
    TP rank: this rank's partial sum, section 13.2). ``chunked`` picks the prefill form."""
    y = kda_core(kda_projections(x, w, P), w, conv_state, rec_state, slots, T, cfg, P, chunked=chunked)
    return P.linear(y, w.o_proj)
