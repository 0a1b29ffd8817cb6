"""The fused decode step (FastImpl) against the reference, half by half, on fresh random inputs (GPU)."""
import pytest
import torch

from k3ref import k3_rank
from k3ref.weights import random_layer
from k3fast.measure.impls import make_impl, make_io
from tolerances import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["fast", "fast-splitk", "fast-alldsl", "fast-gemv0", "fast-gemv8", "fast-gemvg2",
                                  "fast-endtrig", "fast-s8", "fast-s10", "fast-kdans8", "fast-s17kda", "fast-s19kda",
                                  "fast-inpf3", "fast-infma", "fast-ringearly", "fast-nojoint", "fast-oplean",
                                  "fast-opfence", "fast-op32", "fast-inmma", "fast-inmmaet", "fast-opmma",
                                  "fast-mid", "fast-op8", "fast-op4", "fast-incublas",
                                  "fast-intiled", "fast-s22kda", "fast-kdahead48", "fast-normc1", "fast-normc9",
                                  "fast-s24kda", "fast-inmm", "fast-inwg", "fast-inwglate", "fast-inwgd3", "fast-inwgd2",
                                  "fast-inwgtiled", "fast-inwg1bn64", "fast-inwg1bn48", "fast-inwg2bn96",
                                  "fast-inwgx", "fast-opwgx", "fast-inwgx-opwgx", "fast-inwg2bn96x",
                                  "fast-opm16", "fast-inwg-opm16", "fast-opwg", "fast-opwgd3", "fast-opwgd2",
                                  "fast-opwgoff", "fast-inwg2bn96x-opwg", "fast-inwg2bn64x-opwg",
                                  "fast-inwg2bn64xd7-opwg", "fast-inwg4bn112x-opwg", "fast-inwgd4-opwg",
                                  "fast-inwg2bn96xd7", "fast-inwgoff-opwgoff", "fast-n2c2", "fast-n2c8",
                                  "fast-inwgbulk"])
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 8, 16, 64])
def test_fast_attention_half(tp, batch, impl):
    if impl == "fast-splitk" and batch <= 4:
        pytest.skip("M <= 4 runs the FMA kernels in both")
    from k3fast.layer import GEMV_DSL_MAX_M
    if impl == "fast-alldsl" and batch <= GEMV_DSL_MAX_M:
        pytest.skip("M <= GEMV_DSL_MAX_M: fast runs the same kernels")
    if impl == "fast-gemv0" and batch > GEMV_DSL_MAX_M:
        pytest.skip("M > GEMV_DSL_MAX_M: fast runs the same kernels")
    if impl == "fast-op32" and (tp != 8 or batch > GEMV_DSL_MAX_M):
        pytest.skip("fast-op32 differs from fast only at rank8 where oproj_attnres runs (M <= GEMV_DSL_MAX_M)")
    if impl in ("fast-oplean", "fast-opfence") and batch > GEMV_DSL_MAX_M:
        pytest.skip(f"{impl} differs from fast only where oproj_attnres runs (M <= GEMV_DSL_MAX_M)")
    if impl in ("fast-endtrig", "fast-s8") and batch > 4:
        pytest.skip(f"{impl} differs from fast only in the fused chain (M <= GEMV_DSL_MAX_M)")
    if impl in ("fast-gemvg2", "fast-inpf3", "fast-infma", "fast-ringearly", "fast-nojoint") and batch > 2:
        pytest.skip(f"{impl} differs from fast only where the fused in_proj runs (M <= 2)")
    if impl == "fast-s10" and not 2 < batch <= 4:
        pytest.skip("fast-s10 differs from fast only at M = 3-4 (the in_proj's FMA GEMV)")
    if impl == "fast-kdans8":
        from k3fast.kernels.kda_conv_gate_step import choose_nsplit
        if choose_nsplit(batch, k3_rank(tp).kda_heads) == 8:
            pytest.skip(f"{impl} differs from fast only where choose_nsplit picks 4 or 1")
    if impl in ("fast-s22kda", "fast-s24kda"):
        from k3fast.kernels.kda_conv_gate_step import choose_nsplit
        if choose_nsplit(batch, k3_rank(tp).kda_heads) != 1:
            pytest.skip(f"{impl} differs from fast only where the KDA step runs v9.1 (B x H >= HEAD_CTA_MIN)")
    if impl in ("fast-kdahead", "fast-kdahead48"):
        from k3fast.measure.impls import FAST_VARIANTS
        from k3fast.kernels.kda_conv_gate_step import choose_nsplit
        head_min = FAST_VARIANTS[impl]["kda_head_min"]
        if choose_nsplit(batch, k3_rank(tp).kda_heads, head_min) != 1:
            pytest.skip(f"{impl} differs from fast only where B x H >= {head_min} (the KDA step's v9)")
    if impl == "fast-inmm":
        from k3fast.kernels.rms_gemv_ring import MMA_MAX_M
        if batch <= MMA_MAX_M:
            pytest.skip(f"{impl} differs from fast only where the in_proj GEMM runs on cuBLAS (M > {MMA_MAX_M})")
    if impl in ("fast-inwg", "fast-inwglate", "fast-inwgd3", "fast-inwgd2", "fast-inwgtiled", "fast-inwg1bn64",
                "fast-inwg1bn48", "fast-inwg2bn96", "fast-inwgx", "fast-inwgx-opwgx", "fast-inwg2bn96x",
                "fast-inwg2bn96x-opwg", "fast-inwg2bn64x-opwg", "fast-inwg2bn64xd7-opwg", "fast-inwg4bn112x-opwg",
                "fast-inwgd4-opwg", "fast-inwg2bn96xd7"):
        from k3fast.kernels.rms_gemv_ring import MMA_MAX_M
        if batch <= MMA_MAX_M:
            pytest.skip(f"{impl} differs from fast only where the in_proj GEMM runs on cuBLAS (M > {MMA_MAX_M})")
    if impl in ("fast-normc1", "fast-normc9"):
        from k3fast.measure.impls import FAST_VARIANTS
        from k3fast.kernels.rms_gemv import norm_cluster
        m = FAST_VARIANTS[impl]["norm_cluster_min_m"]
        if batch <= 2 or norm_cluster(batch, m) == norm_cluster(batch):
            pytest.skip(f"{impl} differs from fast only where the AttnRes norm runs apart with another cluster size")
    from k3fast.layer import INPROJ_DSL_MAX_M
    if (impl in ("fast-inmma", "fast-inmmaet", "fast-mid", "fast-incublas", "fast-intiled")
            and not INPROJ_DSL_MAX_M < batch <= 8):
        pytest.skip(f"{impl} differs from fast only where the in_proj GEMV is cuBLAS and M <= 8")
    if impl in ("fast-opmma", "fast-op4") and not 4 < batch <= GEMV_DSL_MAX_M:
        pytest.skip(f"{impl} differs from fast only where it puts o_proj on a GEMV + attnres_rmsnorm (M 5..8)")
    if (impl in ("fast-opwg", "fast-opwgd3", "fast-opwgd2", "fast-opwgoff", "fast-opwgx", "fast-inwgoff-opwgoff",
                 "fast-n2c2", "fast-n2c8")
            and batch <= GEMV_DSL_MAX_M):
        pytest.skip(f"{impl} differs from fast only where o_proj runs apart from its norm (M > GEMV_DSL_MAX_M)")
    if impl in ("fast-opm16", "fast-inwg-opm16") and not GEMV_DSL_MAX_M < batch <= 16:
        pytest.skip(f"{impl} differs from fast only for GEMV_DSL_MAX_M < M <= 16 (o_proj's fused kernel)")
    if impl == "fast-op8" and not GEMV_DSL_MAX_M < batch <= 8:
        pytest.skip("fast-op8 differs from fast only for GEMV_DSL_MAX_M < M <= 8 (none since session 21)")
    if impl == "fast-gemv8" and not INPROJ_DSL_MAX_M < batch <= 8:
        pytest.skip("fast-gemv8 differs from fast only for INPROJ_DSL_MAX_M < M <= 8 (the in_proj GEMV)")
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


