"""CPU tests for k3fast.kernels.moe_mxfp4_experts: layout round trip (bit-exact), host checks, and sm_90a compiles."""
import pytest
import torch

from k3fast.kernels import moe_mxfp4_experts as mx
from k3fast.kernels._dsl import dsl_available
from k3ref.config import k3, k3_rank

pytestmark = pytest.mark.compile


def _rand_ckpt(E, I, dL, gen, scale_lo=0, scale_hi=255):
    r = lambda *s: torch.randint(0, 256, s, generator=gen, dtype=torch.uint8)
    sc = lambda *s: torch.randint(scale_lo, scale_hi, s, generator=gen, dtype=torch.uint8)
    return (r(E, I, dL // 2), sc(E, I, dL // 32), r(E, I, dL // 2), sc(E, I, dL // 32),
            r(E, dL, I // 2), sc(E, dL, I // 32))


@pytest.mark.parametrize("layout", ["nibble", "rot"])
def test_prepare_roundtrip_bit_exact_all_bytes(layout):
    gen = torch.Generator().manual_seed(0)
    E, I, dL = 3, 128, 192
    # the rot layout takes scales up to ROT_MAX_SCALE (its multiplier 2^(E-1) must be a finite bf16)
    w1, s1, w3, s3, w2, s2 = _rand_ckpt(E, I, dL, gen, 0, 256 if layout == "nibble" else mx.ROT_MAX_SCALE + 1)
    # every byte value appears in every packed tensor, at several positions
    for t in (w1, w3, w2):
        flat = t.view(-1)
        flat[:256] = torch.arange(256, dtype=torch.uint8)
        flat[-256:] = torch.arange(255, -1, -1, dtype=torch.uint8)
    prep = mx.prepare_mxfp4_experts(w1, s1, w3, s3, w2, s2, layout=layout)
    assert prep.dims == (E, I, dL) and prep.layout == layout
    d1, d3, d2 = mx.dequant_prepared(prep)
    for got, (q, s) in [(d1, (w1, s1)), (d3, (w3, s3)), (d2, (w2, s2))]:
        ref = mx.dequant_checkpoint(q, s)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))      # bit-exact, incl. -0.0
    # the raw codes and scales survive the round trip too
    c13, sc13 = mx._unpack_tiles(prep.w13q, prep.w13s, layout)
    assert torch.equal(c13[:, :, :8].reshape(E, I, dL), mx._unpack_codes(w1))
    assert torch.equal(sc13[:, :, 8:].reshape(E, I, dL // 32), s3)


def _decode_word_like_kernel(word: int):
    """Python model of the kernel's PRMT decode (decode8) -> 8 bf16 bit patterns in output order."""
    def prmt(a, b, sel):
        src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
        return sum(src[(sel >> (4 * k)) & 7] << (8 * k) for k in range(4))
    w = word & 0xFFFFFFFF
    m = w & 0x77777777
    mh = (m >> 16) & 0xFFFF
    H0, H1 = mx._LUT_HI
    L0, L1 = mx._LUT_LO
    hA, lA, hB, lB = prmt(H0, H1, m), prmt(L0, L1, m), prmt(H0, H1, mh), prmt(L0, L1, mh)
    sm = 0x80008000
    o = [prmt(lA, hA, 0x5140) | (w & sm), prmt(lA, hA, 0x7362) | ((w << 4) & sm),
         prmt(lB, hB, 0x5140) | ((w << 8) & sm), prmt(lB, hB, 0x7362) | ((w << 12) & sm)]
    out = []
    for x in o:
        out += [x & 0xFFFF, (x >> 16) & 0xFFFF]
    return out


def test_kernel_decode_model_matches_layout():
    """The register decode (modelled bit by bit) yields the bf16 of the codes the layout stores, in A-fragment order."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (1, 1, 16, 64), generator=gen, dtype=torch.uint8)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)
    scales = torch.full((1, 1, 16, 2), 127, dtype=torch.uint8)
    q, _ = mx._pack_tiles(codes, scales)
    mag = torch.tensor(mx.E2M1_MAG)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for s in range(4):
            bb, s2 = s // 2, s % 2
            got = _decode_word_like_kernel(int(q[0, 0, 0, lane, s]))
            k = 32 * bb + 8 * t + 4 * s2
            # A fragment order: (g, k..k+1), (g+8, k..k+1), (g, k+2..k+3), (g+8, k+2..k+3)
            want_rc = [(g, k), (g, k + 1), (g + 8, k), (g + 8, k + 1), (g, k + 2), (g, k + 3), (g + 8, k + 2),
                       (g + 8, k + 3)]
            for bits, (r, kk) in zip(got, want_rc):
                c = int(codes[0, 0, r, kk])
                v = float(mag[c & 7]) * (-1.0 if c & 8 else 1.0)
                want = torch.tensor([v], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
                assert bits == want, (lane, s, r, kk, hex(bits), hex(want))


def test_rot_layout_tiles_the_word():
    """Every stored bit feeds exactly one register bit, and each register gets exactly its 8 bits (ROT_S)."""
    used = 0
    for pieces in mx.ROT_PIECES:
        img = 0
        for r, mask in pieces:
            src = ((mask >> r) | (mask << (32 - r))) & 0xFFFFFFFF if r else mask
            assert used & src == 0 and img & mask == 0
            used |= src
            img |= mask
        assert img == mx.ROT_S
    assert used == 0xFFFFFFFF


def test_rot_decode_model_matches_layout():
    """The rot decode (rotations and masks, modelled step for step) times the kernel's multiplier (one IMAD on the
    E8M0 byte, an exact bf16x2 multiply) is the exact dequantised weight of every code at every scale 0..128, in
    A-fragment order."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (1, 1, 16, 64), generator=gen, dtype=torch.uint8)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)
    scales = torch.full((1, 1, 16, 2), 127, dtype=torch.uint8)
    q, _ = mx._pack_tiles(codes, scales, "rot")
    pats = mx.rot_decode_reference(q.to(torch.int64))                     # [1, 1, 1, 32, 4, 4] bf16x2 patterns
    mag = torch.tensor(mx.E2M1_MAG)

    def bf16(bits):
        return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()
    for E in (0, 1, 64, 120, 127, 128):
        mult = (E * 0x00800080 + 0x3F003F00) & 0xFFFFFFFF                   # the kernel's IMAD
        assert mult & 0xFFFF == mult >> 16 and bf16(mult) == 2.0 ** (E - 1)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for s in range(4):
                bb, s2 = s // 2, s % 2
                k = 32 * bb + 8 * t + 4 * s2
                want_rc = [(g, k), (g, k + 1), (g + 8, k), (g + 8, k + 1), (g, k + 2), (g, k + 3), (g + 8, k + 2),
                           (g + 8, k + 3)]
                for n, (r, kk) in enumerate(want_rc):
                    bits = int(pats[0, 0, 0, lane, s, n // 2]) >> (16 * (n % 2))
                    c = int(codes[0, 0, r, kk])
                    want = float(mag[c & 7]) * (-1.0 if c & 8 else 1.0) * 2.0 ** (E - 127)
                    got = bf16(bits) * 2.0 ** (E - 1)                       # exact: powers of two, no overflow
                    got_bf16 = torch.tensor([got]).bfloat16().float().item()
                    assert got == want == got_bf16, (E, lane, s, r, kk, got, want)


def test_distinct_expert_bytes():
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]], dtype=torch.int32)
    assert mx.distinct_expert_bytes(ids, (3584, 256)) == 4 * mx.expert_bytes(3584, 256)
    assert mx.expert_bytes(3584, 256) == 1_462_272
    assert mx.distinct_expert_bytes(ids, k3_rank(16)) == 4 * 1_462_272


def _small_prep():
    gen = torch.Generator().manual_seed(2)
    return mx.prepare_mxfp4_experts(*_rand_ckpt(4, 64, 128, gen, 118, 125))


def test_bad_inputs_rejected_on_cpu():
    prep = _small_prep()
    z = torch.randn(2, 128).bfloat16()
    ids = torch.zeros(2, 16, dtype=torch.int32)
    w = torch.full((2, 16), 1 / 16)
    with pytest.raises(TypeError):
        mx.moe_mxfp4_experts(z.float(), ids, w, prep, None, None, None)
    with pytest.raises(TypeError):
        mx.moe_mxfp4_experts(z, ids.long(), w, prep, None, None, None)
    with pytest.raises(ValueError):
        mx.moe_mxfp4_experts(z, ids[:, :8], w, prep, None, None, None)
    with pytest.raises(ValueError):
        mx.moe_mxfp4_experts(torch.randn(2, 96).bfloat16(), ids, w, prep, None, None, None)
    with pytest.raises(ValueError):
        mx.moe_mxfp4_experts(torch.randn(65, 128).bfloat16(), torch.zeros(65, 16, dtype=torch.int32),
                             torch.zeros(65, 16), prep, None, None, None)
    with pytest.raises(ValueError, match="CUDA"):
        mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None)
    with pytest.raises(ValueError):
        mx.prepare_mxfp4_experts(*[torch.zeros(4, 64, 63, dtype=torch.uint8)] * 6)
    with pytest.raises(TypeError):
        mx.prepare_mxfp4_experts(*[torch.zeros(4, 64, 64, dtype=torch.int8)] * 6)
    # layouts: auto picks rot for scales <= 128 and nibble above; rot is refused above; a version that cannot
    # decode the layout, and the four tensors without their layout, are refused before any kernel runs
    assert prep.layout == "rot"
    gen = torch.Generator().manual_seed(9)
    big = _rand_ckpt(4, 64, 128, gen, 120, 140)
    assert mx.prepare_mxfp4_experts(*big).layout == "nibble"
    with pytest.raises(ValueError, match="rot"):
        mx.prepare_mxfp4_experts(*big, layout="rot")
    with pytest.raises(ValueError, match="layout"):
        mx.prepare_mxfp4_experts(*big, layout="nib")
    with pytest.raises(ValueError, match="version"):
        mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, version=3)
    with pytest.raises(ValueError, match="layout"):
        mx.moe_mxfp4_experts(z, ids, w, prep.w13q, prep.w13s, prep.w2q, prep.w2s)
    with pytest.raises(ValueError, match="layout"):
        mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, layout="nibble")
    with pytest.raises(ValueError, match="versions >= 4"):
        mx.compile_key(896, 3584, 256, 8, version=3, layout="rot")


