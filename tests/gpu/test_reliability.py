"""Reliability of the fused layer inside a batch (GPU): long decodes against k3ref in fp64, one hostile request
among healthy ones, bad arguments refused before launch, and CUDA-graph captures that share scratch buffers.

K3_RECORD_DIR, when set, receives the long-decode error curves (JSON) for the record under traces/."""
import json
import os

import pytest
import torch

from k3ref import k3_rank
from k3ref.weights import random_layer
from k3fast.measure.impls import make_impl, make_io
from tolerances import TOLERANCES

pytestmark = pytest.mark.gpu

LAYER_KDA, LAYER_KDA2, LAYER_MLA = 1, 2, 3


# ------------------------------------------------------------------------------------------------ long decode

# The fused path rounds where the model rounds, so its error against fp64 follows k3ref's own model-precision
# path over the run; a defect that leaks into the state grows with the steps and breaks the ratio. The ratio is taken
# between the worst errors of the run (single points are noisy: one step's model error can be small by chance).
LONG_RATIO_MAX = 2.0
# The continuous quantities (MoE input, KDA recurrent and conv state, MLA cache rows) also stay inside bf16_layer.
# The layer output does not, for either path: where the router's top-16 holds a near-tie, one BF16 rounding swaps
# an expert and that token's output moves by O(1) (measured on an H100 over 2,000 steps: the model path's worst
# output error 0.23 at KDA b8 and 0.39 at MLA b1, with the fused path within 1.1x of it).
CONTINUOUS = ("x_mlp", "state", "conv")


@pytest.mark.parametrize("layer,batch,impl", [(LAYER_KDA, 1, "fast"), (LAYER_KDA, 8, "fast"), (LAYER_MLA, 1, "fast"),
                                              (LAYER_MLA, 8, "fast"), (LAYER_MLA, 8, "fast-mla")],
                         ids=["kda-b1", "kda-b8", "mla-b1", "mla-b8", "mla-b8-fused"])
def test_long_decode_stays_with_the_model_path(layer, batch, impl):
    """2,000 decode steps, requests joining at different steps (different lengths, padding before the start): the
    fused layer's worst error against k3ref fp64 is at most LONG_RATIO_MAX x k3ref's own model-precision worst
    error, for the MoE input, the state and the layer output; the continuous ones also within bf16_layer; padding
    slots stay zero (the instrument checks every step). An MLA layer's attention half is the stock one (vLLM's own
    path, or its fallbacks) under "fast", FusedMLA under "fast-mla", whose cache rows grow to 2,000 over the run."""
    from k3fast.measure.reliability import long_decode, summarize
    rec = long_decode("k3_rank16", layer, batch, 2000, impl=impl, seed=11 + batch)
    rec["summary"] = summarize(rec)
    if os.environ.get("K3_RECORD_DIR"):
        from k3fast.measure.trace import environment
        tag = "" if impl == "fast" else f"-{impl}"
        path = os.path.join(os.environ["K3_RECORD_DIR"], f"long-decode-{rec['layer_kind']}-b{batch}{tag}.json")
        with open(path, "w") as f:
            json.dump({"environment": environment(), "command": "pytest tests/gpu/test_reliability.py "
                       "(K3_RECORD_DIR set)", "records": [rec]}, f)
    bound = TOLERANCES["bf16_layer"][1]
    for q, s in rec["summary"].items():
        assert s["impl_max"] <= LONG_RATIO_MAX * s["model_max"], (
            f"{q}: worst error {s['impl_max']:.3e} > {LONG_RATIO_MAX} x the model path's {s['model_max']:.3e}")
        if q in CONTINUOUS:
            assert s["impl_max"] <= bound, f"{q}: worst error {s['impl_max']:.3e} > {bound} over {rec['steps']} steps"


# ------------------------------------------------------------------------------------- one hostile request

def _set_row(io, row, kind):
    """Make request ``row`` hostile: NaN / Inf / huge activations in its AttnRes inputs, or a zero MLP-side input
    whose router scores all tie (with the score bias cleared by the caller)."""
    big = torch.finfo(torch.bfloat16).max / 4
    if kind == "nan":
        io.partial[row, :: 7] = float("nan")
    elif kind == "inf":
        io.blocks[row, 0, :: 5] = float("inf")
        io.delta[row, 1::5] = -float("inf")
    elif kind == "huge":
        io.partial[row] = big
        io.blocks[row] = -big


