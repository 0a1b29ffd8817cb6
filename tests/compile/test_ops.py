"""k3fast.ops: the fused kernels registered as torch custom ops. On CPU: registration, schemas (which arguments
are written in place) and the fake implementations, traced with fake CUDA tensors (no GPU needed)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import k3fast.ops as kops

pytestmark = pytest.mark.compile
BF, F32, I32 = torch.bfloat16, torch.float32, torch.int32


def test_every_op_is_registered_with_its_mutations():
    for name in kops.OPS:
        assert hasattr(torch.ops.k3fast, name), name
    written = {n: {a.name for a in getattr(torch.ops.k3fast, n).default._schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write} for n in kops.OPS}
    assert written["attnres_rms_gemv"] == {"blocks", "partial_out"}
    assert written["kda_conv_gate_step"] == {"conv_state", "rec_state"}
    for n in ("oproj_attnres", "router_down_topk", "moe_mxfp4_experts", "moe_tail"):
        assert written[n] == set(), f"{n} must not write its inputs"


def _layer_inputs(M, n_slots=5, H=6, Pw=768, N_in=3216, Is=768, E=896, dL=3584, I=256):
    dev = "cuda"
    e = lambda *s, dtype=BF: torch.empty(*s, dtype=dtype, device=dev)
    return dict(
        blocks=e(M, 4, kops.HIDDEN), partial=e(M, kops.HIDDEN), delta=e(M, kops.HIDDEN), u=e(kops.HIDDEN, dtype=F32),
        w_ln=e(kops.HIDDEN), w_in=e(N_in, kops.HIDDEN), p1=e(M, kops.HIDDEN), w_fb=e(Pw, 128), conv_w=e(3 * Pw, 4, dtype=F32),
        a_log=e(H, dtype=F32), dt_bias=e(Pw, dtype=F32), o_norm=e(128), conv=e(n_slots, 3 * Pw, 3),
        rec=e(n_slots, H, 128, 128, dtype=F32), slots=e(M, dtype=I32), w_o=e(kops.HIDDEN, Pw), w_post=e(kops.HIDDEN),
        front_sh=e(E + dL + 2 * Is, kops.HIDDEN), bias=e(E, dtype=F32), Is=Is,
        w13q=e(E, I // 8, dL // 64, 32, 4, dtype=I32), w13s=e(E, I // 8, dL // 64, 8, dtype=I32),
        w2q=e(E, dL // 16, I // 64, 32, 4, dtype=I32), w2s=e(E, dL // 16, I // 64, 8, dtype=I32),
        r_norm=e(dL), w_up=e(kops.HIDDEN, dL), w_sd=e(kops.HIDDEN, Is))


def _layer(t, M):
    """The fused decode step of a KDA+MoE layer written with the ops (FastImpl's chain)."""
    ops = torch.ops.k3fast
    proj = ops.attnres_rms_gemv(t["blocks"], 2, t["partial"], t["delta"], t["u"], t["w_ln"], t["w_in"], 1e-5, -1, t["p1"])
    y = ops.kda_conv_gate_step(proj, t["w_fb"], t["conv_w"], t["a_log"], t["dt_bias"], t["o_norm"], t["conv"], t["rec"],
                               t["slots"], 6, 1, -5.0, 1e-5)
    x, p = ops.oproj_attnres(y, t["w_o"], t["blocks"], 2, t["p1"], t["u"], t["w_post"], 1e-5, False)
    z, ids, w, h = ops.router_down_topk(x, t["front_sh"], t["bias"], 896, 16, 2.5, t["Is"])
    r = ops.moe_mxfp4_experts(z, ids, w, t["w13q"], t["w13s"], t["w2q"], t["w2s"], 4.0, 25.0, "rot")
    return ops.moe_tail(r, t["r_norm"], t["w_up"], h, t["w_sd"], 1e-5), p, proj, y, z, ids, w, h, r


@pytest.mark.parametrize("M", [1, 8, 64])
def test_fake_shapes_compose_into_a_layer(M):
    with FakeTensorMode():
        t = _layer_inputs(M)
        out, p, proj, y, z, ids, w, h, r = _layer(t, M)
    assert out.shape == (M, kops.HIDDEN) and out.dtype == BF and out.device.type == "cuda"
    assert p.shape == (M, kops.HIDDEN) and proj.shape == (M, 3216) and y.shape == (M, 768)
    assert z.shape == (M, 3584) and z.dtype == BF and ids.shape == (M, 16) and ids.dtype == I32 and w.dtype == F32
    assert h.shape == (M, 768) and r.shape == (M, 3584)


def test_ops_appear_as_single_nodes_in_a_traced_graph():
    with FakeTensorMode():
        t = _layer_inputs(2)
        Is = t.pop("Is")
        keys = list(t)
        gm = make_fx(lambda *a: _layer(dict(zip(keys, a), Is=Is), 2)[0], tracing_mode="fake")(*t.values())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    names = [s.split(".")[1] for s in targets if s.startswith("k3fast.")]
    assert names == list(kops.OPS), names


# ---------------------------------------------------------------------------------------- the batch dispatch
# The ops run FastImpl's stage functions with the shipped DecodePlan (the GPU tier checks the bits at b1 / 3 / 8 / 64).
# Here the host functions are replaced by recorders and the ops run on CPU tensors: which function serves which
# batch, and with which arguments.

def _recorders(monkeypatch):
    import k3fast.layer as fast
    import k3fast.kernels.moe_tail as mt
    import k3fast.kernels.oproj_attnres as oa
    import k3fast.kernels.rms_gemv as rg
    import k3fast.kernels.rms_gemv_ring as rr
    import k3fast.kernels.router_down_topk as rt
    calls = []

    def rec(name, result):
        def f(*a, **kw):
            calls.append((name, kw))
            return result(*a, **kw)
        return f

    bf = lambda m, n: torch.zeros(m, n, dtype=BF)
    two = lambda y, w, *a, **kw: (bf(y.shape[0], w.shape[0]), bf(y.shape[0], w.shape[0]))
    tail = lambda r, n, w_up, *a, **kw: bf(r.shape[0], w_up.shape[0])

    def topk(x, w, b, n_experts, top_k, shared=0, **kw):
        M = x.shape[0]
        out = (bf(M, w.shape[0] - n_experts - 2 * shared), torch.zeros(M, top_k, dtype=I32),
               torch.zeros(M, top_k, dtype=F32))
        return out + ((bf(M, shared),) if shared else ())

    monkeypatch.setattr(rg, "attnres_rms_gemv", rec("in_proj", lambda *a, **kw: (bf(a[2].shape[0], a[6].shape[0]),
                                                                                   None)))
    import k3fast.kernels.gemm_wgmma_splitk as gw
    monkeypatch.setattr(rg, "attnres_rmsnorm", rec("in_norm", lambda *a, **kw: (bf(a[2].shape[0], a[2].shape[1]),
                                                                               None)))
    monkeypatch.setattr(gw, "gemm_wgmma", rec("in_proj_wide", lambda x, w, **kw: bf(x.shape[0], w.shape[0])))
    monkeypatch.setattr(rr, "attnres_rms_gemv_ring", rec("in_proj_ring",
                                                         lambda *a, **kw: (bf(a[2].shape[0], a[6].shape[0]), None)))
    monkeypatch.setattr(rr, "gemv_ring_mma", rec("in_proj_ring_mma", lambda x, w, **kw: bf(x.shape[0], w.shape[0])))
    monkeypatch.setattr(oa, "oproj_attnres", rec("oproj", two))
    monkeypatch.setattr(rt, "router_down_topk", rec("front", topk))
    monkeypatch.setattr(rt, "router_down_topk_cublas", rec("front_cublas", topk))
    monkeypatch.setattr(mt, "moe_tail", rec("tail", tail))
    monkeypatch.setattr(fast, "moe_tail_cublas", rec("tail_cublas", tail))
    return calls


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 9, 16, 17, 64])
def test_ops_follow_fastimpls_batch_dispatch(M, monkeypatch):
    from k3fast.layer import DEFAULT_PLAN as plan
    calls = _recorders(monkeypatch)
    ops, H, E, dL, Is = torch.ops.k3fast, 64, 32, 48, 16
    r = lambda *s, dtype=BF: torch.randn(*s).to(dtype)
    x, blocks = r(M, H), r(M, 3, H)
    ops.attnres_rms_gemv(blocks, 2, x, x, r(H, dtype=F32), r(H), r(40, H), 1e-5, -1, r(M, H))
    ops.oproj_attnres(r(M, 24), r(H, 24), blocks, 2, x, r(H, dtype=F32), r(H), 1e-5, False)
    ops.router_down_topk(x, r(E + dL + 2 * Is, H), r(E, dtype=F32), E, 4, 2.5, Is)
    ops.moe_tail(r(M, dL), r(dL), r(H, dL), r(M, Is), r(H, Is), 1e-5)
    names = [n for n, _ in calls]
    in_proj = {"ring": ["in_proj_ring"], "norm+ring_mma": ["in_norm", "in_proj_ring_mma"],
               "norm+wgmma": ["in_norm", "in_proj_wide"], "cublas": ["in_proj"]}[plan.in_proj_engine(M, H, 40)[0]]
    # at this toy width (K = 64) the ring MMA GEMV does not apply, nor the WGMMA GEMM's 4-way K split above M = 16
    assert in_proj == (["in_proj_ring"] if M <= 2 else ["in_norm", "in_proj_wide"] if 8 < M <= 16 else ["in_proj"])
    # above the fused range o_proj is F.linear (not recorded) and then the AttnRes #2 norm kernel
    o_proj = ["oproj"] if plan.o_proj_engine(M, 24, H) == "fused" else ["in_norm"]
    front = ["front" if M <= plan.front_fused_max_m else "front_cublas"]
    tail = ["tail" if M <= plan.tail_fused_max_m else "tail_cublas"]
    assert names == in_proj + o_proj + front + tail, names
    if in_proj[0] == "in_norm":          # the norm launches the GEMM right after its PDL wait
        assert calls[0][1]["early_trigger"] is True
    assert calls[len(in_proj) + len(o_proj)][1]["shared"] == Is


