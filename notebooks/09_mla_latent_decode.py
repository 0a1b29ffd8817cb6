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
# and `fast-mla-bal` contenders) compile for sm_90a and pass their GPU tests against k3ref on an H100 (section 4);
# their timing awaits its first GPU run (the `mla-fused` trace preset). This notebook shows the parts that need no
# GPU: the algebra, the bytes, and the split-and-combine arithmetic the kernel performs.

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
# on one SM. Two rules, both in the plan (`DecodePlan.mla_splits`): "sm", about one CTA per SM over all requests
# and head groups; "balanced", at most √(36 · pages / hn) splits, where the two byte counts meet. What each reads,
# per request and head group, at batch 1 and 6 heads (8 query rows per CTA):

# %%
fig, ax = plt.subplots(figsize=(8, 4.5))
pages_axis = [16, 32, 64, 128, 256, 512, 1024, 2048]
for rule, color in (("sm", "C0"), ("balanced", "C1")):
    split_kb, combine_kb = [], []
    for maxp in pages_axis:
        s, pps = mk.plan_splits(1, 6, maxp, rule=rule)
        split_kb.append(pps * mk.PAGE * mk.DQK * 2 / 1024)                 # one split's cache rows
        combine_kb.append(s * mk.head_group(6) * mk.DV * 4 / 1024)         # the combining CTA's partials
    ax.plot([p * 64 for p in pages_axis], split_kb, color=color, marker="o", label=f"{rule}: one split's cache KB")
    ax.plot([p * 64 for p in pages_axis], combine_kb, color=color, marker="s", linestyle="--",
            label=f"{rule}: the combine's partials KB")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("cached tokens per request (the block table's capacity)")
ax.set_ylabel("KB read by one CTA")
ax.set_title("split-KV at batch 1, 6 heads: what one split and the combining CTA read")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for n_req, heads, maxp in ((1, 6, 128), (8, 6, 128), (64, 6, 512), (8, 96, 128)):
    for rule in mk.SPLIT_RULES:
        s, pps = mk.plan_splits(n_req, heads, maxp, rule=rule)
        hg = -(-heads // mk.head_group(heads))
        print(f"{rule:8s} {n_req:3d} requests x {heads:2d} heads, {maxp:4d} pages: {s:3d} splits of {pps:3d} pages, "
              f"{n_req * hg * s:4d} CTAs")

# %% [markdown]
# ## 4. The chain and what is still to measure
#
# `k3fast.layer.FusedMLA` runs the MLA attention half in five launches: the packed [q_a | kv_a | g] projection
# with AttnRes #1 and the input RMSNorm; RMSNorm(q_a) + W_Q, reading q_a in place inside the projection output;
# the attention (which also writes the step's own cache row); W_UV + the gate; o_proj with AttnRes #2. The paging
# metadata (block table, lengths) belongs to the step, not the layer: a serving engine builds it once for all MLA
# layers, and so does the trace (`k3fast.layer_io.mla_step`).
#
# On an H100 the GPU tier (`traces/index.json`, key `gpu_tier_h100`) ran every case of the decode kernel against an
# fp32 attention over the same pages (both split rules; 6, 12, 16 and 96 heads; padded, page-edge and long
# requests; the fused append; graph replays with new lengths and pages) and the whole FusedMLA half against k3ref at
# rank16 / rank8 (and full width, which passed in the run before and ran out of memory in this one: its weights'
# random draw took an 18 GB transient while the other test worker held 45 GB; the draw takes a quarter now):

# %%
import xml.etree.ElementTree as ET
tier = ET.parse(os.path.join(nbtools.ROOT, nbtools.INDEX["gpu_tier_h100"])).getroot()
mla_cases, why = {}, {}
for case in tier.iter("testcase"):
    name = case.get("name") or ""
    if "mla" in name or "mla" in (case.get("classname") or ""):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        mla_cases[name] = "skipped" if case.find("skipped") is not None else "failed" if bad is not None else "passed"
        if bad is not None:
            why[name] = (bad.get("message") or "").splitlines()[0][:90]
outcomes = {o: sum(v == o for v in mla_cases.values()) for o in ("passed", "failed", "skipped")}
print(f"MLA cases in the recorded tier: {outcomes}")
print("FusedMLA against k3ref, passed:", sorted(n for n, o in mla_cases.items()
                                               if n.startswith("test_fused_mla") and o == "passed"))
for name, msg in why.items():
    print(f"  failed: {name}: {msg}")
# what failed there is the machine, not the arithmetic: out of GPU memory beside the other test worker, or no vLLM
assert outcomes["passed"] >= 60 and all("OutOfMemoryError" in m or "No module named 'vllm'" in m for m in why.values())

# %% [markdown]
# `python -m k3fast.measure.trace --preset mla-fused` puts it beside the stock path, which is vLLM's own MLA layer
# on Hopper (FlashAttention-3's split-KV MLA decode, `FLASH_ATTN_MLA`), at 1K / 8K / 32K tokens, with both split
# rules (`fast-mla`, `fast-mla-bal`). Where that run is recorded (`traces/index.json`, key `mla_fused`), the cell
# below draws it; until then it says so.

# %%
path = nbtools.INDEX.get("mla_fused")
if path is None:
    print("not yet measured on a GPU: no 'mla_fused' record in traces/index.json")
else:
    from k3fast.measure.report import load_records
    recs = [r for r in load_records(os.path.join(nbtools.ROOT, path)) if r["part"] == "attn"
            and r["layer_kind"] == "mla_moe" and r["shape"] == "k3_rank16"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for impl, color in (("stock", "C3"), ("fast-mla", "C0"), ("fast-mla-bal", "C1")):
        for batch, marker in ((1, "o"), (8, "s"), (64, "^")):
            pts = sorted((r["context"], r["replay_us_median"]) for r in recs
                         if r["impl"] == impl and r["batch"] == batch)
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=f"{impl} b{batch}")
    floor = sorted({(r["context"], r["floor_us"], r["batch"]) for r in recs})
    for batch in (1, 8, 64):
        pts = [(c, f) for c, f, b in floor if b == batch]
        if pts:
            ax.plot(*zip(*pts), color="gray", linestyle=":", label=f"floor b{batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens per request")
    ax.set_ylabel("µs per step (graph replay, L2 flushed)")
    ax.set_title(f"MLA attention half, k3_rank16 ({recs[0]['gpu']})")
    ax.legend(fontsize=7, ncol=3)
    plt.tight_layout()
    plt.show()