HOSTILE = ["nan", "inf", "huge", "tied_router", "edge_slot"]


@pytest.mark.parametrize("batch", [2, 8, 64])
@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_request_leaves_the_others_bit_identical(kind, batch):
    """One request of the batch is hostile; every other request's layer output, MoE input, partial sum and state
    slot are bit-identical to the same batch where that request is healthy. The hostile row itself must not
    touch any slot but its own."""
    cfg = k3_rank(16)
    w = random_layer(cfg, LAYER_KDA, seed=51, device="cuda")
    if kind == "tied_router":
        w.mlp.e_score_correction_bias.zero_()
    bad = batch // 2
    runs = {}
    for label in ("healthy", "hostile"):
        io = make_io(cfg, LAYER_KDA, batch, seed=52, slots=batch + 3)
        if kind == "edge_slot":
            edge, free = io.state.recurrent.shape[0] - 1, batch + 1   # the pool's last slot; an ordinary free one
            io.slots[bad] = free if label == "healthy" else edge
            io.state.recurrent[edge] = io.state.recurrent[free]       # the same starting state in both
            io.state.conv[edge] = io.state.conv[free]
        elif label == "hostile" and kind != "tied_router":
            _set_row(io, bad, kind)
        impl = make_impl("fast", cfg, w, max_batch=batch)
        before = (io.state.recurrent.clone(), io.state.conv.clone())
        if kind == "tied_router":
            impl.attn(io)
            if label == "hostile":
                io.x_mlp[bad] = 0                                     # every router logit 0: all scores tie
            impl.moe(io)
        else:
            impl.layer(io)
        torch.cuda.synchronize()
        runs[label] = io, before
    (h, _), (x, x0) = runs["healthy"], runs["hostile"]
    others = [r for r in range(batch) if r != bad]
    for name in ("out", "x_mlp", "partial"):
        same = torch.equal(getattr(h, name)[others], getattr(x, name)[others])
        assert same, f"{kind}: other requests' {name} changed"
    slots = h.slots[others].long()
    assert torch.equal(h.state.recurrent[slots], x.state.recurrent[slots]), f"{kind}: other slots' state changed"
    assert torch.equal(h.state.conv[slots], x.state.conv[slots]), f"{kind}: other slots' conv state changed"
    # the slots nobody owns are untouched in the hostile run
    owned = torch.zeros(x.state.recurrent.shape[0], dtype=torch.bool, device="cuda")
    owned[x.slots.long()] = True
    assert torch.equal(x.state.recurrent[~owned], x0[0][~owned]), f"{kind}: an unowned slot's state changed"
    assert torch.equal(x.state.conv[~owned], x0[1][~owned]), f"{kind}: an unowned slot's conv state changed"
    if kind in ("tied_router", "edge_slot"):
        assert not torch.isnan(x.out[bad]).any(), f"{kind}: the request's own output is NaN"
    if kind == "edge_slot":
        # the request at the pool's edge gets the same answer as in an ordinary slot
        assert torch.equal(h.out[bad], x.out[bad])
        assert torch.equal(h.state.recurrent[batch + 1], x.state.recurrent[x.slots[bad].long()])


MLA_HOSTILE = ["nan", "inf", "huge", "nan_cache", "edge_slot"]


