"""The fused decode step (FastImpl) against the reference, half by half, on fresh random inputs (GPU)."""
import pytest
import torch

from k3ref import k3_rank, preset
from k3ref.weights import random_layer
from k3fast.measure.impls import make_impl, make_io
from tolerances import assert_close

pytestmark = pytest.mark.gpu


# Each contender runs only at the batches where its plan differs from the shipped one.
ATTN_CONTENDER_BATCHES = {"fast-infma": (1, 2), "fast-cublas": (9, 16, 17, 64)}


@pytest.mark.parametrize("impl", ["fast", "fast-infma", "fast-cublas"])
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 8, 9, 16, 17, 64])
def test_fast_attention_half(tp, batch, impl):
    """The attention half against k3ref at every in_proj / o_proj path the plan picks (ring, norm + ring MMA,
    norm + WGMMA, cuBLAS; fused o_proj or GEMM + norm), with spare state slots bit-identical."""
    if impl != "fast" and batch not in ATTN_CONTENDER_BATCHES[impl]:
        pytest.skip(f"{impl} differs from fast only at batches {ATTN_CONTENDER_BATCHES[impl]}")
    cfg = k3_rank(tp)
    w = random_layer(cfg, 1, seed=21, device="cuda")
    outs = {}
    for name in ("ref", impl):
        key = "fast" if name != "ref" else name
        io = make_io(cfg, 1, batch, seed=22)
        io.x_mlp.fill_(float("nan"))
        before = (io.state.recurrent.clone(), io.state.conv.clone())
        make_impl(name, cfg, w, **({"max_batch": batch} if name != "ref" else {})).attn(io)
        torch.cuda.synchronize()
        outs[key] = (io.x_mlp.clone(), io.partial.clone(), io.state.recurrent.clone(), io.state.conv.clone())
        # slots no request of this batch owns (make_io keeps a spare one) stay bit-identical
        spare = torch.ones(io.state.recurrent.shape[0], dtype=torch.bool, device="cuda")
        spare[io.slots.long()] = False
        assert spare.any()
        assert torch.equal(outs[key][2][spare], before[0][spare]), f"{name}: recurrent state of a spare slot changed"
        assert torch.equal(outs[key][3][spare], before[1][spare]), f"{name}: conv state of a spare slot changed"
    assert_close("x_mlp", outs["fast"][0], outs["ref"][0], "bf16_kernel")
    assert_close("partial", outs["fast"][1], outs["ref"][1], "bf16_kernel")
    # the states depend on the in_proj output, which the two paths round differently (see the table)
    assert_close("recurrent state", outs["fast"][2], outs["ref"][2], "fp32_state_chain")
    assert_close("conv state", outs["fast"][3], outs["ref"][3], "bf16_state_chain")


@pytest.mark.parametrize("impl,batch", [("fast", 1), ("fast", 2), ("fast", 4), ("fast", 16), ("fast", 64),
                                        ("fast-infma", 1), ("fast-cublas", 64)])
def test_fast_attention_half_at_a_block_boundary(batch, impl):
    """Layer 24 closes an AttnRes block: in_proj writes the finished block and o_proj starts the new partial sum
    (p' = a). Every o_proj path (oproj_attnres; cuBLAS or WGMMA + attnres_rmsnorm above M = 8) against k3ref."""
    cfg = k3_rank(16)
    layer = 24
    assert cfg.is_block_boundary(layer) and cfg.is_kda_layer(layer)
    w = random_layer(cfg, layer, seed=29, device="cuda")
    outs = {}
    for name in ("ref", impl):
        io = make_io(cfg, layer, batch, seed=30)
        io.x_mlp.fill_(float("nan"))
        make_impl(name, cfg, w, **({"max_batch": batch} if name != "ref" else {})).attn(io)
        torch.cuda.synchronize()
        outs[name] = (io.x_mlp.clone(), io.partial.clone(), io.blocks.clone())
    assert_close("x_mlp", outs[impl][0], outs["ref"][0], "bf16_kernel")
    assert_close("partial", outs[impl][1], outs["ref"][1], "bf16_kernel")
    assert_close("blocks", outs[impl][2], outs["ref"][2], "bf16_kernel")


@pytest.mark.parametrize("shape", ["full"])
def test_fast_layer_full_width_b1(shape):
    """The whole fused layer at TP1 width (in_proj 708 MB, experts 15 GB: exercises 64-bit expert offsets)."""
    from k3ref import preset
    cfg = preset(shape)
    w = random_layer(cfg, 1, seed=27, device="cuda")
    outs = {}
    for name in ("ref", "fast"):
        io = make_io(cfg, 1, 1, seed=28)
        io.out.fill_(float("nan"))
        make_impl(name, cfg, w, **({"max_batch": 1} if name == "fast" else {})).layer(io)
        torch.cuda.synchronize()
        outs[name] = (io.x_mlp.clone(), io.out.clone())
    assert_close("x_mlp", outs["fast"][0], outs["ref"][0], "bf16_kernel")
    assert_close("layer out", outs["fast"][1], outs["ref"][1], "bf16_kernel")


