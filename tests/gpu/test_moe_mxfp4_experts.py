"""GPU tests of k3fast.kernels.moe_mxfp4_experts against a plain-torch reference written here (the contract of
k3ref.moe.routed_experts on the checkpoint's MXFP4 bytes):

    W = exact MXFP4 dequant of the CHECKPOINT layout (bf16, lossless)
    a, c = bf16(z W1_e^T), bf16(z W3_e^T);  h = bf16(4 tanh(a/4) sigmoid(a) * 25 tanh(c/25))   (fp32 math)
    y_e  = bf16(h W2_e^T);                  r = bf16(sum_j topk_w[m, j] * fp32(y_{ids[m, j]}))  (slot order)

E = 896, dL = 3584; I = 256 (k3_rank16) at every batch bucket, I = 384 (k3_rank8) and I = 3072 (full width) at a few.
The default path ("rows" items at bucket 1, "parts" at rank8 b1 and bucket 2, "passes" above, with the alternate
"parts" items at buckets 4 / 8) and the contender (alt_parts=0: the passes alone at buckets 4 / 8), in the default
"rot" layout and the "nibble" fallback. Tolerances: tests/tolerances.py ("bf16_kernel" against the reference,
"bf16_kernel_pair" between the two item kinds at buckets 4 / 8). Compile time dominates the wall time (~10 s a key).
"""
import pytest
import torch

from tolerances import assert_close

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from k3fast.kernels import moe_mxfp4_experts as mx  # noqa: E402

E, DL, TOPK = 896, 3584, 16
DEV = torch.device("cuda")
BF = torch.bfloat16

# the default path: every bucket at rank16 with every routing kind, each kind of item at rank8, and full width
CASES = [(m, 256, r) for m in (1, 2, 3, 4, 7, 8, 16, 64) for r in ("uniform", "shared", "skewed", "ties")] \
    + [(1, 384, "uniform"), (1, 384, "ties"), (2, 384, "shared"), (3, 384, "uniform"), (8, 384, "skewed"),
       (64, 384, "uniform"), (64, 384, "shared"), (1, 3072, "uniform"), (2, 3072, "uniform"), (8, 3072, "skewed")]


_W = {}


def weights(I, layout="rot", scales=(118, 124), scales2=None):
    """Random checkpoint bytes (all codes), realistic E8M0 scales 2^-9..2^-4 (or ``scales`` for w1/w3 and
    ``scales2``, default the same, for w2); prepared once per width, layout and scale ranges."""
    scales = (scales, scales2 or scales)
    key = (I, layout, scales)
    if key not in _W:
        if any(k[0] != I or k[2] != scales for k in _W):
            _W.clear()                                # keep at most one width resident (I = 3072 is ~15 GB)
        ck = next((v[0] for k, v in _W.items()), None)
        if ck is None:
            g = torch.Generator(device=DEV).manual_seed(77 + I + scales[0][0])
            r = lambda *s: torch.randint(0, 256, s, generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)
            sc = lambda lohi, *s: torch.randint(lohi[0], lohi[1], s, generator=g, device=DEV,
                                                dtype=torch.int32).to(torch.uint8)
            ck = dict(w1=r(E, I, DL // 2), s1=sc(scales[0], E, I, DL // 32), w3=r(E, I, DL // 2),
                      s3=sc(scales[0], E, I, DL // 32), w2=r(E, DL, I // 2), s2=sc(scales[1], E, DL, I // 32))
        prep = mx.prepare_mxfp4_experts(ck["w1"], ck["s1"], ck["w3"], ck["s3"], ck["w2"], ck["s2"], layout=layout)
        assert prep.layout == layout
        _W[key] = (ck, prep)
    return _W[key]


def routing(M, kind, gen):
    if kind == "shared":                            # every token picks the same 16 experts (in different orders)
        base = torch.randperm(E, generator=gen, device=DEV)[:TOPK]
        ids = torch.stack([base[torch.randperm(TOPK, generator=gen, device=DEV)] for _ in range(M)])
    elif kind == "skewed":                          # every token draws its 16 experts from one hot set of 24
        hot = torch.randperm(E, generator=gen, device=DEV)[:24]
        ids = torch.stack([hot[torch.randperm(24, generator=gen, device=DEV)[:TOPK]] for _ in range(M)])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:TOPK] for _ in range(M)])
    w = torch.rand(M, TOPK, generator=gen, device=DEV) + 0.05
    w = w / w.sum(-1, keepdim=True)
    if kind == "ties":                              # equal weights, half the experts shared, one duplicated slot
        w = torch.full((M, TOPK), 1.0 / TOPK, device=DEV)
        common = torch.randperm(E, generator=gen, device=DEV)[:8]
        ids[:, :8] = common
        ids[0, 15] = ids[0, 3]
    return ids.to(torch.int32).contiguous(), w.float().contiguous()