@pytest.mark.parametrize("batch", [2, 8, 64])
@pytest.mark.parametrize("kind", MLA_HOSTILE)
def test_hostile_request_in_an_mla_batch_leaves_the_others_bit_identical(kind, batch):
    """The same for a Gated-MLA layer on FusedMLA ("fast-mla"), with the requests' caches 1 to 100 rows long and,
    from batch 8, a padded request (slot -1): every other request's output, MoE input and partial sum and every
    other slot's cache rows are bit-identical to the healthy run; the hostile request writes only its own new row;
    the padded one writes nothing. "nan_cache": NaN in the request's own cached rows (a corrupt cache stays that
    request's problem). "edge_slot": the request's cache is the pool's last slot."""
    cfg = k3_rank(16)
    w = random_layer(cfg, LAYER_MLA, seed=61, device="cuda")
    bad = batch // 2
    pad = batch - 1 if batch >= 8 else None
    impl = make_impl("fast-mla", cfg, w, max_batch=batch)             # one layer for both runs: the same kernels
    runs = {}
    for label in ("healthy", "hostile"):
        io = make_io(cfg, LAYER_MLA, batch, context=100, seed=62, slots=batch + 3)
        st = io.state
        st.lengths[1:batch + 1] = torch.arange(batch, device="cuda") * 37 % 100 + 1
        if pad is not None:
            io.slots[pad] = -1
        if kind == "edge_slot":
            edge, free = st.kv.shape[0] - 1, batch + 1                 # the pool's last slot; an ordinary free one
            io.slots[bad] = free if label == "healthy" else edge
            st.kv[edge], st.lengths[edge] = st.kv[free], st.lengths[bad + 1]   # the same start in both
            st.lengths[free] = st.lengths[bad + 1]
        elif label == "hostile" and kind == "nan_cache":
            st.kv[bad + 1, :int(st.lengths[bad + 1]):3] = float("nan")
        elif label == "hostile":
            _set_row(io, bad, kind)
        before = (st.kv.clone(), st.lengths.clone())
        impl.layer(io)
        torch.cuda.synchronize()
        runs[label] = io, before
    (h, _), (x, x0) = runs["healthy"], runs["hostile"]
    others = [r for r in range(batch) if r not in (bad, pad)]
    for name in ("out", "x_mlp", "partial"):
        same = torch.equal(getattr(h, name)[others], getattr(x, name)[others])
        assert same, f"{kind}: other requests' {name} changed"
    bits = lambda t: t.view(torch.int16)                               # NaN-proof bitwise comparison
    mine = int(x.slots[bad])
    for s in range(x.state.kv.shape[0]):
        if s != mine and not (kind == "edge_slot" and s in (batch + 1, x.state.kv.shape[0] - 1)):
            assert torch.equal(bits(h.state.kv[s]), bits(x.state.kv[s])), f"{kind}: slot {s}'s cache changed"
    # the hostile request's own slot: only its new row (position L0) differs from before the step
    L0 = int(x0[1][mine])
    changed = (bits(x.state.kv[mine]) != bits(x0[0][mine])).any(dim=-1).nonzero().flatten().tolist()
    assert set(changed) <= {L0}, f"{kind}: rows {changed} of the request's own cache changed, expected only {L0}"
    if pad is not None:
        owned = set(x.slots.tolist())
        for s in range(x.state.kv.shape[0]):
            if s not in owned:
                assert torch.equal(bits(x.state.kv[s]), bits(x0[0][s])), f"{kind}: unowned slot {s} was written"
    if kind == "edge_slot":
        # the request at the pool's edge gets the same answer, and its new row, as in an ordinary slot
        assert torch.equal(h.out[bad], x.out[bad])
        assert torch.equal(bits(h.state.kv[batch + 1, L0]), bits(x.state.kv[mine, L0]))
        assert not torch.isnan(x.out[bad]).any()


def test_slot_past_the_pool_inside_a_graph_writes_nothing():
    """Inside a CUDA graph the host check cannot run: a slot index past the pool leaves every state slot untouched
    and turns only that request's rows to NaN, so the error cannot pass silently."""
    from k3fast.measure.trace import capture
    cfg = k3_rank(16)
    w = random_layer(cfg, LAYER_KDA, seed=53, device="cuda")
    impl = make_impl("fast", cfg, w, max_batch=4)
    io = make_io(cfg, LAYER_KDA, 4, seed=54)
    g = capture(lambda: impl.attn(io))
    io.reset()
    before = (io.state.recurrent.clone(), io.state.conv.clone())
    ok = io.slots.clone()
    io.slots[2] = io.state.recurrent.shape[0]
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(io.x_mlp[2]).any(), "the bad request's row is not poisoned"
    keep = [0, 1, 3]
    assert not torch.isnan(io.x_mlp[keep]).any()
    untouched = torch.ones(io.state.recurrent.shape[0], dtype=torch.bool, device="cuda")
    untouched[ok[keep].long()] = False
    assert torch.equal(io.state.recurrent[untouched], before[0][untouched])
    assert torch.equal(io.state.conv[untouched], before[1][untouched])


# --------------------------------------------------------------------------- bad arguments, before launch

