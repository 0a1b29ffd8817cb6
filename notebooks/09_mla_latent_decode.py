# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 — Gated MLA's decode attention: absorb, split, combine
#
# **Reference ops replaced** (`docs/k3-layer.md` section 8): in `k3ref.mla`, the query's W_UK absorption, the
# attention over the latent cache (`mla_core`, absorbed form), the cache append with kv_a's RMSNorm, W_UV and the
# sigmoid output gate.
#
# **The tricks.**
# 1. *Absorption, twice.* The cache keeps one 576-wide latent row per token for all heads. Moving W_UK into the
#    query turns attention into a dot product with those rows; here the absorption goes one step further, into
#    the weights: `W_Q = [W_UK^T q_b,nope | q_b,pe]`, so one GEMV gives the 576-wide query from RMSNorm(q_a).
# 2. *Heads are the narrow side.* A decode step has 6 heads per TP16 rank and thousands of cached tokens, so the
#    kernel puts the tokens of a 64-row page on the MMA's M side and the heads on its N side (8 per tile).
# 3. *Split the tokens, combine exactly.* One request's cache is cut into runs of pages read by different SMs
#    at once; each split keeps a running max and sum (online softmax), and the last one to finish combines them.
#
# Status: the kernels (`mla_latent_decode`, `mla_uv_gate`) and the chain (`k3fast.layer.FusedMLA`, the `fast-mla`
# contender) pass their GPU tests against k3ref (section 4). Measured beside vLLM's own MLA layer (sections 5 and 6),
# the fused half wins at 1K cached tokens and, with one wave of CTAs (v2.4), ties at 8K and loses at 32K, so the shipped plan keeps vLLM's
# attention half in MLA layers (`DecodePlan.mla_attention = "stock"`) and fuses their MoE half.

# %%
import math
import os

import matplotlib.pyplot as plt
import torch

from k3ref import Precision, preset, random_layer, tiny
from k3ref.bytes import floor_us
from k3ref.compare import rel_rmse
from k3ref.mla import _split_kv_b, mla_absorbed, mla_latents, mla_naive

from k3fast.kernels import mla_latent_decode as mk
from k3fast.measure import nbtools

# %% [markdown]
# ## 1. The reference ops, and the absorbed forms (tiny config, fp64)
#
# `mla_naive` expands each cached latent row back to per-head keys and values with kv_b_proj; `mla_absorbed`
# moves W_UK into the query and W_UV after the attention. In exact arithmetic they are the same function. So is
# the query built from `W_Q` in one product, which is what the fused chain computes.

# %%
cfg, P = tiny(), Precision.exact()
w = random_layer(cfg, 3, seed=0).attn
N, L = 2, 37
g = torch.Generator().manual_seed(0)
x = torch.randn(N, cfg.hidden_size, dtype=torch.float64, generator=g)
q, row, _ = mla_latents(x, w, cfg, P)
cache = torch.randn(N, L, cfg.kv_cache_dim, dtype=torch.float64, generator=g)
cache[:, -1] = row                                                     # the step's own row is the last one
q_pos = torch.full((N, 1), L - 1)
o_naive = mla_naive(q.unsqueeze(1), cache, q_pos, w, cfg, P)
o_abs = mla_absorbed(q.unsqueeze(1), cache, q_pos, w, cfg, P)
naive_vs_absorbed = rel_rmse(o_abs, o_naive)

# W_Q: the absorption moved into the weights
H, dn = cfg.mla_heads, cfg.qk_nope_head_dim
W_UK, _ = _split_kv_b(w, cfg)
qb = w.q_b_proj.double().view(H, cfg.qk_head_dim, cfg.q_lora_rank)
W_Q = torch.cat([torch.einsum("hdc,hdk->hck", W_UK.double(), qb[:, :dn]), qb[:, dn:]], dim=1)
c_q = torch.nn.functional.rms_norm((x @ w.q_a_proj.double().T), (cfg.q_lora_rank,), w.q_a_layernorm.double(),
                                   cfg.rms_norm_eps)
Q_direct = torch.einsum("hck,nk->nhc", W_Q, c_q)
Q_two_step = torch.cat([torch.einsum("nhd,hdc->nhc", q[..., :dn], W_UK.double()), q[..., dn:]], dim=-1)
wq_vs_two_step = rel_rmse(Q_direct, Q_two_step)
print(f"naive vs absorbed: {naive_vs_absorbed:.1e}   W_Q query vs two-step query: {wq_vs_two_step:.1e}")
assert naive_vs_absorbed < 1e-10 and wq_vs_two_step < 1e-10