def reference(z, ids, w, ck):
    M = z.shape[0]
    y = torch.zeros(M, TOPK, DL, dtype=torch.float32, device=DEV)
    for e in torch.unique(ids).tolist():
        mm, jj = (ids == e).nonzero(as_tuple=True)
        w1 = mx.dequant_checkpoint(ck["w1"][e], ck["s1"][e]).to(BF)
        w3 = mx.dequant_checkpoint(ck["w3"][e], ck["s3"][e]).to(BF)
        w2 = mx.dequant_checkpoint(ck["w2"][e], ck["s2"][e]).to(BF)
        ze = z[mm]
        a = (ze @ w1.t()).float()
        c = (ze @ w3.t()).float()
        h = (4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * (25.0 * torch.tanh(c / 25.0))).to(BF)
        y[mm, jj] = (h @ w2.t()).float()
    acc = torch.zeros(M, DL, dtype=torch.float32, device=DEV)
    for j in range(TOPK):
        acc += w[:, j:j + 1] * y[:, j]
    return acc.to(BF)


def case(M, I, kind, seed, layout="rot", scales=(118, 124), scales2=None):
    """Weights of width I, fresh z, a routing of the given kind and a fresh workspace."""
    ck, prep = weights(I, layout, scales, scales2)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    z = torch.randn(M, DL, generator=gen, device=DEV).to(BF)
    ids, w = routing(M, kind, gen)
    return ck, prep, z, ids, w, mx.make_workspace(DL, DEV)


def run_variants(M, z, ids, w, prep, ws, **variants):
    """Each variant (keyword arguments of moe_mxfp4_experts) on the same inputs, with the output and the y
    workspace poisoned before each launch; checks that every output is finite and the counters reset."""
    outs = {}
    for name, kw in variants.items():
        ws.y.fill_(float("nan"))
        outs[name] = torch.full((M, DL), float("nan"), dtype=BF, device=DEV)
        mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, out=outs[name], workspace=ws, **kw)
    torch.cuda.synchronize()
    for name, out in outs.items():
        assert torch.isfinite(out).all(), f"{name}: unwritten (NaN) or non-finite outputs"
    assert ws.counters.eq(0).all(), "counters did not reset"
    return outs