@pytest.mark.parametrize("impl", ["fast"])
def test_fast_attention_half_full_width_b8(impl):
    """The attention half at TP1 width and b8, where the in_proj and o_proj run on cuBLAS + the AttnRes norms
    (o_proj's input width 12288 is above DecodePlan.oproj_fused_max_k)."""
    from k3ref import preset
    cfg = preset("full")
    w = random_layer(cfg, 1, seed=29, device="cuda")
    outs = {}
    for name in ("ref", impl):
        io = make_io(cfg, 1, 8, seed=30)
        io.x_mlp.fill_(float("nan"))
        make_impl(name, cfg, w, **({"max_batch": 8} if name != "ref" else {})).attn(io)
        torch.cuda.synchronize()
        outs[name] = (io.x_mlp.clone(), io.partial.clone(), io.state.recurrent.clone())
    assert_close("x_mlp", outs[impl][0], outs["ref"][0], "bf16_kernel")
    assert_close("partial", outs[impl][1], outs["ref"][1], "bf16_kernel")
    assert_close("recurrent state", outs[impl][2], outs["ref"][2], "fp32_state_chain")


MOE_CONTENDER_BATCHES = {"fast-v51": (8,), "fast-front0": (1, 3), "fast-taildsl": (17, 64)}


@pytest.mark.parametrize("impl", ["fast", "fast-v51", "fast-front0", "fast-taildsl"])
@pytest.mark.parametrize("batch", [1, 3, 8, 17, 64])
def test_fast_moe_half_same_input(batch, impl):
    """The MoE half against k3ref on the same MLP input: fused and cuBLAS fronts, every experts version the plan
    picks (buckets 1, 4, 8, 32, 64), fused and cuBLAS tails."""
    if impl != "fast" and batch not in MOE_CONTENDER_BATCHES[impl]:
        pytest.skip(f"{impl} differs from fast only at batches {MOE_CONTENDER_BATCHES[impl]}")
    cfg = k3_rank(16)
    w = random_layer(cfg, 1, seed=23, device="cuda")
    io = make_io(cfg, 1, batch, seed=24)
    ref = make_impl("ref", cfg, w)
    ref.attn(io)
    x = io.x_mlp.clone()
    ref.moe(io)
    want = io.out.clone()
    fast = make_impl(impl, cfg, w, max_batch=batch)
    io.x_mlp.copy_(x)
    io.out.fill_(float("nan"))
    fast.moe(io)
    torch.cuda.synchronize()
    assert_close("moe out", io.out, want, "bf16_kernel")


def test_fast_layer_graph_replay_is_stable():
    """Captured once, replayed with new inputs: each replay matches an eager run on the same inputs."""
    from k3fast.measure.trace import capture
    cfg = k3_rank(16)
    w = random_layer(cfg, 1, seed=25, device="cuda")
    fast = make_impl("fast", cfg, w, max_batch=4)
    io = make_io(cfg, 1, 4, seed=26)
    g = capture(lambda: fast.layer(io))
    for s in range(3):
        fresh = make_io(cfg, 1, 4, seed=100 + s)
        for name in ("blocks", "partial", "delta"):
            getattr(io, name).copy_(getattr(fresh, name))
        io.state.recurrent.copy_(fresh.state.recurrent)
        io.state.conv.copy_(fresh.state.conv)
        g.replay()
        torch.cuda.synchronize()
        got = io.out.clone()
        fast.layer(fresh)
        torch.cuda.synchronize()
        assert torch.equal(got, fresh.out), f"replay {s} differs from the eager run"


@pytest.mark.parametrize("tp", [16, 8])
def test_warmup_compiles_every_kernel_the_layer_runs(tp):
    """k3fast.layer.warmup lists every kernel FastImpl runs: after it, decoding a KDA layer and a block-boundary KDA
    layer at every path's batch compiles nothing (so nothing compiles inside a graph capture)."""
    from k3fast.kernels._dsl import COMPILE_LOG
    from k3fast.layer import warmup
    cfg = k3_rank(tp)
    layers, batches = (1, 24), (1, 3, 8, 9, 17, 64)
    warmup(cfg, layers, batches, nsm=torch.cuda.get_device_properties(0).multi_processor_count, device="cuda")
    n = len(COMPILE_LOG)
    for layer in layers:
        w = random_layer(cfg, layer, seed=41, device="cuda")
        for batch in batches:
            io = make_io(cfg, layer, batch, seed=42)
            make_impl("fast", cfg, w, max_batch=batch).layer(io)
    torch.cuda.synchronize()
    assert len(COMPILE_LOG) == n, f"compiled after warmup: {[str(k)[:80] for k, _ in COMPILE_LOG[n:]]}"


