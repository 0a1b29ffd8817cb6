"""Tensor parallelism for one layer, spelled out (docs/k3-layer.md §13).

``slice_layer(w, cfg, rank, tp)`` cuts a full-width layer into what rank ``rank`` of ``tp`` holds
under vLLM's standard layout: heads, shared experts, the expert intermediate and the dense MLP are
split; AttnRes, the norms, KDA's f_a, MLA's q_a/kv_a, the router and the latent projections are
replicated. ``decode_step_tp`` runs all ranks in one process and shows where their partial outputs
are summed (the all-reduces of section 13.2):

    1. the attention output a (o_proj is row-parallel)            -> sum over ranks
    2. the routed latent r (experts split along the intermediate) -> sum over ranks, THEN the RMSNorm
    3. the shared-expert output (down_proj is row-parallel)        -> sum over ranks
    (layer 0: the dense MLP's down_proj output instead of 2 and 3)
"""
from __future__ import annotations

import dataclasses

import torch

from .attnres import ResidualStream, pre_attention, pre_mlp
from .config import K3Config
from .kda import kda_attention
from .mla import mla_attention
from .moe import dense_mlp, route, routed_experts, shared_experts
from .norms import rms_norm
from .precision import Precision
from .state import KDAState, MLACache
from .weights import DenseMLPWeights, KDAWeights, LayerWeights, MLAWeights, MoEWeights


def rank_config(cfg: K3Config, tp: int) -> K3Config:
    if cfg.tp != 1:
        raise ValueError("slice from a full-width (tp=1) config")
    return cfg.with_(tp=tp, name=f"{cfg.name}_rank{tp}")


def _rows(t: torch.Tensor, rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n).contiguous()