def _bad_calls(cfg, w, io):
    """(what is wrong, the argument the error must name, a call that must raise) for the fused attention half."""
    from k3fast.layer import FusedKDA
    kda = FusedKDA(cfg, w)
    st = io.state
    n = st.recurrent.shape[0]

    def call(**over):
        a = dict(blocks=io.blocks, partial=io.partial, delta=io.delta, conv_state=st.conv, rec_state=st.recurrent,
                 slots=io.slots, x_mlp=io.x_mlp)
        a.update(over)
        return lambda: kda(**a)

    s = io.slots
    return [
        ("slot past the pool", "slots", call(slots=torch.tensor([n] + s.tolist()[1:], dtype=torch.int32,
                                                                device="cuda"))),
        ("two requests share a slot", "slots", call(slots=torch.zeros_like(s) + s[0])),
        ("int64 slots", "slots", call(slots=s.long())),
        ("slots on the CPU", "slots", call(slots=s.cpu())),
        ("2-D slots", "slots", call(slots=s.view(-1, 1))),
        ("fp32 recurrent state", "rec_state", call(rec_state=st.recurrent.double())),
        ("recurrent state on the CPU", "rec_state", call(rec_state=st.recurrent.cpu())),
        ("transposed recurrent state", "rec_state", call(rec_state=st.recurrent.transpose(2, 3))),
        ("conv state of the wrong width", "conv_state", call(conv_state=st.conv[:, :-8])),
        ("fp32 conv state", "conv_state", call(conv_state=st.conv.float())),
        ("pools of different sizes", "conv_state", call(conv_state=st.conv[:-1])),
        ("fp32 partial sum", "partial", call(partial=io.partial.float())),
        ("non-contiguous partial", "partial", call(partial=io.partial.t().contiguous().t())),
        ("blocks of the wrong width", "blocks", call(blocks=io.blocks[..., :-64])),
        ("fp32 MLP input buffer", "x_mlp", call(x_mlp=io.x_mlp.float())),
        ("MLP input buffer of another batch", "x_mlp", call(x_mlp=io.x_mlp[:-1])),
        ("delta on the CPU", "delta", call(delta=io.delta.cpu())),
    ]


def _bad_calls_mla(cfg, w, io):
    """The same for the fused MLA attention half: its paging metadata (mla_step's pages, block table, seqlens)."""
    from k3fast.layer import FusedMLA
    from k3fast.layer_io import mla_step
    mla = FusedMLA(cfg, w)
    step = mla_step(io.state, io.slots)
    n_pages, maxp = step.pages.shape[0], step.block_table.shape[1]

    def call(**over):
        a = dict(blocks=io.blocks, partial=io.partial, delta=io.delta, kv_pages=step.pages,
                 block_table=step.block_table, seqlens=step.seqlens, x_mlp=io.x_mlp)
        a.update(over)
        return lambda: mla(**a)

    bt, sl = step.block_table, step.seqlens
    past = bt.clone()
    past[1, 0] = n_pages
    shared = bt.clone()
    shared[2] = bt[1]
    return [
        ("a page past the pool", "block_table", call(block_table=past)),
        ("two requests appending to one row", "block_table", call(block_table=shared, seqlens=torch.where(
            torch.arange(len(sl), device="cuda") == 2, sl[1], sl))),
        ("a length past the block table", "seqlens", call(seqlens=sl + 64 * maxp)),
        ("int64 block table", "block_table", call(block_table=bt.long())),
        ("block table of another batch", "block_table", call(block_table=bt[:-1])),
        ("seqlens on the CPU", "seqlens", call(seqlens=sl.cpu())),
        ("fp32 cache pages", "kv_pages", call(kv_pages=step.pages.float())),
        ("cache pages of 32 rows", "kv_pages", call(kv_pages=step.pages.view(-1, 32, step.pages.shape[2]))),
        ("fp32 partial sum", "partial", call(partial=io.partial.float())),
        ("blocks of the wrong width", "blocks", call(blocks=io.blocks[..., :-64])),
        ("MLP input buffer of another batch", "x_mlp", call(x_mlp=io.x_mlp[:-1])),
    ]


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_bad_arguments_are_refused_by_name(kind):
    """Every malformed argument of the fused attention half (FusedKDA; FusedMLA) raises before any launch, naming
    the argument; the state pool (or the latent cache and its lengths) and the inputs are left as they were."""
    cfg = k3_rank(16)
    layer, impl, make_cases = {"kda": (LAYER_KDA, "fast", _bad_calls),
                               "mla": (LAYER_MLA, "fast-mla", _bad_calls_mla)}[kind]
    w = random_layer(cfg, layer, seed=55, device="cuda")
    io = make_io(cfg, layer, 4, context=100, seed=56)
    make_impl(impl, cfg, w, max_batch=4).attn(io)                 # compile first: errors must not come from it
    io.reset()
    torch.cuda.synchronize()
    kept = lambda: ((io.state.recurrent, io.state.conv) if kind == "kda" else (io.state.kv, io.state.lengths)) + (
        io.partial, io.blocks)
    snap = [t.clone() for t in kept()]
    cases = make_cases(cfg, w, io)
    for what, arg, fn in cases:
        with pytest.raises((ValueError, TypeError)) as ei:
            fn()
        assert arg in str(ei.value), f"{what}: the error does not name {arg!r}: {ei.value}"
        torch.cuda.synchronize()
        for a, b in zip(snap, kept()):
            assert torch.equal(a, b), f"{what}: a buffer changed before the error"
    print(f"{len(cases)} bad-argument cases of the {kind} half refused")


