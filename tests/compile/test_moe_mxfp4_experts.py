"""CPU tests for k3fast.kernels.moe_mxfp4_experts: the layouts (bit-exact round trips, the decode models), the
compile keys and their bounds, the index math of every kind of work item replayed on the CPU, and sm_90a compiles
of every default key, the contender's (alt_parts=0 at buckets 4 / 8) and the nibble layout's, with checks on their
PTX. Each key compiles once per process (the compile cache); the PTX tests read the PTX of those compiles."""
import dataclasses
from collections import Counter

import pytest
import torch

from k3fast.kernels import moe_mxfp4_experts as mx
from k3fast.kernels._dsl import dsl_available
from k3ref.config import k3, k3_rank

pytestmark = pytest.mark.compile

SHAPES = {"k3_rank16": k3_rank(16), "k3_rank8": k3_rank(8), "full": k3()}
needs_dsl = pytest.mark.skipif(not dsl_available(), reason="cutlass DSL / tvm-ffi not importable")


def _key(cfg, M, **kw):
    return mx.compile_key(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.expert_intermediate, M,
                          situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, **kw)


def _rand_ckpt(E, I, dL, gen, scale_lo=0, scale_hi=255):
    r = lambda *s: torch.randint(0, 256, s, generator=gen, dtype=torch.uint8)
    sc = lambda *s: torch.randint(scale_lo, scale_hi, s, generator=gen, dtype=torch.uint8)
    return (r(E, I, dL // 2), sc(E, I, dL // 32), r(E, I, dL // 2), sc(E, I, dL // 32),
            r(E, dL, I // 2), sc(E, dL, I // 32))


# ----------------------------------------------------------------------------------------------- layouts

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


def test_prepare_in_chunks_equals_expert_by_expert():
    """Experts are re-laid in chunks written into the preallocated result: a chunked call (three chunks here, the
    last one short) gives the same bits as preparing each expert alone."""
    gen = torch.Generator().manual_seed(3)
    E, I, dL = 9, 512, 8192                   # (1 << 24) // (I * dL) = 4 experts per chunk
    ckpt = _rand_ckpt(E, I, dL, gen, 118, 125)
    whole = mx.prepare_mxfp4_experts(*ckpt, layout="nibble")
    for e in range(E):
        one = mx.prepare_mxfp4_experts(*[t[e:e + 1] for t in ckpt], layout="nibble")
        for name in ("w13q", "w13s", "w2q", "w2s"):
            assert torch.equal(getattr(whole, name)[e:e + 1], getattr(one, name)), (name, e)


def _decode_word_like_kernel(word: int):
    """Python model of the kernel's PRMT decode (decode8, nibble layout) -> 8 bf16 bit patterns in output order."""
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


def _a_fragment_coords(lane, s):
    """(row, k) of the 8 values of A-fragment word s of a lane: (g, k..k+1), (g+8, k..k+1), (g, k+2..k+3), ..."""
    g, t = lane // 4, lane % 4
    k = 32 * (s // 2) + 8 * t + 4 * (s % 2)
    return [(g, k), (g, k + 1), (g + 8, k), (g + 8, k + 1), (g, k + 2), (g, k + 3), (g + 8, k + 2), (g + 8, k + 3)]


def _codes_tile(seed):
    codes = torch.randint(0, 16, (1, 1, 16, 64), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)
    return codes, torch.full((1, 1, 16, 2), 127, dtype=torch.uint8)


def test_nibble_decode_model_matches_layout():
    """The register decode (modelled bit by bit) yields the bf16 of the codes the layout stores, in A-fragment order."""
    codes, scales = _codes_tile(1)
    q, _ = mx._pack_tiles(codes, scales)
    mag = torch.tensor(mx.E2M1_MAG)
    for lane in range(32):
        for s in range(4):
            got = _decode_word_like_kernel(int(q[0, 0, 0, lane, s]))
            for bits, (r, kk) in zip(got, _a_fragment_coords(lane, s)):
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
    codes, scales = _codes_tile(4)
    q, _ = mx._pack_tiles(codes, scales, "rot")
    pats = mx.rot_decode_reference(q.to(torch.int64))                     # [1, 1, 1, 32, 4, 4] bf16x2 patterns
    mag = torch.tensor(mx.E2M1_MAG)

    def bf16(bits):
        return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()
    for E in (0, 1, 64, 120, 127, 128):
        mult = (E * 0x00800080 + 0x3F003F00) & 0xFFFFFFFF                   # the kernel's IMAD
        assert mult & 0xFFFF == mult >> 16 and bf16(mult) == 2.0 ** (E - 1)
        for lane in range(32):
            for s in range(4):
                for n, (r, kk) in enumerate(_a_fragment_coords(lane, s)):
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


def test_bad_inputs_rejected_on_cpu():
    gen = torch.Generator().manual_seed(2)
    prep = mx.prepare_mxfp4_experts(*_rand_ckpt(4, 64, 128, gen, 118, 125))
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
    # layouts: auto picks rot for scales <= 128 and nibble above; rot is refused above; the four tensors without
    # their layout, or with another one, are refused before any kernel runs
    assert prep.layout == "rot"
    big = _rand_ckpt(4, 64, 128, torch.Generator().manual_seed(9), 120, 140)
    assert mx.prepare_mxfp4_experts(*big).layout == "nibble"
    with pytest.raises(ValueError, match="rot"):
        mx.prepare_mxfp4_experts(*big, layout="rot")
    with pytest.raises(ValueError, match="layout"):
        mx.prepare_mxfp4_experts(*big, layout="nib")
    with pytest.raises(ValueError, match="layout"):
        mx.moe_mxfp4_experts(z, ids, w, prep.w13q, prep.w13s, prep.w2q, prep.w2s)
    with pytest.raises(ValueError, match="layout"):
        mx.moe_mxfp4_experts(z, ids, w, prep, None, None, None, layout="nibble")
    for bad in (1, 3, -1, True):
        with pytest.raises(ValueError, match="alt_parts"):
            mx.compile_key(896, 3584, 256, 8, alt_parts=bad)
    with pytest.raises(ValueError):
        mx.m_bucket(65)


# ----------------------------------------------------------------------------------------------- keys and bounds

def test_item_kinds_by_bucket():
    """"rows" at bucket 1 where its row blocks split the w2 tiles evenly (rank16, full width), "parts" at rank8 b1
    and at bucket 2, "passes" above, with the alternate "parts" items at buckets 4 / 8 unless alt_parts=0."""
    for name, cfg in SHAPES.items():
        keys = mx.compile_keys(cfg)
        assert [k.MB for k in keys] == list(mx.M_BUCKETS)
        kinds = [(k.items, k.parts, k.alt_parts) for k in keys]
        b1 = ("parts", 3, 0) if name == "k3_rank8" else ("rows", 4, 0)
        assert kinds == [b1, ("parts", 2, 0), ("passes", 1, 2), ("passes", 1, 2)] + [("passes", 1, 0)] * 3, name
        assert mx.compile_keys(cfg, alt_parts=0) == [k if k.MB not in (4, 8) else
                                                     dataclasses.replace(k, alt_parts=0) for k in keys]
        for k in keys:
            assert k.items == mx.item_kind(k.MB, k.I, k.dL)
            assert k.layout == "rot" and k.W == mx.WARPS == 16 and k.C == mx.CLUSTER == 2
            assert k.route_direct == (k.MB == 1)
            assert k.T1 * k.S % k.W == 0 and k.NKB1 % k.S == 0 and k.Q * k.C <= 132
    assert [mx.default_parts(256, mb) for mb in (1, 2)] == [4, 2]
    assert [mx.default_parts(384, mb) for mb in (1, 2)] == [3, 2]
    assert mx.default_parts(3072, 1) == 4


def test_keys_refused_outside_their_bounds():
    base = dict(E=896, dL=3584, I=256)
    for kw, msg in ((dict(MB=2, items="passes"), "passes"),           # buckets <= 2 split each expert
                    (dict(MB=16, items="parts", parts=2), "parts"),    # the part counters stop at bucket 8
                    (dict(MB=2, items="rows", parts=2), "rows"),       # "rows" serves bucket 1
                    (dict(MB=1, I=384, items="rows", parts=3), "rows"),   # 6 row blocks do not split 224 tiles
                    (dict(MB=8, items="passes", parts=2), "parts"),
                    (dict(MB=1, items="parts", parts=3), "parts"),     # 256 / 3 is not a multiple of 64
                    (dict(MB=16, items="passes", alt_parts=2), "alt_parts"),
                    (dict(MB=2, items="parts", parts=2, alt_parts=2), "alt_parts"),
                    (dict(MB=8, items="passes", layout="lut"), "layout"),
                    (dict(MB=8, items="stream"), "items")):
        with pytest.raises(ValueError, match=msg):
            mx.KernelCfg(**{**base, **kw})
    with pytest.raises(ValueError, match="a cluster per part"):             # 3 clusters of 2 for 4 parts
        mx.KernelCfg(E=896, dL=3584, I=256, MB=1, items="rows", parts=4, nsm=6)


def test_ring_depths_fit_the_k_steps():
    """Each loop's ring is the deepest <= 8 that needs no per-step division: rank8 FC1 7 (28 K steps per unit),
    FC2 6; rank16 8 / 8 above bucket 2, FC1 7 at b1 (14 steps)."""
    r8 = mx.compile_key(896, 3584, 384, 64)
    assert (r8.KS1, r8.NKB2H, r8.D1, r8.D2) == (28, 6, 7, 6)
    r16 = mx.compile_key(896, 3584, 256, 64)
    assert (r16.D1, r16.D2) == (8, 8)
    b1 = mx.compile_key(896, 3584, 256, 1)
    assert (b1.KS1, b1.D1, b1.D2) == (14, 7, 8)
    for K in range(1, 60):
        d = r8._fit(K)
        assert 1 <= d <= r8.D and (K % d == 0 or d % K == 0)
        assert all(K % e and e % K for e in range(d + 1, r8.D + 1))


def test_counters_and_workspace_views_fit():
    """Every key's counters sit inside the workspace's MAX_M * 8, and its y views inside workspace.y: the combine's
    (token * RB + row block) below the part reduction's, those below the end; hG + y_e rows ("rows") and the fp32
    parts + bf16 y_e rows ("parts", also as a "passes" key's alternate items) inside MAX_M x 16 x dL bf16."""
    assert mx.PART_COUNTERS >= mx.MAX_M * mx.CLUSTER
    for cfg in SHAPES.values():
        for key in mx.compile_keys(cfg):
            dL, I = key.dL, key.I
            assert key.MB * key.RB <= mx.PART_COUNTERS
            split = key.alt or key
            if split.items == "parts":
                assert mx.PART_COUNTERS + split.PMAX * split.C <= mx.MAX_M * 8
                assert 2 * split.NH * key.MB * 16 + key.MB * 16 <= mx.MAX_M * 16
            if key.items == "rows":
                assert mx.H_COUNTERS + key.PMAX <= mx.MAX_M * 8                 # one per segment (<= pairs)
                assert key.PMAX * I + key.MB * 16 * dL <= mx.MAX_M * 16 * dL
    ws = mx.make_workspace(3584, "cpu")
    for M in (1, 2, 3, 8, 64):
        for I in (256, 384, 3072):
            key = mx.compile_key(896, 3584, I, M)
            y, yb = mx._y_views(key, ws, M)
            assert yb.shape == (M * 16, 3584) or yb.data_ptr() == ws.y.data_ptr()
            assert y.untyped_storage().data_ptr() == ws.y.untyped_storage().data_ptr()


def test_smem_fits_and_the_l1_each_key_keeps():
    """The L1 each key leaves beside its shared memory (sm_90 carve-out steps, one CTA per SM). A change that adds
    shared memory and takes a key one step up fails here, so that its cost is measured on purpose (at 28 KB of L1
    rank8 b64 lost 1.2-1.9 %). The contender's keys keep the same step as the default's at buckets 4 / 8."""
    from k3fast.kernels._dsl import SMEM_PER_CTA_MAX
    want = {"k3_rank16": {1: 156, 2: 156, 4: 156, 8: 156, 16: 124, 32: 92, 64: 92},
            "k3_rank8": {1: 156, 2: 156, 4: 156, 8: 156, 16: 60, 32: 60, 64: 60},
            "full": {1: 156, 2: 156, 4: 156, 8: 156, 16: 60, 32: 60, 64: 60}}
    for name, cfg in SHAPES.items():
        keys = mx.compile_keys(cfg)
        assert {key.MB: key.l1_kb for key in keys} == want[name], name
        for key in keys + mx.compile_keys(cfg, (4, 8), alt_parts=0):
            assert key.smem_bytes <= SMEM_PER_CTA_MAX
            assert key.ZW * 4 >= key.dL * 2 and key.ZW % 32 == 16          # staged z rows fit the h region
        for MB in (4, 8):
            assert _key(cfg, MB, alt_parts=0).l1_kb == want[name][MB]
    # rank8 b64 sits 80 B under the 196 KB step; the 4 KB table the packed pass offsets replace would not
    k8 = mx.compile_key(896, 3584, 384, 64)
    assert k8.smem_bytes == 195600 and mx.l1_kb(k8.smem_bytes + 4 * (k8.PMAX + 4)) == 28


def test_l1_left_by_the_carveout():
    # sm_90's carve-out steps (KB) with 1 KB reserved per CTA: the smallest step that holds the CTA's bytes + 1 KB
    from k3fast.kernels._dsl import carveout_kb
    assert carveout_kb(0) == 8 and mx.l1_kb(0) == 248
    assert carveout_kb(195 * 1024) == 196 and mx.l1_kb(195 * 1024) == 60
    assert carveout_kb(195 * 1024 + 1) == 228 and mx.l1_kb(195 * 1024 + 1) == 28
    assert carveout_kb(131 * 1024) == 132 and carveout_kb(131 * 1024 + 16) == 164
    with pytest.raises(ValueError, match="227"):
        carveout_kb(227 * 1024 + 16)


# ----------------------------------------------------------------------------------------------- index math

def _kernel_sort_model(flat_ids, E, warp_order, threads=512):
    """Python model of the kernel's routing sort: smem-atomic placement in a CTA-specific warp order, then the
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
    """The pair order inside an expert must not depend on warp arrival order, which differs between the CTAs of a
    cluster (they exchange h by column position): the sort's order equals a stable sort by expert."""
    gen = torch.Generator().manual_seed(3)
    for M in (3, 8, 64):
        base = torch.randperm(64, generator=gen)[:16]
        ids = torch.stack([base[torch.randperm(16, generator=gen)] for _ in range(M)]).reshape(-1).tolist()
        want = sorted(range(len(ids)), key=lambda p: (ids[p], p))
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            order = lambda it: torch.randperm(16, generator=g).tolist()
            assert _kernel_sort_model(ids, 64, order) == want


def _emulate_pass_items(ids, NT):
    """The prologue's bookkeeping of "passes" keys in numpy int32 (block scan of packed counts; each active expert's
    first pass packed into act_e's high half, the totals into scr[32]; the 11-step binary search of each work item):
    returns the (expert, first pair of the pass, pairs of the expert) of every item, in item order, the expert counts
    and the routing tables act_e / act_off (the alternate "parts" items read them)."""
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


@pytest.mark.parametrize("M", [3, 8, 16, 64])
@pytest.mark.parametrize("kind", ["uniform", "shared", "skewed", "one-expert"])
def test_pass_items_cover_every_pass_once(M, kind):
    """"passes" keys hand out single passes (expert, <= NT pairs) as work items. The index math, replayed on CPU
    for routings from all-distinct to one expert in every slot: every pass of every active expert is one item, in
    order."""
    ids = _routing_np(M, kind)
    NT = mx.compile_key(896, 3584, 256, M).NT
    items, cnt, _, _ = _emulate_pass_items(ids, NT)
    want = [(e, pb, int(cnt[e])) for e in range(896) if cnt[e] for pb in range(0, int(cnt[e]), NT)]
    assert items == want


@pytest.mark.parametrize("M", [3, 8])
@pytest.mark.parametrize("kind", ["uniform", "shared", "skewed", "one-expert"])
def test_alternate_items_branch_and_cover(M, kind):
    """At buckets 4 / 8 a "passes" key routes as "passes", then runs its alternate "parts" items when
    alt_parts x #passes <= Q. Replayed on the CPU: the branch each routing takes (few hot experts: the parts;
    uniform: the passes), and that the parts items read from the passes' tables (act_e masked to its low half,
    act_off) are every active expert in order, each in alt_parts parts, over its own pair segment."""
    import numpy as np
    key = mx.compile_key(896, 3584, 256, M)
    assert key.items == "passes" and key.alt_parts == mx.ALT_PARTS == 2 and key.alt.NH == 2
    ids = _routing_np(M, kind)
    items, cnt, act_e, act_off = _emulate_pass_items(ids, key.NT)
    few = key.alt_parts * len(items) <= key.Q
    assert few == (kind != "uniform"), (kind, len(items), key.Q)
    if few:
        parts = [(act_e[wi // 2] & 0xFFFF, wi % 2, act_off[wi // 2], act_off[wi // 2 + 1] - act_off[wi // 2])
                 for wi in range(key.alt.NH * len(act_e))]
        active = [e for e in range(896) if cnt[e]]
        seg = np.concatenate([[0], np.cumsum([cnt[e] for e in active])])
        assert parts == [(e, h, int(seg[u]), int(cnt[e])) for u, e in enumerate(active) for h in range(2)]


def test_alternate_items_keys():
    """One grid for both item loops (the parts' Q, >= the passes'), the shared-memory regions the larger of the
    two, and the parts items' own tiling (2 parts of I on clusters of 2)."""
    for cfg in SHAPES.values():
        for key in mx.compile_keys(cfg, (4, 8)):
            a, alone = key.alt, dataclasses.replace(key, alt_parts=0)
            assert a.items == "parts" and a.NH == 2 and a.alt_parts == 0 and a.MB == key.MB
            assert alone == _key(cfg, key.MB, alt_parts=0) and alone.alt is None
            assert key.Q == a.Q >= alone.Q
            assert key.regions == tuple(max(x, y) for x, y in zip(alone.regions, a.regions))


def _cta_rows(c, t1_base, t2_base, koff):
    """The 16-byte w13 and w2 rows one CTA's warps read (Counters), replayed from the kernel's FC1 / FC2 row
    arithmetic: FC1 units warp + W i of S K parts; FC2 tiles warp + W i below T2, NKB2H K steps from koff."""
    fc1, fc2 = Counter(), Counter()
    for warp in range(c.W):
        for s in range(c.U1 * c.KS1):
            i = s // c.KS1
            uu = warp + c.W * i
            fc1[(t1_base + uu // c.S) * c.NKB1 + (uu % c.S) * c.KS1 + (s - i * c.KS1)] += 1
        for s in range(c.U2 * c.NKB2H):
            i = s // c.NKB2H
            if warp + c.W * i < c.T2:
                fc2[(t2_base + warp + c.W * i) * c.NKB2 + koff + (s - i * c.NKB2H)] += 1
    return fc1, fc2


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_item_reads_each_weight_row_once(shape):
    """Replayed on the CPU over every part, CTA rank, warp and step, the FC1 and FC2 row arithmetic of each key's
    items reads each 16-byte w13 and w2 row of an expert exactly once (FC2 steps of clamped tiles past T2 are
    re-reads that are never stored), and "rows" items publish each h column of a pair exactly once."""
    cfg = SHAPES[shape]
    I, dL = cfg.expert_intermediate, cfg.routed_expert_hidden_size
    keys = mx.compile_keys(cfg)
    for c in keys + [k.alt for k in keys if k.alt]:
        fc1, fc2, hcol = Counter(), Counter(), Counter()
        for hI in range(c.NH):
            for rank in range(c.C):
                rbi = hI * c.C + rank if c.items == "rows" else rank
                koff = hI * c.NKB2H if c.items == "parts" else 0
                a, b = _cta_rows(c, hI * (c.IH // 8) + rank * c.T1, rbi * c.T2, koff)
                fc1 += a
                fc2 += b
                for ch in range(c.T1):
                    for x in range(4):
                        hcol[hI * (c.IH // 2) + rank * (c.IH // c.C // 2) + ch * 4 + x] += 1
        assert fc1 == Counter(range(I // 8 * c.NKB1)), c
        assert fc2 == Counter(range(dL // 16 * c.NKB2)), c
        assert hcol == Counter(range(I // 2)), c
        assert c.C * c.T1 * c.NH == I // 8


# ----------------------------------------------------------------------------------------------- compiles and PTX

@pytest.fixture(scope="module", autouse=True)
def _keep_ptx(tmp_path_factory):
    """The compiles of this module keep their PTX (read by the tests below), written to a scratch directory."""
    if not dsl_available():
        yield
        return
    from k3fast.kernels._dsl import import_cute
    import_cute()
    from cutlass.cutlass_dsl import CuTeDSL
    env = CuTeDSL._get_dsl().envar
    old = env.keep_ptx, env.dump_dir
    env.keep_ptx, env.dump_dir = True, str(tmp_path_factory.mktemp("ptx"))
    yield
    env.keep_ptx, env.dump_dir = old


def _ptx(key) -> str:
    """The PTX of a compiled key: kept by the compile cache's compile, or (when another test module compiled the key
    first, without it) compiled again with --keep-ptx."""
    ptx = mx.get_kernel(key).artifacts.PTX
    if not ptx or "\n" not in ptx:              # a path: the text was not kept
        from k3fast.measure.ptxcheck import compiled_ptx
        ptx = compiled_ptx(lambda: mx._compile(key, options="--enable-tvm-ffi --keep-ptx"))
    return ptx


@needs_dsl
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compile_every_key(shape):
    """Every default key (buckets 1..64), the contender's at buckets 4 / 8 (alt_parts=0) and, at rank16, the nibble
    layout's at one bucket of each item kind compile for sm_90a; the PTX shows each kind's synchronisation:
    "rows" items spin on a counter and use no cluster barrier or DSMEM store, "parts" / "passes" items exchange h
    through DSMEM between two cluster barriers; bucket 1 has no counting sort (no shared-memory atomics), the
    other buckets have; a key with alternate items carries the part reduction's fence and atomics beside the passes'."""
    cfg = SHAPES[shape]
    keys = mx.compile_keys(cfg) + mx.compile_keys(cfg, (4, 8), alt_parts=0)
    if shape == "k3_rank16":
        keys += mx.compile_keys(cfg, (1, 2, 8, 64), layout="nibble")
    ptx = {key: _ptx(key) for key in keys}
    for key, p in ptx.items():
        assert ".entry" in p and "mma.sync.aligned.m16n8k16" in p, key
        assert ("atom.shared" in p) == (key.MB > 1), key
        if key.items == "rows":
            assert "barrier.cluster" not in p and "st.shared::cluster" not in p
            assert p.count("ld.acquire.gpu") >= 1 and "atom.global.release.add" in p
        else:
            assert p.count("barrier.cluster.arrive") >= 2 and "st.shared::cluster" in p and "ld.acquire" not in p
        fences = 2 if key.items == "parts" else 3 if key.alt_parts else 1
        assert p.count("fence.acq_rel.gpu") == fences, (key, p.count("fence.acq_rel.gpu"))
    for MB in (4, 8):
        both, alone = (ptx[_key(cfg, MB, alt_parts=a)] for a in (None, 0))
        assert both.count("atom.global") > alone.count("atom.global")


@needs_dsl
@pytest.mark.parametrize("M", [1, 64])
def test_ring_carries_no_copies_of_inflight_loads(M):
    """The weight ring consumes a slot before refilling it, so the loops carry no register copies of loads in
    flight (a copy waits for its load: one loaded-HBM round trip per ring turn). Checked on the PTX of the main loops
    (>= 8 global loads) of rank16's default keys."""
    from k3fast.measure.ptxcheck import loop_copies_of_loads
    stats = [s for s in loop_copies_of_loads(_ptx(_key(k3_rank(16), M))) if s.global_loads >= 8]
    assert stats and all(s.copies_of_loads == 0 for s in stats), stats


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


@needs_dsl
@pytest.mark.parametrize("M", [8, 64])
def test_rot_layout_shortens_the_main_loops(M):
    """The point of the rot layout: fewer instructions per weight step in the FC1 / FC2 loops than the nibble
    layout's PRMT-table decode + fp32 scale FMAs (PTX; both do the same MMAs)."""
    from k3fast.measure.ptxcheck import loop_opcodes
    per_layout = {}
    for layout in ("nibble", "rot"):
        loops = loop_opcodes(_ptx(_key(k3_rank(16), M, layout=layout)))
        per_layout[layout] = (sum(sum(ops.values()) for ops in loops.values()),
                              sum(ops.get("mma", 0) for ops in loops.values()))
    (n_nib, mma_nib), (n_rot, mma_rot) = per_layout["nibble"], per_layout["rot"]
    assert mma_nib == mma_rot > 0, per_layout
    assert n_rot <= 0.8 * n_nib, per_layout