@pytest.mark.parametrize("impl", ["fast-mla", "fast-mla-uvc"])
@pytest.mark.parametrize("tp,batch", [(t, b) for t in (16, 8) for b in (1, 3, 8, 17, 64)] + [(1, 1), (1, 8)])
def test_fused_mla_attention_half(tp, batch, impl):
    """The MLA attention half on FusedMLA (the fast-mla contender, and fast-mla-uvc with the split combine in
    mla_uv_gate) against k3ref: requests of mixed cache lengths (1, page edges, a few hundred), a padded request
    where the batch has room; the MoE input, the partial sum, the appended cache rows and the lengths; other slots'
    rows untouched."""
    cfg = k3_rank(tp) if tp > 1 else preset("full")
    layer = 3
    assert not cfg.is_kda_layer(layer)
    w = random_layer(cfg, layer, seed=61, device="cuda")
    outs = {}
    for name in ("ref", impl):
        io = make_io(cfg, layer, batch, context=700, seed=62)
        lens = torch.tensor([[1, 63, 64, 65, 300, 699, 128, 0][i % 8] for i in range(io.state.lengths.shape[0])],
                            device="cuda")
        io.state.lengths.copy_(lens)
        if batch >= 3:
            io.slots[1] = -1
        io.x_mlp.fill_(float("nan"))
        before = io.state.kv.clone()
        make_impl(name, cfg, w, **({"max_batch": batch} if name != "ref" else {})).attn(io)
        torch.cuda.synchronize()
        outs[name] = (io.x_mlp.clone(), io.partial.clone(), io.state.kv.clone(), io.state.lengths.clone())
        live = io.slots[io.slots >= 0].long()
        others = torch.ones(io.state.kv.shape[0], dtype=torch.bool, device="cuda")
        others[live] = False
        assert torch.equal(io.state.kv[others], before[others]), f"{name}: a slot no request owns changed"
    live_rows = torch.ones(batch, dtype=torch.bool)
    if batch >= 3:
        live_rows[1] = False
    assert_close("x_mlp", outs[impl][0][live_rows], outs["ref"][0][live_rows], "bf16_kernel")
    assert_close("partial", outs[impl][1], outs["ref"][1], "bf16_kernel")
    assert_close("cache rows", outs[impl][2], outs["ref"][2], "bf16_state_chain")
    assert torch.equal(outs[impl][3], outs["ref"][3]), "lengths differ"


@pytest.mark.parametrize("contender", ["fast-mla", "fast-mla-uvc"])
def test_fused_mla_graph_replay_reads_the_step_metadata(contender):
    """As the trace runs it: the step's paging metadata built once outside the layer (layer_io.mla_step), the
    attention half captured in a CUDA graph and replayed after new inputs and new lengths: each replay equals an eager
    call on the same inputs bit for bit (the combine's counters re-arm; nothing but shapes is fixed at capture), and
    the eager call equals the layer that derives the metadata itself."""
    from k3fast.layer import CONTENDERS, FastImpl
    from k3fast.layer_io import mla_step
    from k3fast.measure.trace import capture
    cfg, layer, batch = k3_rank(16), 3, 8
    w = random_layer(cfg, layer, seed=71, device="cuda")
    plan = CONTENDERS[contender][0]
    impl = FastImpl(cfg, w, plan=plan, max_batch=batch)
    io = make_io(cfg, layer, batch, context=300, seed=72)
    io.slots[2] = -1
    self_made = make_io(cfg, layer, batch, context=300, seed=72)
    self_made.slots[2] = -1
    impl.attn(self_made)                                        # derives the metadata, advances the lengths
    io.mla_step = mla_step(io.state, io.slots)
    impl.attn(io)
    torch.cuda.synchronize()
    assert torch.equal(io.x_mlp, self_made.x_mlp) and torch.equal(io.state.kv, self_made.state.kv)
    g = capture(lambda: impl.attn(io))
    gen = torch.Generator(device="cuda").manual_seed(73)
    for _ in range(3):
        io.reset()
        io.partial.copy_(torch.randn(io.partial.shape, generator=gen, device="cuda").to(torch.bfloat16))
        lmax = io.state.kv.shape[1]                              # the new row must fit: lengths < Lmax
        io.state.lengths.copy_(torch.randint(1, lmax, io.state.lengths.shape, generator=gen, device="cuda"))
        step = mla_step(io.state, io.slots)                      # the scheduler's next step, into the same buffers
        for a, b in ((io.mla_step.block_table, step.block_table), (io.mla_step.seqlens, step.seqlens),
                     (io.mla_step.slot_mapping, step.slot_mapping)):
            a.copy_(b)
        kv0, p0 = io.state.kv.clone(), io.partial.clone()
        io.x_mlp.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        replayed = (io.x_mlp.clone(), io.state.kv.clone())
        io.state.kv.copy_(kv0)
        io.partial.copy_(p0)
        impl.attn(io)
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], io.x_mlp) and torch.equal(replayed[1], io.state.kv)