@pytest.mark.parametrize("impl,batch", [("fast", 4), ("fast", 64), ("fast-alldsl", 4), ("fast-alldsl", 64),
                                        ("fast", 1), ("fast", 2), ("fast-infma", 1)])
def test_fast_attention_half_at_a_block_boundary(batch, impl):
    """Layer 24 closes an AttnRes block: in_proj writes the finished block and o_proj starts the new partial sum
    (p' = a). Both o_proj paths (oproj_attnres, and cuBLAS + attnres_rmsnorm above GEMV_DSL_MAX_M) against k3ref."""
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


@pytest.mark.parametrize("impl", ["fast", "fast-opfull"])
def test_fast_attention_half_full_width_b8(impl):
    """The attention half at TP1 width and b8, where o_proj runs on cuBLAS + the AttnRes #2 norm (OPROJ_FUSED_MAX_KP)
    and, in fast-opfull, on the fused oproj_attnres at K = 12288."""
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


@pytest.mark.parametrize("impl", ["fast", "fast-prev", "fast-v5", "fast-taildsl", "fast-nibble", "fast-alldsl",
                                  "fast-w8", "fast-front0", "fast-front16", "fast-shapart", "fast-overlap",
                                  "fast-rolled", "fast-front0r", "fast-shlate", "fast-v6", "fast-s9front",
                                  "fast-s12", "fast-v7", "fast-s13", "fast-s19tail",
                                  "fast-s21exp", "fast-s27tail", "fast-noringfit", "fast-v8",
                                  "fast-v8tag", "fast-xlean", "fast-v51"])
@pytest.mark.parametrize("batch", [1, 3, 8, 17, 64])
def test_fast_moe_half_same_input(batch, impl):
    if batch == 3 and impl not in ("fast", "fast-s9front", "fast-shapart", "fast-shlate"):
        pytest.skip("batch 3 (the FMA front's bucket 4) checks the shared gate/up fold and its alternatives")
    if impl == "fast-s9front" and batch > 4:
        pytest.skip("fast-s9front differs from fast only where the fused front serves (M <= 4)")
    if impl == "fast-s12" and batch <= 4:
        pytest.skip("fast-s12 differs from fast only where TopkFromLogits serves (M > 4)")
    if impl == "fast-s21exp" and batch > 1:
        pytest.skip("fast-s21exp differs from fast only at batch 1 (the experts' routing)")
    if impl == "fast-s27tail" and batch <= 16:
        pytest.skip("fast-s27tail differs from fast only where the cuBLAS tail serves (M > TAIL_DSL_MAX_M = 16)")
    if impl in ("fast-s13", "fast-v8", "fast-v8tag") and batch > 2:
        pytest.skip(f"{impl} differs from fast only at batch buckets <= 2 (experts v4 / v8 there)")
    if impl == "fast-v51" and batch != 8:
        pytest.skip("fast-v51 differs from fast only at batch buckets 4 / 8 (experts v5.1 there, v5.2 in fast)")
    if impl == "fast-v7" and batch > 8:
        pytest.skip("fast-v7 differs from fast only at batch buckets <= 8 (experts v7 there)")
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