# ------------------------------------------------------------------------------------------ CUDA-graph safety

def test_two_layers_sharing_scratch_in_one_graph_and_two_captures():
    """Two layers captured back to back in one graph share the kernels' per-device scratch (experts workspace,
    arrival counters); the same layer is also captured in a second graph. Replays with new inputs, new slots and
    a new batch composition match the eager chain bit for bit, and replaying the second graph leaves the first
    graph's outputs alone."""
    from k3fast.measure.trace import capture
    cfg = k3_rank(16)
    B = 8
    ws = [random_layer(cfg, l, seed=57, device="cuda") for l in (LAYER_KDA, LAYER_KDA2)]
    impls = [make_impl("fast", cfg, w, max_batch=B) for w in ws]
    impls[1].fused_moe.workspace = impls[0].fused_moe.workspace     # one experts workspace for both layers
    ios = [make_io(cfg, l, B, seed=58 + i, slots=2 * B) for i, l in enumerate((LAYER_KDA, LAYER_KDA2))]

    def chain():
        impls[0].layer(ios[0])
        ios[1].delta.copy_(ios[0].out)                               # layer 2 reads layer 1's MoE output
        impls[1].layer(ios[1])

    g1 = capture(chain)
    io_b = make_io(cfg, LAYER_KDA, B, seed=70, slots=2 * B)
    g2 = capture(lambda: impls[0].layer(io_b))
    for step in range(3):
        fresh = [make_io(cfg, l, B, seed=80 + 10 * step + i, slots=2 * B)
                 for i, l in enumerate((LAYER_KDA, LAYER_KDA2))]
        perm = torch.randperm(2 * B + 1, device="cuda")[:B].to(torch.int32)   # new slots, some padding
        perm[step] = -1
        for io, fr in zip(ios, fresh):
            for name in ("blocks", "partial", "delta"):
                getattr(io, name).copy_(getattr(fr, name))
            io.state.recurrent.copy_(fr.state.recurrent)
            io.state.conv.copy_(fr.state.conv)
            io.slots.copy_(perm)
            fr.slots.copy_(perm)
        g1.replay()
        got = [(io.out.clone(), io.state.recurrent.clone()) for io in ios]
        g2.replay()                                                  # another graph on the same scratch
        torch.cuda.synchronize()
        for (o, s), io in zip(got, ios):
            assert torch.equal(o, io.out) and torch.equal(s, io.state.recurrent), "the second graph clobbered"
        impls[0].layer(fresh[0])
        fresh[1].delta.copy_(fresh[0].out)
        impls[1].layer(fresh[1])
        torch.cuda.synchronize()
        for i, ((o, s), fr) in enumerate(zip(got, fresh)):
            live = perm >= 0
            assert torch.equal(o[live], fr.out[live]), f"step {step}: layer {i} replay != eager"
            assert torch.equal(s, fr.state.recurrent), f"step {step}: layer {i} state replay != eager"