def test_cluster_and_split_choices():
    for cfg in (k3_rank(16), k3_rank(8), k3()):
        for key in mx.compile_keys(cfg):
            assert key.T1 * key.S % key.W == 0 and key.NKB1 % key.S == 0
            assert key.Q * key.C <= 132
    with pytest.raises(ValueError):
        mx.m_bucket(65)


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("cfg", [k3_rank(16), k3_rank(8), k3()], ids=["k3_rank16", "k3_rank8", "full"])
def test_compile_all_keys(cfg):
    keys = mx.compile_keys(cfg)
    assert {k.MB for k in keys} == set(mx.M_BUCKETS)
    for key in keys:
        small = 8 if key.MB == 1 and cfg.expert_intermediate != 384 else 7    # v8 at b1, even row blocks
        assert key.version == mx.default_version(key.MB, key.I, key.dL) == (small if key.MB <= 2 else 5)
        assert key.layout == "rot" and key.W == mx.DEFAULT_WARPS == 16
        assert key.C == (mx.V7_CLUSTER if key.version in (7, 8) else mx.default_cluster(key.MB))
        assert mx.get_kernel(key) is not None


def test_default_cluster_keeps_every_busy_cluster_co_resident():
    # Clusters of 2 are TPC pairs (66 always fit on 132 SMs); clusters of 4 only where <= 32 experts are active
    # (M <= 2), so a cluster that would run as a second wave never has work (version log, v4 measured).
    for MB in mx.M_BUCKETS:
        C = mx.default_cluster(MB)
        active_max = min(mx.TOPK * MB, 896)
        fits = {2: 66, 4: 32}[C]
        assert active_max <= fits or C == 2
    assert mx.cluster_before_20261129(8) == 8 and mx.default_cluster(8) == 2


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
def test_compile_other_versions_for_ab_benchmarks():
    # k3fast.measure.bench / bench_experts time v2, v3 and the opt-in v5 beside the default on the same inputs
    for v in (2, 3, 5):
        for M in (8, 64):
            key = mx.compile_key(896, 3584, 256, M, version=v)
            assert key.layout == ("nibble" if v < 4 else "rot")
            assert mx.get_kernel(key) is not None
    for M in (1, 8, 64):        # the nibble-layout default (the A/B of the rot decode)
        assert mx.get_kernel(mx.compile_key(896, 3584, 256, M, layout="nibble")) is not None
    assert mx.get_kernel(mx.compile_key(896, 3584, 3072, 64, version=5)) is not None
    with pytest.raises(ValueError, match="version"):
        mx.compile_key(896, 3584, 256, 8, version=6)


