"""Whole-layer properties of the reference: state carried across steps, padding, AttnRes bookkeeping, TP."""
import copy

import pytest
import torch

from k3ref import K3DecoderLayer, Precision, ResidualStream, allocate_state, random_layer, tiny
from k3ref.attnres import attn_res_mix, attn_res_u
from k3ref.norms import rms_norm
from k3ref.tp import decode_step_tp, merge_kda_states, slice_state
from tolerances import assert_close

pytestmark = pytest.mark.ref

CFG = tiny()
KINDS = {"kda_moe": 1, "kda_boundary": 2, "mla_moe": 3, "kda_dense": 0}


def _stream(rows, cfg, dtype, layer):
    emb = torch.randn(rows, cfg.hidden_size, dtype=torch.float64).to(dtype)
    s = ResidualStream.from_embeddings(emb, cfg.max_blocks)
    s.blocks[:, :cfg.num_blocks_before(layer)] = torch.randn_like(s.blocks[:, :cfg.num_blocks_before(layer)], dtype=torch.float64).to(dtype)
    s.delta = None if layer == 0 else torch.randn(rows, cfg.hidden_size, dtype=torch.float64).to(dtype)
    return s


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_steps_equal_prefill(seed, kind):
    """Prefill of T tokens (chunked KDA / naive MLA) == T decode steps (token loop / absorbed), fp64.
    Requests are independent: each row of a decode step is one request's token t."""
    layer, P, N, T = KINDS[kind], Precision.exact(), 2, 6
    w = random_layer(CFG, layer, seed=seed)
    L = K3DecoderLayer(CFG, w, P)
    slots = torch.tensor([3, 1])
    st0 = allocate_state(CFG, layer, 4, max_len=16, P=P)
    if hasattr(st0, "recurrent"):
        st0.recurrent.normal_(0, 0.1)
        st0.conv.normal_()
    s_all = _stream(N * T, CFG, P.io_dtype, layer)
    st_pre = copy.deepcopy(st0)
    s_pre = s_all.clone()
    L.prefill(s_pre, st_pre, slots, T)
    st_dec = copy.deepcopy(st0)
    rows = torch.arange(N * T).view(N, T)
    outs = []
    for t in range(T):
        s_t = ResidualStream(s_all.blocks[rows[:, t]].clone(), s_all.partial[rows[:, t]].clone(),
                             None if s_all.delta is None else s_all.delta[rows[:, t]].clone())
        L.decode_step(s_t, st_dec, slots)
        outs.append((s_t.delta, s_t.partial, s_t.blocks))
    for name, i in (("delta", 0), ("partial", 1), ("blocks", 2)):
        dec = torch.stack([o[i] for o in outs], dim=1).flatten(0, 1)
        assert_close(name, dec, getattr(s_pre, name), "fp64_reformulation")
    for f in ("conv", "recurrent", "kv", "lengths"):
        if hasattr(st0, f):
            a, b = getattr(st_dec, f), getattr(st_pre, f)
            if f == "lengths":
                assert torch.equal(a, b)
            else:
                assert_close(f, a, b, "fp64_reformulation")


@pytest.mark.parametrize("kind", ["kda_moe", "mla_moe"])
def test_padded_and_foreign_slots_untouched(seed, kind):
    layer, P = KINDS[kind], Precision.model()
    L = K3DecoderLayer(CFG, random_layer(CFG, layer, seed=seed), P)
    st = allocate_state(CFG, layer, 5, max_len=8, P=P)
    for t in vars(st).values():
        if t.is_floating_point():
            t.normal_()
    before = copy.deepcopy(st)
    slots = torch.tensor([4, -1, 1, -1])
    s = _stream(4, CFG, P.io_dtype, layer)
    L.decode_step(s, st, slots)
    for f, t in vars(st).items():
        for untouched in (0, 2, 3):
            assert torch.equal(t[untouched], getattr(before, f)[untouched]), f"{f}[{untouched}] changed"
        assert not torch.equal(t[4], getattr(before, f)[4]), f"{f}[4] was not updated"
    assert not torch.isnan(s.delta).any()


def test_moe_vectorised_equals_loop(seed):
    from k3ref.moe import latent_moe
    for P, key in ((Precision.exact(), "fp64_reformulation"), (Precision.model(), "exact")):
        w = random_layer(CFG, 1, seed=seed).mlp
        x = torch.randn(5, CFG.hidden_size, dtype=torch.float64).to(P.io_dtype)
        assert_close(f"moe {P.compute}", latent_moe(x, w, CFG, P), latent_moe(x, w, CFG, P, loop=True), key)


def test_router_selection_uses_bias_weights_do_not(seed):
    from k3ref.moe import route
    P = Precision.exact()
    w = random_layer(CFG, 1, seed=seed).mlp
    x = torch.randn(3, CFG.hidden_size, dtype=torch.float64)
    w.e_score_correction_bias = torch.zeros(CFG.num_experts, dtype=torch.float32)
    w.e_score_correction_bias[[5, 7, 11, 13]] = 100.0              # force these four
    ids, ws = route(x, w, CFG, P)
    assert sorted(ids[0].tolist()) == [5, 7, 11, 13]
    s = torch.sigmoid(x @ w.gate.double().T)
    want = s.gather(1, ids) / s.gather(1, ids).sum(1, keepdim=True)
    assert_close("weights", ws, want, "fp64_reformulation")
    assert torch.allclose(ws.sum(1), torch.ones(3, dtype=torch.float64))