def replay_with_new_routings(g, out, z, ids, w, ws, ck, kind, seed, n=2):
    """Replay a captured graph n times, each with a fresh z and routing of ``kind`` copied into the captured
    tensors and a poisoned output: the counters must be back at zero and the output must match the reference."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    for it in range(n):
        z.copy_(torch.randn(z.shape, generator=gen, device=DEV).to(BF))
        ids2, w2 = routing(ids.shape[0], kind, gen)
        ids.copy_(ids2)
        w.copy_(w2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert ws.counters.eq(0).all(), f"replay {it} ({kind}): counters did not reset"
        assert_close(f"replay {it} ({kind})", out, reference(z, ids, w, ck), "bf16_kernel")


def capture(M, z, ids, w, prep, ws, **kw):
    """A CUDA graph of one moe_mxfp4_experts launch (keyword arguments ``kw``) and its output buffer (poisoned)."""
    out = torch.full((M, DL), float("nan"), dtype=BF, device=DEV)
    mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, out=out, workspace=ws, **kw)     # compile, eagerly
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, out=out, workspace=ws, **kw)
    return g, out


def same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def n_passes(ids, NT):
    cnt = torch.bincount(ids.flatten().long(), minlength=E)
    return int(((cnt + NT - 1) // NT).sum())


@pytest.mark.parametrize("M,I,kind", CASES)
def test_matches_reference(M, I, kind):
    """The default path against the reference, through the four-tensor form of the call; a second launch is
    bit-identical (deterministic combine) and the poisoned workspace and output are rewritten."""
    ck, prep, z, ids, w, ws = case(M, I, kind, 1000 * M + I + len(kind))
    ws.y.fill_(float("nan"))
    out = torch.full((M, DL), float("nan"), dtype=BF, device=DEV)
    mx.moe_mxfp4_experts(z, ids, w, prep.w13q, prep.w13s, prep.w2q, prep.w2s, out=out, workspace=ws,
                         layout=prep.layout)
    torch.cuda.synchronize()
    assert ws.counters.eq(0).all(), "counters did not reset"
    assert_close(f"M={M} I={I} {kind}", out, reference(z, ids, w, ck), "bf16_kernel")
    out2 = mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, workspace=ws)
    assert same_bits(out, out2)


@pytest.mark.parametrize("M,I", [(1, 256), (1, 384), (2, 256), (8, 256), (64, 256)])
def test_cuda_graph_replay_new_routing(M, I):
    """One captured launch per item kind ("rows", rank8's "parts" at b1, "parts", "passes" with the alternate
    items, "passes"), replayed with new z and routings of every kind: the self-resetting counters (the combine's,
    the part reduction's, the h exchange's) need no memset between replays."""
    ck, prep, z, ids, w, ws = case(M, I, "uniform", 5 + M + I)
    mx.warmup((E, DL, I), [M])
    g, out = capture(M, z, ids, w, prep, ws)
    for k, kind in enumerate(("uniform", "shared", "ties", "skewed")):
        replay_with_new_routings(g, out, z, ids, w, ws, ck, kind, 50 + 10 * M + k, n=1)


def test_distinct_expert_bytes_counts_dedup():
    gen = torch.Generator(device=DEV).manual_seed(9)
    ids, _ = routing(8, "shared", gen)
    assert mx.distinct_expert_bytes(ids, (DL, 256)) == 16 * mx.expert_bytes(DL, 256)


# buckets 4 / 8: the branch is chosen on the device from the pass count, so each shape's I at both buckets, with
# routings on both sides of it ("ties" at M = 3 has ~32 passes: the parts' side, M = 8 ~72: the passes')
ALT_CASES = [(m, 256, r) for m in (3, 8) for r in ("uniform", "shared", "skewed", "ties")] \
    + [(4, 384, "skewed"), (8, 384, "skewed"), (8, 384, "uniform"), (8, 3072, "skewed"), (8, 3072, "uniform")]


@pytest.mark.parametrize("M,I,kind", ALT_CASES)
def test_alternate_items_and_the_passes_alone(M, I, kind):
    """The default at buckets 4 / 8 runs the alternate "parts" items when alt_parts x #passes <= Q, else the
    passes; the contender (alt_parts=0) always runs the passes. Where both take the passes, every output bit is the
    same; where the default takes the parts, its two fp32 chains over I / 2 stay within a bf16 ulp of the passes'
    chain over I. Both against the reference, with the counters reset and the poisoned workspace rewritten."""
    ck, prep, z, ids, w, ws = case(M, I, kind, 5200 * M + I + len(kind))
    key = mx.compile_key(E, DL, I, M)
    assert key.alt_parts == mx.ALT_PARTS
    few = key.alt_parts * n_passes(ids, key.NT) <= key.Q
    if kind in ("shared", "skewed", "uniform"):
        assert few == (kind != "uniform")
    outs = run_variants(M, z, ids, w, prep, ws, default={}, passes=dict(alt_parts=0))
    ref = reference(z, ids, w, ck)
    assert_close("default", outs["default"], ref, "bf16_kernel")
    assert_close("alt_parts=0", outs["passes"], ref, "bf16_kernel")
    if few:
        assert_close("default vs alt_parts=0", outs["default"], outs["passes"], "bf16_kernel_pair")
    else:
        assert same_bits(outs["default"], outs["passes"])


@pytest.mark.parametrize("I", [256, 384])
def test_one_graph_takes_both_branches(I):
    """One captured graph at M = 8 replayed with routings on either side of the branch, in turn: each replay matches
    the reference and resets the counters (the branch is taken per launch, from the ids in the graph). The contender
    replays the same routings."""
    M = 8
    ck, prep, z, ids, w, ws = case(M, I, "skewed", 5300 + I)
    for kw in ({}, dict(alt_parts=0)):
        g, out = capture(M, z, ids, w, prep, ws, **kw)
        for k, kind in enumerate(("uniform", "skewed", "uniform", "shared")):
            replay_with_new_routings(g, out, z, ids, w, ws, ck, kind, 5301 + I + k, n=1)


ROT_CASES = [(m, 256, r) for m in (1, 2, 8, 64) for r in ("uniform", "ties")] + [(16, 384, "skewed"),
                                                                                (1, 3072, "uniform")]


@pytest.mark.parametrize("M,I,kind", ROT_CASES)
def test_rot_and_nibble_layouts_agree(M, I, kind):
    """The rot layout (rotations + masks, A pre-scaled by an exact bf16x2 multiply, MMAs straight into the
    accumulator) and the nibble layout (prepare_mxfp4_experts' fallback for scales > 128: PRMT table, fp32
    per-block scale FMAs) dequantise the same weights exactly, so both match the reference; they may differ in the
    last fp32 bits of the accumulation order only."""
    ck, prep_rot, z, ids, w, ws = case(M, I, kind, 6000 * M + I + len(kind))
    prep_nib = weights(I, "nibble")[1]
    rot = run_variants(M, z, ids, w, prep_rot, ws, rot={})["rot"]
    nib = run_variants(M, z, ids, w, prep_nib, ws, nib={})["nib"]
    ref = reference(z, ids, w, ck)
    assert_close("rot", rot, ref, "bf16_kernel")
    assert_close("nibble", nib, ref, "bf16_kernel")
    assert_close("rot vs nibble", rot, nib, "bf16_kernel_pair")


@pytest.mark.parametrize("scales", [(0, 12), (100, 129)], ids=["tiny", "up_to_128"])
def test_rot_layout_edge_scales(scales):
    """Scales at both ends of what the rot layout takes: E8M0 0..11 in w1/w3 (bf16 subnormal weights, multiplier
    2^-1..2^10; w2 keeps realistic scales and z is lifted by 2^100 so nothing underflows) and 100..128 everywhere
    (multiplier up to 2^127, the largest finite power of two in bf16). The result must match the reference's exact
    dequant."""
    M = 8
    ck, prep, z, ids, w, ws = case(M, 256, "uniform", 7000 + scales[0], scales=scales,
                                   scales2=(118, 124) if scales[0] == 0 else None)
    if scales[0] == 0:
        z = (z.float() * 2.0 ** 100).to(BF)          # weights ~2^-127..2^-114: lift a and c out of underflow
    out = run_variants(M, z, ids, w, prep, ws, rot={})["rot"]
    ref = reference(z, ids, w, ck)
    assert ref.abs().max() > 0 and torch.isfinite(ref).all()
    assert_close(f"scales {scales}", out, ref, "bf16_kernel")