def slice_layer(w: LayerWeights, cfg: K3Config, rank: int, tp: int) -> LayerWeights:
    """Rank ``rank``'s weights of a full-width layer (cfg.tp == 1)."""
    if not (0 <= rank < tp):
        raise ValueError(f"rank {rank} outside [0, {tp})")
    rcfg = rank_config(cfg, tp)
    if isinstance(w.attn, KDAWeights):
        k = w.attn
        D = cfg.kda_head_dim
        attn = dataclasses.replace(
            k, q_proj=_rows(k.q_proj, rank, tp), k_proj=_rows(k.k_proj, rank, tp), v_proj=_rows(k.v_proj, rank, tp),
            g_proj=_rows(k.g_proj, rank, tp), f_b_proj=_rows(k.f_b_proj, rank, tp), b_proj=_rows(k.b_proj, rank, tp),
            q_conv=_rows(k.q_conv, rank, tp), k_conv=_rows(k.k_conv, rank, tp), v_conv=_rows(k.v_conv, rank, tp),
            A_log=_rows(k.A_log, rank, tp), dt_bias=_rows(k.dt_bias, rank, tp), o_proj=_rows(k.o_proj, rank, tp, 1))
        assert attn.q_proj.shape[0] == rcfg.kda_heads * D
    else:
        m = w.attn
        attn = dataclasses.replace(m, q_b_proj=_rows(m.q_b_proj, rank, tp), kv_b_proj=_rows(m.kv_b_proj, rank, tp),
                                   g_proj=_rows(m.g_proj, rank, tp), o_proj=_rows(m.o_proj, rank, tp, 1))
    if isinstance(w.mlp, MoEWeights):
        e = w.mlp
        I_loc, I_val = rcfg.expert_intermediate, rcfg.expert_intermediate_valid

        def pad_rows(t, fill):          # [E, I_val, c] -> [E, I_loc, c]
            extra = t.new_full((t.shape[0], I_loc - t.shape[1], t.shape[2]), fill)
            return torch.cat([t, extra], dim=1)

        def pad_cols(t, n, fill):       # [E, dL, c] -> [E, dL, n]
            extra = t.new_full((t.shape[0], t.shape[1], n - t.shape[2]), fill)
            return torch.cat([t, extra], dim=2)

        g = cfg.mxfp4_group
        # zero codes in padded rows/columns, scale 2^0: the padded intermediate contributes exactly 0
        mlp = dataclasses.replace(
            e, w1_packed=pad_rows(_rows(e.w1_packed, rank, tp, 1), 0), w1_scale=pad_rows(_rows(e.w1_scale, rank, tp, 1), 127),
            w3_packed=pad_rows(_rows(e.w3_packed, rank, tp, 1), 0), w3_scale=pad_rows(_rows(e.w3_scale, rank, tp, 1), 127),
            w2_packed=pad_cols(_rows(e.w2_packed, rank, tp, 2), I_loc // 2, 0),
            w2_scale=pad_cols(_rows(e.w2_scale, rank, tp, 2), I_loc // g, 127),
            shared_gate=_rows(e.shared_gate, rank, tp), shared_up=_rows(e.shared_up, rank, tp),
            shared_down=_rows(e.shared_down, rank, tp, 1))
        assert I_val % g == 0, "the TP slice of an expert must hold whole MXFP4 groups"
    else:
        d = w.mlp
        mlp = DenseMLPWeights(gate=_rows(d.gate, rank, tp), up=_rows(d.up, rank, tp), down=_rows(d.down, rank, tp, 1))
    return dataclasses.replace(w, attn=attn, mlp=mlp)


def slice_state(state, cfg: K3Config, rank: int, tp: int):
    """Rank ``rank``'s view of a full-width layer state (KDA: its heads; MLA: the replicated cache)."""
    if isinstance(state, KDAState):
        Pw = cfg.kda_proj
        n = Pw // tp
        conv = torch.cat([state.conv[:, j * Pw + rank * n: j * Pw + (rank + 1) * n] for j in range(3)], dim=1)
        return KDAState(conv=conv.contiguous(), recurrent=_rows(state.recurrent, rank, tp, 1))
    return MLACache(state.kv.clone(), state.lengths.clone())


def merge_kda_states(states, cfg: K3Config) -> KDAState:
    """Inverse of ``slice_state`` for KDA: concatenate the ranks' heads back into a full-width state."""
    tp = len(states)
    n = cfg.kda_proj // tp
    conv = torch.cat([s.conv[:, j * n:(j + 1) * n] for j in range(3) for s in states], dim=1)
    return KDAState(conv=conv, recurrent=torch.cat([s.recurrent for s in states], dim=1))


def decode_step_tp(w: LayerWeights, cfg: K3Config, stream: ResidualStream, state, slots: torch.Tensor, tp: int,
                   P: Precision, T: int = 1):
    """Run every rank of a TP-``tp`` layer in this process, summing partials where the model all-reduces.

    Returns (stream with delta = layer output, list of the ranks' updated states)."""
    rcfg = rank_config(cfg, tp)
    ranks = [slice_layer(w, cfg, r, tp) for r in range(tp)]
    states = [slice_state(state, cfg, r, tp) for r in range(tp)]
    x = pre_attention(stream, w.layer, w.attn_res, w.input_layernorm, cfg, P)      # replicated
    partial_a = []
    for rw, st in zip(ranks, states):
        if isinstance(rw.attn, KDAWeights):
            partial_a.append(kda_attention(x, rw.attn, st.conv, st.recurrent, slots, T, rcfg, P))
        else:
            partial_a.append(mla_attention(x, rw.attn, st.kv, st.lengths, slots, T, rcfg, P))
    a = _all_reduce(partial_a, P)                                                    # all-reduce 1
    x_mlp = pre_mlp(stream, w.layer, a, w.mlp_res, w.post_attention_layernorm, cfg, P)
    if isinstance(w.mlp, MoEWeights):
        ids, weights = route(x_mlp, w.mlp, cfg, P)                                   # replicated
        z = P.linear(x_mlp, w.mlp.down)                                              # replicated
        r = _all_reduce([routed_experts(z, ids, weights, rw.mlp, rcfg, P) for rw in ranks], P)   # all-reduce 2
        routed = P.linear(P.rnd(rms_norm(P.f(r), w.mlp.norm, cfg.rms_norm_eps)), w.mlp.up)       # replicated
        shared = _all_reduce([shared_experts(x_mlp, rw.mlp, rcfg, P) for rw in ranks], P)        # all-reduce 3
        f = P.rnd(P.f(routed) + P.f(shared))
    else:
        f = _all_reduce([dense_mlp(x_mlp, rw.mlp, rcfg, P) for rw in ranks], P)
    stream.delta = f
    return stream, states


def _all_reduce(parts, P: Precision) -> torch.Tensor:
    """Sum the ranks' partial outputs (a BF16 all-reduce in the model: FP32 sum, one rounding)."""
    return P.rnd(sum(P.f(t) for t in parts))