def test_router_ties_pick_lower_index():
    from k3ref.moe import route
    P = Precision.exact()
    w = random_layer(CFG, 1).mlp
    w.gate = torch.zeros_like(w.gate)                               # every score is sigmoid(0) = 0.5
    w.e_score_correction_bias = torch.zeros(CFG.num_experts)
    ids, ws = route(torch.randn(2, CFG.hidden_size, dtype=torch.float64), w, CFG, P)
    assert ids[0].tolist() == list(range(CFG.num_experts_per_token))
    assert torch.allclose(ws, torch.full_like(ws, 1 / CFG.num_experts_per_token))


def _hf_layer_reference(w, layer, blocks_list, p_in, cfg, attn_fn, mlp_fn, P):
    """HF semantics (section 4.2), written with a python list of blocks: the independent check."""
    u1, u2 = attn_res_u(w.attn_res, P), attn_res_u(w.mlp_res, P)
    mix = lambda srcs, u: attn_res_mix(torch.stack(srcs, 1), u, cfg.rms_norm_eps)
    if layer % cfg.attn_res_block_size == 0:
        h = p_in if not blocks_list else mix(blocks_list + [p_in], u1)
        blocks_list = blocks_list + [p_in]
        p = None
    else:
        h = mix(blocks_list + [p_in], u1)
        p = p_in
    a = attn_fn(rms_norm(h, w.input_layernorm, cfg.rms_norm_eps))
    p = a if p is None else p + a
    f = mlp_fn(rms_norm(mix(blocks_list + [p], u2), w.post_attention_layernorm, cfg.rms_norm_eps))
    return blocks_list, p + f


def test_attnres_bookkeeping_across_a_block_boundary(seed):
    """Layers 1, 2 (boundary), 3 with the attention and MLP replaced by fixed maps, fp64: vLLM's
    factorisation (B tensor, delta deferred) must equal HF's list-of-blocks semantics."""
    from k3ref.attnres import pre_attention, pre_mlp
    P, cfg = Precision.exact(), CFG
    Wa = torch.randn(cfg.hidden_size, cfg.hidden_size, dtype=torch.float64) * 0.05
    Wm = torch.randn(cfg.hidden_size, cfg.hidden_size, dtype=torch.float64) * 0.05
    attn_fn, mlp_fn = (lambda x: torch.tanh(x @ Wa)), (lambda x: torch.tanh(x @ Wm))
    N = 3
    emb = torch.randn(N, cfg.hidden_size, dtype=torch.float64)
    ws = [random_layer(cfg, l, seed=seed) for l in range(4)]
    hf_blocks, hf_p = [], emb
    stream = ResidualStream.from_embeddings(emb, cfg.max_blocks)
    for l in range(4):
        hf_blocks, hf_p = _hf_layer_reference(ws[l], l, hf_blocks, hf_p, cfg, attn_fn, mlp_fn, P)
        x = pre_attention(stream, l, ws[l].attn_res, ws[l].input_layernorm, cfg, P)
        x_mlp = pre_mlp(stream, l, attn_fn(x), ws[l].mlp_res, ws[l].post_attention_layernorm, cfg, P)
        stream.delta = mlp_fn(x_mlp)
        assert_close(f"p_out[{l}]", stream.hidden(), hf_p, "fp64_reformulation")
        assert len(hf_blocks) == cfg.num_blocks_before(l + 1)
        for j, b in enumerate(hf_blocks):
            assert torch.equal(stream.blocks[:, j], b), f"block {j} after layer {l}"


@pytest.mark.parametrize("kind,tp", [("kda_moe", 2), ("kda_moe", 4), ("mla_moe", 2), ("mla_moe", 4), ("kda_dense", 2)])
def test_tp_slices_summed_equal_full_layer(seed, kind, tp):
    """tp=4 on tiny pads the expert intermediate 16 -> 32 (vLLM's minimum): the padding must add 0."""
    layer, P = KINDS[kind], Precision.exact()
    w = random_layer(CFG, layer, seed=seed)
    st = allocate_state(CFG, layer, 3, max_len=8, P=P)
    for t in vars(st).values():
        if t.is_floating_point():
            t.normal_(0, 0.3)
    slots = torch.tensor([2, 0])
    s_full = _stream(2, CFG, P.io_dtype, layer)
    s_tp = s_full.clone()
    st_full = copy.deepcopy(st)
    K3DecoderLayer(CFG, w, P).decode_step(s_full, st_full, slots)
    s_tp, states = decode_step_tp(w, CFG, s_tp, st, slots, tp, P)
    assert_close("layer output", s_tp.delta, s_full.delta, "fp64_reformulation")
    assert_close("partial", s_tp.partial, s_full.partial, "fp64_reformulation")
    if hasattr(st, "recurrent"):
        merged = merge_kda_states(states, CFG)
        assert_close("recurrent", merged.recurrent, st_full.recurrent, "fp64_reformulation")
        assert torch.equal(merged.conv, st_full.conv)


def test_model_precision_close_to_exact(seed):
    """BF16 model mode vs fp64 on the same weights: the rounding points cost about BF16 precision."""
    for layer in (1, 3):
        w = random_layer(CFG, layer, seed=seed)
        outs = []
        for P in (Precision.model(), Precision.exact()):
            st = allocate_state(CFG, layer, 2, max_len=8, P=P)
            torch.manual_seed(seed)
            s = _stream(2, CFG, P.io_dtype, layer)
            K3DecoderLayer(CFG, w, P).decode_step(s, st, torch.tensor([0, 1]))
            outs.append(s.delta)
        assert_close(f"layer {layer}", outs[0].double(), outs[1], "bf16_layer")