def test_smem_fits_and_v5_keeps_v4s_carveout():
    # every default key and its v5 twin fit 227 KB of shared memory, and v5 (pass offsets packed into act_e, no
    # table of its own) asks for exactly v4's bytes, so it never lands in a larger carve-out with less L1 (v5 as
    # first written was 32 B over the 196 KB step at rank8 b64: s106 / s106c, version log v5.1)
    import dataclasses
    for cfg in (k3_rank(16), k3_rank(8), k3()):
        for key in mx.compile_keys(cfg):
            for v in (key.version, 5):
                k = dataclasses.replace(key, version=v, parts=key.parts if v == key.version else 1,
                                        alt_parts=key.alt_parts if v == key.version else 0)
                assert mx._kernel_class()(k).smem_bytes <= 227 * 1024, (k, mx._kernel_class()(k).smem_bytes)
            if key.version in (4, 5):
                k4, k5 = (dataclasses.replace(key, version=v, alt_parts=0) for v in (4, 5))
                assert k4.smem_bytes == k5.smem_bytes, (k4, k5)
                # v5.2 (buckets 4 / 8) shares its regions with v7's items: more bytes, but the same carve-out step
                assert mx.l1_kb(k4.smem_bytes) == mx.l1_kb(k5.smem_bytes) == key.l1_kb, (key, k4.smem_bytes)


def test_l1_left_by_the_carveout():
    # sm_90's carve-out steps (KB) with 1 KB reserved per CTA: the smallest step that holds the CTA's bytes + 1 KB
    from k3fast.kernels._dsl import carveout_kb
    assert carveout_kb(0) == 8 and mx.l1_kb(0) == 248
    assert carveout_kb(195 * 1024) == 196 and mx.l1_kb(195 * 1024) == 60
    assert carveout_kb(195 * 1024 + 1) == 228 and mx.l1_kb(195 * 1024 + 1) == 28
    assert carveout_kb(131 * 1024) == 132 and carveout_kb(131 * 1024 + 16) == 164
    with pytest.raises(ValueError, match="227"):
        carveout_kb(227 * 1024 + 16)
    # the rank8 b64 keys sit under the 196 KB step; the old v5 table (4 KB more) would not
    k8 = mx.compile_key(896, 3584, 384, 64)
    assert mx.l1_kb(k8.smem_bytes) == 60
    assert mx.l1_kb(k8.smem_bytes + 4 * (k8.PMAX + 4)) == 28


def test_v3_smem_holds_staged_z():
    # z rows of a pass (NT x dL bf16, padded) share the h region; the CTA must still fit in 227 KB
    for cfg in (k3_rank(16), k3_rank(8), k3()):
        for key in mx.compile_keys(cfg):
            assert key.ZW * 4 >= key.dL * 2 and (key.ZW % 32) == 16


def _kernel_sort_model(flat_ids, E, warp_order, threads=256):
    """Python model of the kernel's routing sort (v2): smem-atomic placement in a CTA-specific warp order, then the
    re-rank of each expert segment by pair index."""
    P = len(flat_ids)
    cnt, slot = [0] * E, [0] * P
    for it in range(0, P, threads):
        for w in warp_order(it):
            for p in range(it + 32 * w, min(it + 32 * w + 32, P)):
                slot[p] = cnt[flat_ids[p]]
                cnt[flat_ids[p]] += 1
    off, acc = [0] * E, 0
    for e in range(E):
        off[e], acc = acc, acc + cnt[e]
    tmp = [0] * P
    for p in range(P):
        tmp[off[flat_ids[p]] + slot[p]] = p
    out = [0] * P
    for p in range(P):
        e = flat_ids[p]
        seg = tmp[off[e]:off[e] + cnt[e]]
        out[off[e] + sum(q < p for q in seg)] = p
    return out