# %% [markdown]
# In bf16 the one-step query differs from the exact one by the rounding of `W_Q` itself (each weight rounded once),
# where k3ref rounds q and then q_lat. At the TP16 shape, on random weights and inputs:

# %%
cfg16 = preset("k3_rank16")
w16 = random_layer(cfg16, 3, seed=0).attn
H16, dn16 = cfg16.mla_heads, cfg16.qk_nope_head_dim
W_UK16, _ = _split_kv_b(w16, cfg16)
qb16 = w16.q_b_proj.view(H16, cfg16.qk_head_dim, cfg16.q_lora_rank).double()
W_Q16 = torch.cat([torch.einsum("hdc,hdk->hck", W_UK16.double(), qb16[:, :dn16]), qb16[:, dn16:]], dim=1)
c16 = torch.randn(4, cfg16.q_lora_rank, dtype=torch.float64, generator=g)
Q_exact = torch.einsum("hck,nk->nhc", W_Q16, c16)
Q_wq_bf16 = torch.einsum("hck,nk->nhc", W_Q16.bfloat16().double(), c16)
q_two = torch.einsum("hdk,nk->nhd", qb16, c16).bfloat16().double()                 # k3ref: q rounded ...
Q_two_bf16 = torch.cat([torch.einsum("nhd,hdc->nhc", q_two[..., :dn16], W_UK16.double()).bfloat16().double(),
                        q_two[..., dn16:]], dim=-1)                                  # ... then q_lat rounded
print(f"bf16 W_Q: {rel_rmse(Q_wq_bf16, Q_exact):.1e}   k3ref's two roundings: {rel_rmse(Q_two_bf16, Q_exact):.1e}")

# %% [markdown]
# The same order of error, inside the tolerance table's `bf16_kernel`.
#
# ## 2. Bytes and floor over the context length
#
# The attention core reads each request's cache rows once (576 bf16 per token); at short contexts the layer's
# weights dominate, at long ones the cache does. The floors at the copy bandwidth of the recorded H100 sweep:

# %%
bw = min(r["copy_tbps"] for r in nbtools.sweep("H100"))
ctxs = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
fig, ax = plt.subplots(figsize=(8, 4.5))
for batch, color in ((1, "C0"), (8, "C1"), (64, "C2")):
    core = [batch * (c * mk.DQK * 2 + 6 * (mk.DQK + mk.DV) * 2) for c in ctxs]
    ax.plot(ctxs, [floor_us(b, bw) for b in core], color=color, marker="o", label=f"attention core, batch {batch}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("cached tokens per request")
ax.set_ylabel(f"floor µs at {bw:.2f} TB/s")
ax.set_title("k3_rank16: the MLA attention core's byte floor over the context length")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Split, online softmax, combine: the kernel's arithmetic, on the CPU
#
# The function below follows the kernel step for step: pages of 64 rows; a split takes a run of pages; inside
# it, each page's scores in base 2 (`scale · log2 e` folded in), a running max `m` and sum `l` per head, the
# accumulator rescaled by `2^(m_old − m_new)`; probabilities rounded to bf16 before P·V (the MMA's operand); then
# the combine `Σ 2^(m_s − M) O_s / Σ 2^(m_s − M) l_s` over the splits. It must give softmax attention.

# %%
def split_kv_attention(Q, rows, scale, pages_per_split):
    """Q [H, 576], rows [L, 576] (fp32) -> o [H, 512], as mla_latent_decode computes it."""
    L = rows.shape[0]
    pages = math.ceil(L / mk.PAGE)
    parts = []
    for p0 in range(0, pages, pages_per_split):
        m = torch.full((Q.shape[0],), float("-inf"))
        l = torch.zeros(Q.shape[0])
        O = torch.zeros(Q.shape[0], mk.DV)
        for p in range(p0, min(p0 + pages_per_split, pages)):
            page = rows[p * mk.PAGE:(p + 1) * mk.PAGE]
            s = (Q @ page.T) * scale * math.log2(math.e)                 # [H, <=64], base-2 logits
            m_new = torch.maximum(m, s.max(dim=1).values)
            alpha = torch.exp2(m - m_new)
            pr = torch.exp2(s - m_new[:, None]).bfloat16().float()       # P is a bf16 MMA operand
            l = l * alpha + torch.exp2(s - m_new[:, None]).sum(dim=1)     # sums of the fp32 probabilities
            O = O * alpha[:, None] + pr @ page[:, :mk.DV]
            m = m_new
        parts.append((m, l, O))
    M = torch.stack([m for m, _, _ in parts]).max(dim=0).values
    num = sum(torch.exp2(m - M)[:, None] * O for m, _, O in parts)
    den = sum(torch.exp2(m - M) * l for m, l, _ in parts)
    return num / den[:, None]


g = torch.Generator().manual_seed(1)
H6, L6 = 6, 1000
Q6 = torch.randn(H6, mk.DQK, generator=g) * 2
rows6 = torch.randn(L6, mk.DQK, generator=g)
scale = 192 ** -0.5
want = torch.softmax((Q6 @ rows6.T) * scale, dim=-1) @ rows6[:, :mk.DV]
for pps in (1, 3, 16):
    got = split_kv_attention(Q6, rows6, scale, pps)
    print(f"{math.ceil(math.ceil(L6 / mk.PAGE) / pps):2d} splits: rel. error vs softmax attention "
          f"{rel_rmse(got, want):.1e}")
    assert rel_rmse(got, want) < 1e-2

# %% [markdown]
# The only approximation is the bf16 rounding of the probabilities (2⁻⁹ relative each), which averages out
# over the tokens; the split count does not change the result beyond fp32 summation order.
#
# How many splits the kernel takes is a trade. Each split reads its share of the cache (more splits: more SMs
# reading at once); the CTA that arrives last then reads every split's partial O (hn × 512 fp32 per split) alone,
# on one SM. `plan_splits` takes the smaller of two counts: one wave (at most one CTA per SM over all requests and
# head groups: the kernel's 166 KB of shared memory holds one CTA per SM, so a 133rd CTA waits for a second wave),
# and the combine's cap, √(36 · pages / hn) splits, where the two byte counts meet. What one CTA reads per request
# and head group at batch 1 and 6 heads (8 query rows per CTA), with the cap and with one wave alone:

# %%
fig, ax = plt.subplots(figsize=(8, 4.5))
pages_axis = [16, 32, 64, 128, 256, 512, 1024, 2048]
for label, color, plan in (("one wave alone", "C0", lambda p: (min(p, 132), -(-p // min(p, 132)))),
                           ("with the combine's cap (shipped)", "C1", lambda p: mk.plan_splits(1, 6, p))):
    split_kb, combine_kb = [], []
    for maxp in pages_axis:
        s, pps = plan(maxp)
        split_kb.append(pps * mk.PAGE * mk.DQK * 2 / 1024)                 # one split's cache rows
        combine_kb.append(s * mk.head_group(6) * mk.DV * 4 / 1024)         # the combining CTA's partials
    ax.plot([p * 64 for p in pages_axis], split_kb, color=color, marker="o", label=f"{label}: one split's cache KB")
    ax.plot([p * 64 for p in pages_axis], combine_kb, color=color, marker="s", linestyle="--",
            label=f"{label}: the combine's partials KB")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("cached tokens per request (the block table's capacity)")
ax.set_ylabel("KB read by one CTA")
ax.set_title("split-KV at batch 1, 6 heads: what one split and the combining CTA read")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for n_req, heads, maxp in ((1, 6, 128), (8, 6, 128), (8, 6, 512), (64, 6, 512), (8, 96, 128)):
    s, pps = mk.plan_splits(n_req, heads, maxp)
    hg = -(-heads // mk.head_group(heads))
    print(f"{n_req:3d} requests x {heads:2d} heads, {maxp:4d} pages: {s:3d} splits of {pps:3d} pages, "
          f"{n_req * hg * s:4d} CTAs")

# %% [markdown]
# ## 4. The chain, and its tests on the GPU
#
# `k3fast.layer.FusedMLA` runs the MLA attention half in five launches: the packed [q_a | kv_a | g] projection
# with AttnRes #1 and the input RMSNorm; RMSNorm(q_a) + W_Q, reading q_a in place inside the projection output;
# the attention (which also writes the step's own cache row); W_UV + the gate; o_proj with AttnRes #2. The paging
# metadata (block table, lengths) belongs to the step, not the layer: a serving engine builds it once for all MLA
# layers, and so does the trace (`k3fast.layer_io.mla_step`).
#
# On an H100 the GPU tier (`traces/index.json`, key `gpu_tier_h100`) ran every case of the decode kernel against an
# fp32 attention over the same pages (6, 12, 16 and 96 heads; padded, page-edge and long requests; the fused
# append; graph replays with new lengths and pages) and the whole FusedMLA half against k3ref at rank16 / rank8.
# Its two full-width cases ran out of memory beside the other test worker; they passed on an H200 in a re-run of
# the tier's failed cases (key `gpu_rerun_h200`):

# %%
import xml.etree.ElementTree as ET


files = {}


def outcomes(key):
    root = ET.parse(os.path.join(nbtools.ROOT, nbtools.INDEX[key])).getroot()
    cases, why = {}, {}
    for case in root.iter("testcase"):
        name, where = case.get("name") or "", case.get("classname") or ""
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        cases[name] = "skipped" if case.find("skipped") is not None else "failed" if bad is not None else "passed"
        files[name] = where
        if bad is not None:
            why[name] = (bad.get("message") or "").splitlines()[0][:90]
    return cases, why


tier, why = outcomes("gpu_tier_h100")
rerun, _ = outcomes("gpu_rerun_h200")
mla = {n: o for n, o in tier.items() if "mla" in n or "mla" in files[n]}
print("MLA cases in the H100 tier:", {o: sum(v == o for v in mla.values()) for o in ("passed", "failed", "skipped")})
for name, msg in why.items():
    print(f"  failed there: {name}: {msg}  -> re-run on the H200: {rerun.get(name, 'not re-run')}")
# what failed there is the machine, not the arithmetic: out of GPU memory beside the other test worker, or no vLLM;
# every one of those cases passed when re-run alone with vLLM staged
assert sum(v == "passed" for v in mla.values()) >= 60
assert all("OutOfMemoryError" in m or "No module named 'vllm'" in m for m in why.values())
assert all(rerun.get(name) == "passed" for name in why)

# %% [markdown]
# ## 5. Measured: the fused half beside vLLM's own MLA layer
#
# `python -m k3fast.measure.trace --preset mla-fused` on an H200 (key `mla_fused`): the stock path is vLLM 0.33's
# own MLA layer on Hopper (FlashAttention-3's split-KV MLA decode, `FLASH_ATTN_MLA`), at 1K / 8K / 32K cached
# tokens per request, rank16 and rank8, in one run. That run (kernel v2.3) had two split rules, `fast-mla`
# ("sm": a CTA per SM, rounded up) and `fast-mla-bal` (with the combine's cap); the plan now ships the cap and one
# wave (section 3), which that run did not measure.

# %%
from k3fast.measure.report import load_records

recs = [r for r in load_records(os.path.join(nbtools.ROOT, nbtools.INDEX["mla_fused"])) if r["layer_kind"] == "mla_moe"]
cell = {(r["shape"], r["batch"], r["context"], r["impl"], r["part"]): r for r in recs}
print(f"{recs[0]['gpu']}, commit {recs[0]['commit']}, copy {recs[0]['copy_tbps']:.2f} TB/s")
print("attention half, k3_rank16: µs (kernels)        floor   stock      fused best   stock/fused  fused/floor")
for batch in (1, 8, 64):
    for ctx in (1024, 8192, 32768):
        st = cell[("k3_rank16", batch, ctx, "stock", "attn")]
        fu = min((cell[("k3_rank16", batch, ctx, i, "attn")] for i in ("fast-mla", "fast-mla-bal")),
                 key=lambda r: r["replay_us_median"])
        print(f"  batch {batch:2d}, {ctx // 1024:2d}K tokens              {st['floor_us']:7.1f} {st['replay_us_median']:7.1f} "
              f"({st['kernels']:.0f}) {fu['replay_us_median']:7.1f} ({fu['kernels']:.0f})  "
              f"{st['replay_us_median'] / fu['replay_us_median']:6.2f}x  {fu['replay_us_median'] / st['floor_us']:6.1f}x")

fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
for ax, part, title in ((axes[0], "attn", "attention half"), (axes[1], "layer", "whole MLA+MoE layer")):
    for impl, color in (("stock", "C3"), ("fast", "C2"), ("fast-mla", "C0"), ("fast-mla-bal", "C1")):
        if part == "attn" and impl == "fast":
            continue                                        # its attention half is stock's
        for batch, marker in ((1, "o"), (8, "s"), (64, "^")):
            pts = sorted((c, cell[("k3_rank16", batch, c, impl, part)]["replay_us_median"]) for c in (1024, 8192, 32768))
            ax.plot(*zip(*pts), color=color, marker=marker, label=f"{impl} b{batch}")
    for batch in (1, 8, 64):
        pts = sorted((c, cell[("k3_rank16", batch, c, "stock", part)]["floor_us"]) for c in (1024, 8192, 32768))
        ax.plot(*zip(*pts), color="gray", linestyle=":", label=f"floor b{batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens per request")
    ax.set_ylabel("µs per step (graph replay, L2 flushed)")
    ax.set_title(f"k3_rank16, {title} ({recs[0]['gpu']})")
axes[1].legend(fontsize=7, ncol=2)
plt.tight_layout()
plt.show()

# the shape of the result, as recorded: the fused half ahead at 1K tokens, behind from 8K on; at 32K tokens and
# batch 64 vLLM's FA3 decode already runs within 1.1x of the byte floor, so no kernel can gain much there
b1k = cell[("k3_rank16", 1, 1024, "fast-mla-bal", "attn")]["replay_us_median"]
assert b1k < cell[("k3_rank16", 1, 1024, "stock", "attn")]["replay_us_median"]
st32 = cell[("k3_rank16", 64, 32768, "stock", "attn")]
assert st32["replay_us_median"] < 1.1 * st32["floor_us"]
assert cell[("k3_rank16", 64, 32768, "fast-mla", "attn")]["replay_us_median"] > st32["replay_us_median"]

# %% [markdown]
# What the numbers say, against the targets (H200, ratios from this one run):
#
# | target | measured | |
# |---|---|---|
# | attention half at rank16 b1 8K: ≥ 2.0x stock, ≤ 4 launches, ≤ 1.5x its floor | 1.01x, 5 launches, 4.6x | missed |
# | attention core at 32K, batch ≥ 8: ≥ 80 % of the copy bandwidth | the whole half at 46 % (b64), 35 % (b8) | missed |
# | whole MLA+MoE layer at rank16 b1 8K: ≥ 1.8x stock | 1.33x (fused half), 1.32x (`fast`: vLLM's half, fused MoE) | missed |
# | whole layer at rank16 b64 8K: ≥ 1.3x stock | 1.12x (`fast`) | missed |
#
# Why. (1) *Waves*: the kernel holds one CTA per SM, and v2.3 rounded the split count up: 136 CTAs at batch 8,
# 192 at batch 64, so a second wave of 4 or 60 CTAs doubled the core's time. The plan now stops at one wave
# (v2.4, measured in section 6). (2) *Streaming rate*: one CTA streams ~20 GB/s where 132 CTAs need ~32 GB/s each
# to reach the copy bandwidth; a deeper ring (more bytes in flight per SM) was tried and lost (section 6).
# (3) *Fixed costs*: at 1K tokens and batch 1 the half is 3.9x its floor (14 µs): five launches around a tiny
# core, where vLLM's path runs 14. The kernel's design notes have the version table
# (`docs/kernels/mla_latent_decode.md`).

# %% [markdown]
# ## 6. The one-wave plan and the ring, measured (H100)
#
# v2.4 (one wave of CTAs, the ring of two 64-row pages) beside a candidate ring of five 32-row half pages with four
# in flight (`fast-mla-half5`, predicted ~30 GB/s per CTA instead of ~20) and vLLM's MLA layer, in one run on an
# H100 at rank16 (key `mla_ring_h100`). Ratios are within this run; the H200 run above is another card.

# %%
def mla_run(key):
    """The MLA+MoE records of one run (traces/index.json key) by (batch, context, impl, part); prints the run's card."""
    cells = {(r["batch"], r["context"], r["impl"], r["part"]): r
             for r in load_records(os.path.join(nbtools.ROOT, nbtools.INDEX[key])) if r["layer_kind"] == "mla_moe"}
    first = next(iter(cells.values()))
    print(f"{first['gpu']}, commit {first['commit']}, copy {first['copy_tbps']:.2f} TB/s; attention half, µs")
    return cells


ring = mla_run("mla_ring_h100")
print("                       floor    stock   v2.4 (page2)   half5    stock/v2.4")
for batch in (1, 8, 64):
    for ctx in (1024, 8192, 32768):
        st, p2, h5 = (ring[(batch, ctx, i, "attn")] for i in ("stock", "fast-mla", "fast-mla-half5"))
        print(f"  batch {batch:2d}, {ctx // 1024:2d}K tokens  {st['floor_us']:7.1f} {st['replay_us_median']:8.1f} "
              f"{p2['replay_us_median']:10.1f} {h5['replay_us_median']:10.1f}   {st['replay_us_median'] / p2['replay_us_median']:6.2f}x")

# the deeper ring loses wherever the cache is long (equal within 1 % at 1K, behind from 8K), so v2.4's ring ships
for batch in (1, 8, 64):
    for ctx in (8192, 32768):
        assert ring[(batch, ctx, "fast-mla-half5", "attn")]["replay_us_median"] > \
            ring[(batch, ctx, "fast-mla", "attn")]["replay_us_median"]
# one wave: at batch 8 and 32K tokens the fused half is now within 10 % of vLLM's (v2.3 on the H200 took 1.7x)
b8 = ring[(8, 32768, "fast-mla", "attn")]["replay_us_median"] / ring[(8, 32768, "stock", "attn")]["replay_us_median"]
print(f"fused / stock at batch 8, 32K tokens: {b8:.2f}")
assert b8 < 1.1

# %% [markdown]
# The one-wave plan did what it was for: the fused half at batch 8 and 32K tokens went from 1.7x vLLM's time (v2.3,
# H200) to within 10 % of it (v2.4, H100). The deeper ring did not: it is slower at every cell from 8K tokens
# (batch 64, 32K: 1080 µs against 948), so it left the code. A hypothesis, not a finding: its extra barriers per
# half page and the warp pairs' exchange of partial scores through shared memory cost more than the deeper ring
# gains, and with 205-223 KB of shared memory it still holds one CTA per SM. What remains between the fused half
# and vLLM's at long contexts is the core's streaming rate (at 32K tokens FA3's split-KV decode and combine take
# 52 / 126 µs of kernel time at batch 1 / 8, with the W_UK / W_UV products and the cache insert, where our two
# kernels take 83 / 239: the `k3.mla.core` stage of the trace's profiled replay) and, at short ones, the fixed cost of the chain: at batch 1 and 8K tokens the half is 3.4x its floor, where the
# issue asks for 1.5x.
#
# The next candidate, `fast-mla-uvc`, moves the split combine out of the decode kernel into `mla_uv_gate` (each of
# its CTAs sums its own head's partials), so the splits can fill a wave of SMs: at batch 1 and 8K tokens 128 one-page
# splits instead of 22 of six pages (`docs/kernels/mla_latent_decode.md`, v3). Section 7 measures it.

# %% [markdown]
# ## 7. The combine moved out of the decode, measured (H100)
#
# One run on an H100 at rank16 (key `mla_uvc_h100`): vLLM's MLA layer (stock), `fast-mla` (kernel v2.6: the
# in-kernel combine with its loads grouped) and `fast-mla-uvc` (v3: the deferred decode, the combine in
# `mla_uv_gate`, then its v2 build). Both fused halves passed their GPU tests in the same session (`gpu_uvc_h100`).

# %%
uvc = mla_run("mla_uvc_h100")
print("                       floor    stock   v2.6 (in kernel)   v3 (in uv_gate)   stock/v2.6  stock/v3")
for batch in (1, 8, 64):
    for ctx in (1024, 8192, 32768):
        st, v26, v3 = (uvc[(batch, ctx, i, "attn")]["replay_us_median"] for i in ("stock", "fast-mla", "fast-mla-uvc"))
        print(f"  batch {batch:2d}, {ctx // 1024:2d}K tokens  {uvc[(batch, ctx, 'stock', 'attn')]['floor_us']:7.1f} "
              f"{st:8.1f} {v26:14.1f} {v3:17.1f}   {st / v26:9.2f}x {st / v3:8.2f}x")

# %% [markdown]
# Where the time went, kernel by kernel, in one replay at batch 1 and 8K tokens: the decode kernel and the W_UV +
# gate kernel of each candidate (`replay_timeline`: start and duration; with PDL a kernel starts before its
# predecessor ends and waits inside).

# %%
def core_kernels(rec):
    ks = {nbtools.short_name(k["name"]): k for k in nbtools.replay_kernels(rec)}
    return ks["mla_latent_decode"], ks["mla_uv_gate"]

for impl, label in (("fast-mla", "v2.6"), ("fast-mla-uvc", "v3")):
    dec, uv = core_kernels(uvc[(1, 8192, impl, "attn")])
    print(f"{label:5s} decode {dec['start']:5.1f} -> {dec['start'] + dec['dur']:5.1f} µs ({dec['dur']:4.1f}), "
          f"uv_gate ends {uv['start'] + uv['dur']:5.1f}: {uv['start'] + uv['dur'] - dec['start'] - dec['dur']:4.1f} µs "
          f"after the decode")

d26, u26 = core_kernels(uvc[(1, 8192, "fast-mla", "attn")])
d3, u3 = core_kernels(uvc[(1, 8192, "fast-mla-uvc", "attn")])
# the deferred decode streams the cache on 128 SMs instead of 22: under half the time ...
assert d3["dur"] < 0.5 * d26["dur"]
# ... and the combine it hands to mla_uv_gate costs about what it saved, so the half is no faster at b1 8K
assert u3["start"] + u3["dur"] - d3["start"] - d3["dur"] > 2 * (u26["start"] + u26["dur"] - d26["start"] - d26["dur"])
assert uvc[(1, 8192, "fast-mla-uvc", "attn")]["replay_us_median"] > 0.95 * uvc[(1, 8192, "fast-mla", "attn")]["replay_us_median"]

# %% [markdown]
# The deferred decode did what it was for: at batch 1 and 8K tokens the decode kernel takes 12 µs where the
# in-kernel combine's 22 splits take 30. The combine did not: each of `mla_uv_gate`'s 48 CTAs sums its head's
# 128 partials over all 512 latent dims itself (a chain of eight groups of loads per token), and that costs ~28 µs
# after the decode where v2.6's W_UV + gate took 9. The half is level at batch 1 and 8K (75.6 against 73.9 µs),
# ahead only at 32K tokens with one or eight requests, and behind at batch 64 and at 1K with eight requests.
# `mla_uv_gate` v3, written and compiled but not yet timed, slices the combine by latent dim: each CTA sums 64 of the
# 512 dims once and the head's CTAs meet over W_UV's K (`docs/kernels/mla_uv_gate.md`). v2.6's grouped loads moved the batch-1 half only from 76.8
# (v2.4, previous H100 run) to 73.9 µs where ~65 was predicted: the 22 splits' streaming, not the combine's chain,
# is most of the decode's time.

# %% [markdown]
# ### The targets on this card, against their ceilings
#
# No implementation can beat stock by more than stock / floor in a cell (the **ceiling**, notebook 01). For each
# target: the best fused candidate of this run, what the target asks in µs, and how close to the byte floor that
# is. The half's target at batch 1 is reachable in principle (its ceiling is 3.5x); the whole layer's at batch 64
# asks for a layer within ~5 % of its floor, closer than any layer of this repository runs (the KDA+MoE layer at
# batch 64: ~1.4x its floor, README).

# %%
print(f"{'target':46s} {'stock':>7s} {'best':>7s} {'ratio':>6s} {'asks':>6s} {'ceiling':>8s} {'asks/floor':>10s}")
for label, batch, part, want in (("attention half b1 8K >= 2.0x", 1, "attn", 2.0),
                                 ("whole layer b1 8K >= 1.8x", 1, "layer", 1.8),
                                 ("whole layer b64 8K >= 1.3x", 64, "layer", 1.3)):
    st = uvc[(batch, 8192, "stock", part)]
    best = min(uvc[(batch, 8192, i, part)]["replay_us_median"] for i in ("fast-mla", "fast-mla-uvc"))
    asks = st["replay_us_median"] / want
    print(f"{label:46s} {st['replay_us_median']:7.1f} {best:7.1f} {st['replay_us_median'] / best:5.2f}x {asks:6.1f} "
          f"{st['replay_us_median'] / st['floor_us']:7.2f}x {asks / st['floor_us']:9.2f}x")
b64 = uvc[(64, 8192, "stock", "layer")]
assert b64["replay_us_median"] / b64["floor_us"] < 1.45           # the ceiling barely clears the 1.3x target
b1 = uvc[(1, 8192, "stock", "attn")]
assert b1["replay_us_median"] / b1["floor_us"] > 3.0              # the batch-1 half's target is not capped by its floor