@pytest.mark.parametrize("M", [17, 64])
def test_moe_tail_above_the_dsl_bucket_runs_on_cpu(M):
    """Above the fused tail's range the moe_tail op is moe_tail_cublas, plain torch: on the CPU it runs for real.
    Its norm (one torch RMSNorm on the BF16 r) against the model's rounding points in fp64, and against the
    three-kernel form (FP32 copy, norm, BF16 copy): r_hat within one BF16 ulp."""
    import torch.nn.functional as F
    from k3fast.layer import DEFAULT_PLAN, moe_tail_cublas
    from tolerances import assert_close
    assert M > DEFAULT_PLAN.tail_fused_max_m
    g = torch.Generator().manual_seed(4100 + M)
    D, DL, Is, eps = 512, 256, 64, 1e-5
    rn = lambda *s, std=1.0, mean=0.0: (torch.randn(*s, generator=g) * std + mean).to(BF)
    r, h = rn(M, DL, std=0.05), rn(M, Is, std=0.5)
    w_norm, w_up, w_sd = rn(DL, std=0.1, mean=1.0), rn(D, DL, std=DL ** -0.5), rn(D, Is, std=Is ** -0.5)
    rd = r.double()
    r_hat = (w_norm.double() * rd * torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + eps)).to(BF)
    want = ((r_hat.double() @ w_up.double().t()).to(BF).double() + (h.double() @ w_sd.double().t()).to(BF).double())
    out = torch.full((M, D), float("nan"), dtype=BF)
    got = kops.moe_tail(r, w_norm, w_up, h, w_sd, eps)
    moe_tail_cublas(r, w_norm, w_up, h, w_sd, eps=eps, out=out)
    assert torch.equal(got, out)
    assert_close("cuBLAS tail out", out, want, "bf16_kernel")
    fused = F.rms_norm(r, (DL,), w_norm, eps)
    three = F.rms_norm(r.float(), (DL,), w_norm.float(), eps).bfloat16()
    ulp = (fused.view(torch.int16).int() - three.view(torch.int16).int()).abs()
    assert fused.dtype == BF and ulp.max().item() <= 1 and (ulp > 0).float().mean().item() < 0.01
    assert (fused.view(torch.int16).int() - r_hat.view(torch.int16).int()).abs().max().item() <= 1