def test_routing_order_is_cta_independent():
    """v1 bug: the pair order inside an expert depended on warp arrival order, which differs between the CTAs of a
    cluster (they exchange h by column position).  The v2 order must equal a stable sort by expert."""
    gen = torch.Generator().manual_seed(3)
    for M in (3, 8, 64):
        base = torch.randperm(64, generator=gen)[:16]
        ids = torch.stack([base[torch.randperm(16, generator=gen)] for _ in range(M)]).reshape(-1).tolist()
        want = sorted(range(len(ids)), key=lambda p: (ids[p], p))
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            order = lambda it: torch.randperm(8, generator=g).tolist()
            assert _kernel_sort_model(ids, 64, order) == want


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("M", [1, 64])
def test_v4_ring_carries_no_copies_of_inflight_loads(M):
    """v3's weight ring made the compiler copy every ring register at the loop head (each copy waits for its
    load); v4 consumes a slot before refilling it. Checked on the PTX of the main loops (>= 8 global loads)."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx, loop_copies_of_loads
    base = mx.compile_key(56, 3584, 256, M, version=4)
    stats = {}
    for v, layout in ((3, "nibble"), (4, "nibble"), (4, "rot")):
        ptx = compiled_ptx(lambda: mx._compile(dataclasses.replace(base, version=v, layout=layout),
                                               options="--enable-tvm-ffi --keep-ptx"))
        stats[v if layout == "nibble" else "rot"] = [s for s in loop_copies_of_loads(ptx) if s.global_loads >= 8]
    for v in (4, "rot"):
        assert stats[v] and all(s.copies_of_loads == 0 for s in stats[v]), stats[v]
    assert any(s.copies_of_loads >= 40 for s in stats[3]), "the checker no longer sees v3's copies"


def _emulate_v5_items(ids, NT):
    """The v5 prologue's bookkeeping in numpy int32 (block scan of packed counts; each active expert's first pass
    packed into act_e's high half, the totals into scr[32]; the 11-step binary search of each work item): returns
    the (expert, first pair of the pass, pairs of the expert) of every item, in item order, the expert counts and
    the routing tables act_e / act_off (v5.2's v7 items read them)."""
    import numpy as np
    E = 896
    cnt = np.bincount(ids.ravel(), minlength=E).astype(np.int64)
    loc = cnt + ((cnt > 0).astype(np.int64) << 11) + (((cnt + NT - 1) // NT) << 21)
    excl = (np.cumsum(loc) - loc).astype(np.int64)
    assert loc.sum() < 2 ** 31, "packed scan overflows int32"
    act_e, act_off = [], []
    for e in range(E):
        if cnt[e]:
            assert (excl[e] >> 11) & 0x3FF == len(act_e)
            qa = int((excl[e] >> 21) & 0x7FF)
            word = e | (qa << 16)
            assert word < 2 ** 31 and word & 0xFFFF == e
            act_e.append(word)
            act_off.append(int(excl[e] & 0x7FF))
    act_off.append(int(cnt.sum()))
    scr32 = len(act_e) | (int(((cnt + NT - 1) // NT).sum()) << 16)
    n_active, n_pass = scr32 & 0xFFFF, scr32 >> 16
    items = []
    for wi in range(n_pass):
        lo, hi = 0, n_active
        for _ in range(11):
            mid = (lo + hi) // 2
            assert mid < n_active          # the search never reads past the last active expert
            if (act_e[mid] >> 16) <= wi:
                lo = mid
            else:
                hi = mid
        items.append((act_e[lo] & 0xFFFF, (wi - (act_e[lo] >> 16)) * NT, act_off[lo + 1] - act_off[lo]))
    return items, cnt, act_e, act_off


def _routing_np(M, kind):
    import numpy as np
    rng = np.random.default_rng(1000 * M + len(kind))
    if kind == "uniform":
        return np.stack([rng.permutation(896)[:16] for _ in range(M)])
    if kind == "shared":                 # one set of 16 for every token (drawn once), in different orders
        base = rng.permutation(896)[:16]
        return np.stack([rng.permutation(base) for _ in range(M)])
    if kind == "skewed":
        hot = rng.permutation(896)[:24]
        return np.stack([hot[rng.permutation(24)[:16]] for _ in range(M)])
    return np.full((M, 16), 5)


@pytest.mark.parametrize("M", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("kind", ["uniform", "shared", "skewed", "one-expert"])
def test_v5_pass_items_cover_every_pass_once(M, kind):
    """v5 hands out single passes (expert, <= NT pairs) as work items.  The index math, replayed on CPU for routings
    from all-distinct to one expert in every slot: every pass of every active expert is one item, in order."""
    ids = _routing_np(M, kind)
    NT = 8 * (1 if mx.m_bucket(M) <= 8 else 2)
    items, cnt, _, _ = _emulate_v5_items(ids, NT)
    want = [(e, pb, int(cnt[e])) for e in range(896) if cnt[e] for pb in range(0, int(cnt[e]), NT)]
    assert items == want


@pytest.mark.parametrize("M", [3, 8])
@pytest.mark.parametrize("kind", ["uniform", "shared", "skewed", "one-expert"])
def test_v52_branch_and_its_v7_items(M, kind):
    """v5.2 routes as v5, then runs v7's items when alt_parts x #passes <= Q. Replayed on the CPU: the branch each
    routing takes (few hot experts: v7's halves; uniform: v5's passes), and that v7's items read from v5's tables
    (act_e masked to its low half, act_off) are exactly the items of v7's own routing: every active expert in
    order, each in alt_parts parts, over its own pair segment."""
    import numpy as np
    key = mx.compile_key(896, 3584, 256, M)
    assert key.version == 5 and key.alt_parts == 2 and key.alt.NH == 2
    ids = _routing_np(M, kind)
    items, cnt, act_e, act_off = _emulate_v5_items(ids, key.NT)
    few = key.alt_parts * len(items) <= key.Q
    assert few == (kind != "uniform"), (kind, len(items), key.Q)
    if few:
        v7_items = [(act_e[wi // 2] & 0xFFFF, wi % 2, act_off[wi // 2], act_off[wi // 2 + 1] - act_off[wi // 2])
                    for wi in range(key.alt.NH * len(act_e))]
        active = [e for e in range(896) if cnt[e]]
        seg = np.concatenate([[0], np.cumsum([cnt[e] for e in active])])
        assert v7_items == [(e, h, int(seg[u]), int(cnt[e])) for u, e in enumerate(active) for h in range(2)]


def test_v52_keys_and_bounds():
    """v5.2 at buckets 4 / 8 only (v7's part counters stop at bucket 8; buckets <= 2 run v7 / v8 themselves): one
    grid for both item loops (v7's Q, >= v5's), the regions the larger of the two, the workspace holds v7's fp32
    parts and the bf16 rows, and keys that cannot carry v7's items are refused."""
    import dataclasses
    for cfg in (k3_rank(16), k3_rank(8), k3()):
        E, dL, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate
        for key in mx.compile_keys(cfg):
            if key.MB not in (4, 8):
                assert key.alt_parts == 0 and key.alt is None
                continue
            a, v51 = key.alt, dataclasses.replace(key, alt_parts=0)
            assert key.alt_parts == 2 and a.version == 7 and a.NH == 2 and a.alt_parts == 0
            sb = dict(situ_beta=key.situ_beta, situ_linear_beta=key.situ_linear_beta)
            assert mx.compile_key(E, dL, I, key.MB, version=7, **sb) == a  # bit-identical to v7 itself (GPU test)
            assert key.Q == a.Q >= v51.Q
            assert key.regions == tuple(max(x, y) for x, y in zip(v51.regions, a.regions))
            assert 2 * (2 * key.MB * 16 * dL) + key.MB * 16 * dL <= mx.MAX_M * 16 * dL
            assert mx.compile_key(E, dL, I, key.MB, alt_parts=0, **sb) == v51
    base = mx.compile_key(896, 3584, 256, 8)
    for bad in (dict(version=4), dict(MB=16), dict(probe="stream"), dict(alt_parts=1)):
        with pytest.raises(ValueError, match="alt_parts"):
            dataclasses.replace(base, **bad)
    assert mx.compile_key(896, 3584, 256, 8, C=4).alt_parts == 0


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
def test_v52_carries_both_item_loops():
    """The v5.2 binary holds v5's items and v7's: v7's part reduction adds its fence and atomics to v5.1's."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx
    key = mx.compile_key(896, 3584, 256, 8)
    ptx = {k.alt_parts: compiled_ptx(lambda k=k: mx._compile(k, options="--enable-tvm-ffi --keep-ptx"))
           for k in (key, dataclasses.replace(key, alt_parts=0))}
    v7 = compiled_ptx(lambda: mx._compile(key.alt, options="--enable-tvm-ffi --keep-ptx"))
    assert ptx[0].count("fence.acq_rel.gpu") == 1 and v7.count("fence.acq_rel.gpu") == 2
    assert ptx[2].count("fence.acq_rel.gpu") == 3
    assert ptx[2].count("atom.global") > ptx[0].count("atom.global")


def test_loop_opcodes_counts_a_hand_written_loop():
    from k3fast.measure.ptxcheck import loop_opcodes
    ptx = "\n".join([
        "$L__BB0_7:",
        "\tld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];",
        "\tprmt.b32 %r5, %r1, %r2, %r3;",
        "\tprmt.b32 %r6, %r1, %r2, %r4;",
        "\tand.b32 %r7, %r5, 255;",
        "\t@%p1 bra $L__BB0_7;",
        "\tret;",
    ])
    assert loop_opcodes(ptx, min_loads=1) == {"L__BB0_7": {"prmt": 2, "ld": 1, "and": 1, "bra": 1}}
    assert loop_opcodes(ptx, min_loads=2) == {}


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("M", [8, 64])
def test_rot_layout_shortens_the_main_loops(M):
    """The point of the rot layout: fewer instructions per weight step in the FC1/FC2 loops than the nibble
    layout's PRMT-table decode + fp32 scale FMAs (PTX, per MMA: both do the same MMAs; SASS figures in the module's
    version log)."""
    from k3fast.measure.ptxcheck import compiled_ptx, loop_opcodes
    per_load = {}
    for layout in ("nibble", "rot"):
        key = mx.compile_key(896, 3584, 256, M, layout=layout)
        loops = loop_opcodes(compiled_ptx(lambda: mx._compile(key, options="--enable-tvm-ffi --keep-ptx")))
        n = sum(sum(ops.values()) for ops in loops.values())
        per_load[layout] = (n, sum(ops.get("mma", 0) for ops in loops.values()))
    (n_nib, l_nib), (n_rot, l_rot) = per_load["nibble"], per_load["rot"]
    assert l_nib == l_rot > 0, per_load
    assert n_rot <= 0.8 * n_nib, per_load


@pytest.mark.parametrize("I", [256, 384, 3072])
@pytest.mark.parametrize("M", [1, 2])
def test_v6_index_math_covers_every_weight_row_once(I, M):
    """v6 (one expert = two work items, one per half of I): the FC1 and FC2 row arithmetic of the kernel, replayed
    on CPU over both halves, every CTA rank of a cluster, every warp and step, reads each 16-byte w13 and w2 row of
    an expert exactly once (FC2 steps of clamped tiles past T2 are re-reads that are never stored, as in v4)."""
    from collections import Counter
    c = mx.compile_key(896, 3584, I, M, version=6)
    assert c.C * c.T1 * 2 == I // 8 and c.NKB2H * 2 == c.NKB2 and c.Q % 2 == 0 and c.Q <= 32
    fc1, fc2 = Counter(), Counter()
    for hI in (0, 1):
        for rank in range(c.C):
            t1_base = hI * (I // 16) + rank * c.T1
            t2_base = rank * c.T2
            for warp in range(c.W):
                for s in range(c.U1 * c.KS1):                 # the kernel's fc1_row
                    i = s // c.KS1
                    uu = warp + c.W * i
                    fc1[(t1_base + uu // c.S) * c.NKB1 + (uu % c.S) * c.KS1 + (s - i * c.KS1)] += 1
                for s in range(c.U2 * c.NKB2H):               # the kernel's fc2_row with koff = hI NKB2H
                    i = s // c.NKB2H
                    if warp + c.W * i < c.T2:
                        fc2[(t2_base + warp + c.W * i) * c.NKB2 + hI * c.NKB2H + (s - i * c.NKB2H)] += 1
    assert fc1 == Counter(range(I // 8 * c.NKB1))
    assert fc2 == Counter(range(3584 // 16 * c.NKB2))


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("I", [256, 384, 3072])
def test_v6_compiles(I):
    for M in (1, 2):
        mx.get_kernel(mx.compile_key(896, 3584, I, M, version=6))
    with pytest.raises(ValueError, match="version 6"):
        mx.compile_key(896, 3584, I, 8, version=6)


def _cta_rows(c, t1_base, t2_base, t2n, koff):
    """The 16-byte w13 and w2 rows one CTA's warps read (Counters), replayed from the kernel's FC1 / FC2 row
    arithmetic: FC1 units warp + W i of S K parts; FC2 tiles warp + W i below t2n, NKB2H K steps from koff."""
    from collections import Counter
    fc1, fc2 = Counter(), Counter()
    for warp in range(c.W):
        for s in range(c.U1 * c.KS1):
            i = s // c.KS1
            uu = warp + c.W * i
            fc1[(t1_base + uu // c.S) * c.NKB1 + (uu % c.S) * c.KS1 + (s - i * c.KS1)] += 1
        for s in range(c.U2 * c.NKB2H):
            i = s // c.NKB2H
            if warp + c.W * i < t2n:
                fc2[(t2_base + warp + c.W * i) * c.NKB2 + koff + (s - i * c.NKB2H)] += 1
    return fc1, fc2


@pytest.mark.parametrize("I", [256, 384, 3072])
@pytest.mark.parametrize("M", [1, 2, 8])
def test_v7_index_math_covers_every_weight_row_once(I, M):
    """v7 (one expert = NH work items, one per part of I, clusters of 2): the kernel's FC1 and FC2 row arithmetic,
    replayed on CPU over every part, CTA rank, warp and step, reads each 16-byte w13 and w2 row of an expert exactly
    once; the grid's clusters all fit (Q * C <= 132) and every part has a cluster at b1."""
    from collections import Counter
    c = mx.compile_key(896, 3584, I, M, version=7)
    NH = c.NH
    assert c.C == mx.V7_CLUSTER and NH == mx.default_parts(I, c.MB, c.C) and c.Q * c.C <= 132
    assert c.C * c.T1 * NH == I // 8 and c.NKB2H * NH == c.NKB2
    if M == 1:
        assert NH > 1 and c.Q >= NH * 16
    if M == 8:
        assert NH == mx.MID_BATCH_PARTS == 2 and c.Q * c.C == 132
    fc1, fc2 = Counter(), Counter()
    for hI in range(NH):
        for rank in range(c.C):
            a, b = _cta_rows(c, hI * (c.IH // 8) + rank * c.T1, rank * c.T2, c.T2, hI * c.NKB2H)
            fc1 += a
            fc2 += b
    assert fc1 == Counter(range(I // 8 * c.NKB1))
    assert fc2 == Counter(range(3584 // 16 * c.NKB2))


def test_v7_parts_and_workspace_bounds():
    """default_parts: the most parts whose items all get a cluster at once; counters and y views stay in bounds."""
    assert [mx.default_parts(256, mb, 2) for mb in (1, 2)] == [4, 2]
    assert [mx.default_parts(384, mb, 2) for mb in (1, 2)] == [3, 2]
    assert mx.default_parts(3072, 1, 2) == 4
    assert [mx.default_parts(I, mb, 2) for I in (256, 384, 3072) for mb in (4, 8)] == [2] * 6   # MID_BATCH_PARTS
    for I in (256, 384, 3072):
        for M in (1, 2, 3, 8):
            c = mx.compile_key(896, 3584, I, M, version=7)
            assert mx.PART_COUNTERS + c.PMAX * c.C <= mx.MAX_M * 8            # part counters inside the workspace's
            assert mx.PART_COUNTERS >= mx.MAX_M * 4                          # ... after every combine counter
            assert 2 * c.NH * M * 16 + M * 16 <= mx.MAX_M * 16               # fp32 parts + bf16 y_e in workspace.y
    with pytest.raises(ValueError, match="version 7"):
        mx.compile_key(896, 3584, 256, 9, version=7)                          # bucket 16: 256 pairs x 2 counters
    with pytest.raises(ValueError, match="parts"):
        mx.compile_key(896, 3584, 256, 1, version=4, parts=2)
    with pytest.raises(ValueError, match="parts"):
        mx.compile_key(896, 3584, 256, 1, version=7, parts=3)                 # 256 / 3 is not a multiple of 64


@pytest.mark.parametrize("I", [256, 384, 3072])
@pytest.mark.parametrize("M", [1, 2])
def test_v8_index_math_and_its_v4_twin(I, M):
    """v8 (v7's parts of I for FC1; FC2 split by output rows over the expert's RB = NH x C CTAs, K = I): replayed
    on CPU, every w13 and w2 row of an expert is read exactly once (uneven row blocks too: rank8 b1's 224 tiles
    over 6 CTAs, 37 or 38 each) and every h column is published exactly once. Where RB divides the tiles, its FC1 K
    split, FC2 tiles and K steps equal v4's at clusters of RB, the twin the GPU test holds it to bit for bit (same
    partial sums in the same order; only where h travels differs: global memory, not DSMEM)."""
    from collections import Counter
    c = mx.compile_key(896, 3584, I, M, version=8)
    NH, C = c.NH, c.C
    assert C == mx.V7_CLUSTER and c.RB == NH * C and c.Q * C <= 132
    assert NH == mx.default_parts(I, c.MB, C) and c.NKB2H == c.NKB2 == I // 64
    assert c.T2_EVEN == ((I, M) != (384, 1))
    fc1, fc2, hcol = Counter(), Counter(), Counter()
    hcols = c.IH // C
    for hI in range(NH):
        for rank in range(C):
            t1_base = hI * (c.IH // 8) + rank * c.T1
            rbi = hI * C + rank
            t2_base, t2n = (rbi * c.T2, c.T2) if c.T2_EVEN else \
                (rbi * 224 // c.RB, (rbi + 1) * 224 // c.RB - rbi * 224 // c.RB)
            for ch in range(c.T1):
                for x in range(4):
                    hcol[hI * (c.IH // 2) + rank * (hcols // 2) + ch * 4 + x] += 1
            a, b = _cta_rows(c, t1_base, t2_base, t2n, 0)
            fc1 += a
            fc2 += b
    assert fc1 == Counter(range(I // 8 * c.NKB1))
    assert fc2 == Counter(range(3584 // 16 * c.NKB2))
    assert hcol == Counter(range(I // 2))                                      # h words of one pair
    if not c.T2_EVEN:
        return
    twin = mx.compile_key(896, 3584, I, M, version=4, C=c.RB)
    assert (twin.T1, twin.S, twin.KS1, twin.T2, twin.NKB2H, twin.W) == (c.T1, c.S, c.KS1, c.T2, c.NKB2H, c.W)


def test_v8_parts_counters_and_workspace_bounds():
    """v8 takes v7's parts (rank8 b1: 3, its 6 row blocks uneven: 38 tiles for the larger share); the h-exchange
    counters sit after v7's part counters and inside the workspace; hG and the bf16 y_e rows fit in workspace.y;
    a bucket above 2 is refused with the reason."""
    r8 = mx.compile_key(896, 3584, 384, 1, version=8)
    assert (r8.NH, r8.RB, r8.T2, r8.T2_EVEN) == (3, 6, 38, False)
    assert mx.compile_key(896, 3584, 256, 1, version=8).T2_EVEN
    for I in (256, 384, 3072):
        for M in (1, 2):
            c = mx.compile_key(896, 3584, I, M, version=8)
            assert mx.H_COUNTERS >= mx.PART_COUNTERS + c.PMAX * mx.V7_CLUSTER   # after v7's part counters
            assert mx.H_COUNTERS + c.PMAX <= mx.MAX_M * 8                        # one per segment (<= pairs)
            assert c.MB * c.RB <= mx.PART_COUNTERS                              # combine counters m RB + rbi
            assert c.PMAX * I + M * 16 * 3584 <= mx.MAX_M * 16 * 3584           # hG + y_e in workspace.y
    with pytest.raises(ValueError, match="version 8"):
        mx.compile_key(896, 3584, 256, 8, version=8)
    with pytest.raises(ValueError, match="a cluster per part"):               # 3 clusters of 2 for 4 parts
        mx.KernelCfg(E=896, dL=3584, I=256, MB=1, C=2, W=16, nsm=6, version=8, parts=4, layout="rot")


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("M,version,fences", [(1, 8, 1), (2, 7, 2), (8, 4, 1)])
def test_lean_arrive_drops_the_arrival_fences(M, version, fences):
    """lean_arrive: the gpu-scope fences before the combine's (and v7's part reduction's) arrivals go, and nothing
    else changes: the same number of atomics, and the default (LEAN_ARRIVE off) keeps its fences."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx
    base = mx.compile_key(896, 3584, 256, M, version=version)
    assert not base.lean_arrive and mx.compile_key(896, 3584, 256, M, version=version, lean_arrive=True).lean_arrive
    ptx = {lean: compiled_ptx(lambda lean=lean: mx._compile(dataclasses.replace(base, lean_arrive=lean),
                                                            options="--enable-tvm-ffi --keep-ptx"))
           for lean in (False, True)}
    assert ptx[False].count("fence.acq_rel.gpu") == fences and ptx[True].count("fence.acq_rel.gpu") == 0
    assert ptx[False].count("atom.global") == ptx[True].count("atom.global")


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("I", [256, 384])
def test_v8_tagged_exchange_ptx(I):
    """v8.3 (tagged): h travels as 64-bit words stored and polled relaxed at gpu scope (single-copy atomic), with no
    acquire spin on a counter; the option changes nothing in v8's own PTX; it is a version 8 option only, and the
    workspace carries its zeroed epoch / word buffer."""
    import dataclasses
    import re
    from k3fast.measure.ptxcheck import compiled_ptx
    for M in (1, 2):
        key = mx.compile_key(896, 3584, I, M, version=8, tagged=True)
        assert key.tagged and dataclasses.replace(key, tagged=False) == mx.compile_key(896, 3584, I, M, version=8)
        ptx = compiled_ptx(lambda: mx._compile(key, options="--enable-tvm-ffi --keep-ptx"))
        assert re.search(r"st\.relaxed\.gpu\.global\.b64", ptx) and re.search(r"ld\.relaxed\.gpu\.global\.b64", ptx)
        assert "ld.acquire" not in ptx and "barrier.cluster" not in ptx
    assert not mx.compile_key(896, 3584, I, 8, version=4, tagged=True).tagged       # other versions: untagged
    with pytest.raises(ValueError, match="tagged"):
        mx.KernelCfg(E=896, dL=3584, I=I, MB=1, C=2, W=16, version=7, parts=2, layout="rot", tagged=True)
    ws = mx.make_workspace(3584, "cpu")
    assert ws.hg.dtype == torch.int64 and ws.hg.shape == (33, mx.HG_MAX_WORDS) and not ws.hg.any()
    assert mx.H_LAUNCH < mx.MAX_M * 8 and mx.HG_MAX_WORDS >= 3072 // 2


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("I", [256, 384, 3072])
def test_v8_compiles_without_cluster_barriers(I):
    """v8 builds at buckets 1 / 2; its h goes through global memory: no cluster barrier or DSMEM store in the PTX,
    one acquire spin on the segment's counter, and the PTX of v7 at the same key keeps both cluster barriers."""
    from k3fast.measure.ptxcheck import compiled_ptx
    for M in (1, 2):
        key = mx.compile_key(896, 3584, I, M, version=8)
        ptx = compiled_ptx(lambda: mx._compile(key, options="--enable-tvm-ffi --keep-ptx"))
        assert "barrier.cluster" not in ptx and "st.shared::cluster" not in ptx
        assert ptx.count("ld.acquire.gpu") >= 1 and "atom.global.release.add" in ptx
    key7 = mx.compile_key(896, 3584, I, 1, version=7)
    ptx7 = compiled_ptx(lambda: mx._compile(key7, options="--enable-tvm-ffi --keep-ptx"))
    assert ptx7.count("barrier.cluster.arrive") >= 2 and "ld.acquire.gpu" not in ptx7


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("I", [256, 384, 3072])
def test_v7_compiles(I):
    for M in (1, 2, 4, 8):
        mx.get_kernel(mx.compile_key(896, 3584, I, M, version=7))


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("probe", ["sort", "fc1", "fc2"])
def test_stage_probes_compile(probe):
    """The stage probes (diagnostics: the stream probe stopped after the sort, FC1 or FC2) build for v7 and v4."""
    import dataclasses
    for M, v in ((1, 7), (1, 4), (8, 4)):
        key = dataclasses.replace(mx.compile_key(896, 3584, 256, M, version=v), probe=probe)
        assert mx.get_kernel(key) is not None
    with pytest.raises(ValueError, match="probe"):
        dataclasses.replace(mx.compile_key(896, 3584, 256, 1), probe="fc3")


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("I", [256, 384])
def test_route1_compiles_without_the_sort(I):
    """route1 (route_direct, batch bucket 1): the PTX has no shared-memory atomics (the counting sort's) and
    fewer CTA barriers than the sorted kernel; compile_key applies it only at bucket 1."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx
    base = mx.compile_key(896, 3584, I, 1, route_direct=False)
    assert not base.route_direct and mx.compile_key(896, 3584, I, 1, route_direct=True).route_direct
    assert mx.compile_key(896, 3584, I, 1).route_direct == mx.ROUTE_DIRECT     # the default (on since session 11)
    assert not mx.compile_key(896, 3584, I, 2, route_direct=True).route_direct
    ptx = {d: compiled_ptx(lambda d=d: mx._compile(dataclasses.replace(base, route_direct=d),
                                                   options="--enable-tvm-ffi --keep-ptx")).splitlines()
           for d in (False, True)}
    atoms = {d: sum("atom.shared" in ln for ln in p) for d, p in ptx.items()}
    bars = {d: sum(ln.strip().startswith(("bar.sync", "barrier.sync")) for ln in p) for d, p in ptx.items()}
    assert atoms[False] >= 1 and atoms[True] == 0, atoms
    assert bars[True] < bars[False], bars
    with pytest.raises(ValueError, match="route_direct"):
        mx.KernelCfg(E=896, dL=3584, I=I, MB=8, C=2, route_direct=True)


def test_ring_fit_depths():
    """ring_fit: each loop's ring depth is the deepest <= D that step_split needs no per-step division for; only
    for versions 4 / 5 / 7 (v6 and the nibble-layout versions keep the full ring). rank8 (I = 384): FC1 has 28 K steps per unit, FC2 6 per tile."""
    r8 = mx.compile_key(896, 3584, 384, 64, ring_fit=True)
    assert (r8.KS1, r8.NKB2H, r8.D1, r8.D2) == (28, 6, 7, 6)
    r16 = mx.compile_key(896, 3584, 256, 64, ring_fit=True)
    assert (r16.D1, r16.D2) == (8, 8) and r16.ring_fit
    off = mx.compile_key(896, 3584, 384, 64, ring_fit=False)
    assert not off.ring_fit and (off.D1, off.D2) == (8, 8)
    assert mx.compile_key(896, 3584, 384, 64) == r8                          # the default since session 13
    r7 = mx.compile_key(896, 3584, 256, 1, version=7, ring_fit=True)          # rank16 b1: 14 FC1 steps per unit
    assert r7.version == 7 and r7.ring_fit and (r7.KS1, r7.D1, r7.D2) == (14, 7, 8)
    assert mx.compile_key(896, 3584, 256, 1, version=7) == r7                 # v7's ring_fit default (session 14)
    o7 = mx.compile_key(896, 3584, 256, 1, version=7, ring_fit=False)
    assert o7.version == 7 and not o7.ring_fit and (o7.D1, o7.D2) == (8, 8)
    assert not mx.compile_key(896, 3584, 384, 1, version=6, ring_fit=True).ring_fit   # v6 keeps its full ring
    v3 = mx.KernelCfg(E=896, dL=3584, I=384, MB=8, C=2, version=3, ring_fit=True)
    assert (v3.D1, v3.D2) == (v3.D, v3.D)                                      # other versions: the full ring
    k = mx.KernelCfg(E=896, dL=3584, I=384, MB=8, C=2, W=16, version=4, layout="rot", ring_fit=True)
    for K in range(1, 60):
        d = k._fit(K)
        assert 1 <= d <= k.D and (K % d == 0 or d % K == 0)
        assert all(K % e and e % K for e in range(d + 1, k.D + 1))


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("M", [8, 64])
def test_ring_fit_cuts_the_index_work(M):
    """What ring_fit is for: at rank8 the weight loops' PTX instructions per MMA drop by over a fifth (the per-step
    divisions by 28 and 6 are gone); at rank16, where 8 already divides, the PTX is the default's."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx, loop_opcodes

    def per_mma(key):
        ptx = compiled_ptx(lambda: mx._compile(key, options="--enable-tvm-ffi --keep-ptx"))
        # the two innermost loops with MMAs: FC1's and FC2's ring loops (the enclosing pass loops hold them both)
        loops = sorted((o for o in loop_opcodes(ptx, min_loads=4).values() if o.get("mma", 0)),
                       key=lambda o: sum(o.values()))[:2]
        return ptx, [sum(o.values()) / o["mma"] for o in loops]

    # (v5's loops alone: at bucket 8 the default v5.2 also carries v7's, whose ring_fit is tested below)
    base = mx.compile_key(896, 3584, 384, M, ring_fit=False, alt_parts=0)
    _, old = per_mma(base)
    _, new = per_mma(dataclasses.replace(base, ring_fit=True))
    for o, n in zip(old, new):
        assert n < 0.8 * o, (old, new)
    b16 = mx.compile_key(896, 3584, 256, M, ring_fit=False, alt_parts=0)
    assert per_mma(b16)[0] == per_mma(dataclasses.replace(b16, ring_fit=True))[0]


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
def test_ring_fit_at_v7_cuts_the_index_work():
    """ring_fit at v7 (batch buckets <= 2, opt-in): at rank8 b2 (FC1 14 steps per unit, FC2 3 per tile) the two
    weight loops' PTX instructions per MMA drop by over a fifth; at rank8 b1 (28 and 2) both still drop."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx, loop_opcodes

    def per_mma(key):
        ptx = compiled_ptx(lambda: mx._compile(key, options="--enable-tvm-ffi --keep-ptx"))
        loops = sorted((o for o in loop_opcodes(ptx, min_loads=4).values() if o.get("mma", 0)),
                       key=lambda o: sum(o.values()))[:2]
        return [sum(o.values()) / o["mma"] for o in loops]

    for M, bound in ((2, 0.8), (1, 1.0)):
        on = mx.compile_key(896, 3584, 384, M, version=7, ring_fit=True)
        assert on.version == 7 and on.D1 == 7
        old, new = per_mma(dataclasses.replace(on, ring_fit=False)), per_mma(on)
        assert all(n < bound * o for o, n in zip(old, new)), (M, old, new)


def test_park_probe_cfg():
    """The park probe (KernelCfg.park): v7 only, whole 16 KB chunks, and park_max fills the shared memory the kernel
    leaves without passing the per-CTA limit."""
    import dataclasses
    from k3fast.kernels._dsl import SMEM_PER_CTA_MAX
    for I in (256, 384):
        for M in (1, 2):
            base = mx.compile_key(896, 3584, I, M, version=7)
            big = dataclasses.replace(base, park=mx.park_max(base))
            assert big.park >= 8 * mx.PARK_CHUNK and big.smem_bytes <= SMEM_PER_CTA_MAX
            with pytest.raises(ValueError, match="park="):          # one chunk more does not fit
                dataclasses.replace(base, park=big.park + mx.PARK_CHUNK)
    base = mx.compile_key(896, 3584, 256, 1, version=7)
    with pytest.raises(ValueError, match="park"):
        dataclasses.replace(base, park=1000)
    with pytest.raises(ValueError, match="park"):
        dataclasses.replace(mx.compile_key(896, 3584, 256, 8), park=mx.PARK_CHUNK)


@pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")
@pytest.mark.parametrize("I", [256, 384])
def test_park_probe_ptx(I):
    """The park probe's bulk copies (one per 16 KB chunk) come after every MMA of the kernel (after FC2, before the
    part reduction and the combine), on one mbarrier that the kernel waits on before it exits; park 0 has neither."""
    import dataclasses
    from k3fast.measure.ptxcheck import compiled_ptx
    base = mx.compile_key(896, 3584, I, 1, version=7)
    park = dataclasses.replace(base, park=mx.park_max(base))
    lines = {k: [ln.strip() for ln in compiled_ptx(lambda k=k: mx._compile(k, options="--enable-tvm-ffi --keep-ptx"))
                 .splitlines()] for k in (base, park)}
    for k, ls in lines.items():
        bulk = [i for i, ln in enumerate(ls) if ln.startswith("cp.async.bulk.shared")]
        waits = [i for i, ln in enumerate(ls) if ln.startswith("mbarrier.try_wait")]
        if k.park == 0:
            assert not bulk and not waits
            continue
        assert len(bulk) == k.park // mx.PARK_CHUNK
        assert bulk[0] > max(i for i, ln in enumerate(ls) if ln.startswith("mma.sync"))
        assert waits and min(waits) > max(bulk)


def test_default_keys_keep_their_l1():
    # The L1 each default key leaves beside its shared memory (sm_90 carve-out steps, one CTA per SM). A change that
    # adds shared memory and takes a key one step up fails here, so that its cost is measured on purpose (bench_experts
    # pad<KB>; v5's 4 KB table cost rank8 b64 ~2 %: version log v5.1). Update the table only with that measurement.
    want = {"k3_rank16": {1: 156, 2: 156, 4: 156, 8: 156, 16: 124, 32: 92, 64: 92},
            "k3_rank8": {1: 156, 2: 156, 4: 156, 8: 156, 16: 60, 32: 60, 64: 60},
            "full": {1: 156, 2: 156, 4: 156, 8: 156, 16: 60, 32: 60, 64: 60}}
    for name, cfg in (("k3_rank16", k3_rank(16)), ("k3_rank8", k3_rank(8)), ("full", k3())):
        got = {key.MB: key.l1_kb for key in mx.compile_keys(cfg)}
        assert got == want[name], (name, got)
