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
# # 05 — Router logits + latent down-projection + top-16, one pass over x
#
# **Reference ops replaced** (`docs/k3-layer.md` sections 10, 11, 12):
# * `ℓ = x W_rᵀ` in FP32, `s = σ(ℓ)`;
# * the top-16 of `s + e_score_correction_bias` (the bias is for selection only);
# * the weights `s / Σ s` over the chosen experts;
# * `z = x W_downᵀ`, the latent the experts run in;
# * at M ≤ 4, the shared experts' gate/up and SiTU too.
#
# All of them read the same MLP input x. So their rows are packed into one weight, router rows first:
# `[896 + 3584 + 2·Is, 7168]`, 64 MB (+ the shared rows), the same on every TP rank. It is streamed once.
#
# **The trick.** The top-16 needs all 896 logits of a token, spread over 224 router CTAs.
# Each router CTA writes its logits, then bumps a device counter. The last CTA to arrive runs the top-16,
# while the latent rows still stream in the other CTAs. It also resets the counter, so replays need no memset.

# %%
import torch

from k3ref import Precision, k3_rank, random_layer, tiny
from k3ref.compare import rel_rmse
from k3ref.moe import route

from k3fast.kernels import router_down_topk as rm
from k3fast.measure import nbtools

cfg, P = tiny(), Precision.exact()
w = random_layer(cfg, 1, seed=0).mlp
x = torch.randn(4, cfg.hidden_size, dtype=torch.float64)

# %% [markdown]
# ## 1. The reference: selection uses the bias, the weights do not

# %%
ids, ws = route(x, w, cfg, P)
s = torch.sigmoid(x @ w.gate.double().T)
print("token 0 experts:", ids[0].tolist(), " weights sum:", float(ws[0].sum()))
unbiased = torch.topk(s, cfg.num_experts_per_token).indices
print("tokens whose expert set differs from the unbiased top-k:",
      sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, unbiased)))

# %% [markdown]
# ## 2. Bytes and floor
# The router (13 MB) and the latent down-projection (51 MB) do not shrink with tensor parallelism.
# So this floor is the same at rank16, rank8 and full width.

# %%
nbtools.floors(nbtools.FUSIONS["front"], batches=(1, 64))

# %% [markdown]
# ## 3. The fused kernel and its trick
# ### One launch at M ≤ 4
# A warp streams one packed weight row with 16-byte loads and FMAs it against the M tokens of x.
# * Router CTAs come first in the grid. Each writes its fp32 logits to a workspace and adds 1 to a counter
#   (acquire-release). The CTA whose add returns the last count runs the top-16 of every token.
# * The latent CTAs write `z`. The shared-expert CTAs meet each gate/up pair in shared memory and write `h`.
# * The top-16 issues all its loads first, then the arithmetic: a sigmoid's division compiles to a branch, and
#   ptxas does not move a load above a branch. Loads interleaved with sigmoids cost one L2 round trip each.
#
# ### Above M = 4: one cuBLAS GEMM, then the top-16 alone
# A library GEMM over the same packed weight wins there (fp32 output, so the logits are never rounded).
# Then `TopkFromLogits`, one CTA per token, selects: each of its 4 warps takes the top-16 of 224 experts,
# and warp 0 merges the 64 candidates. The global top-16 lies in the union of the per-warp top-16s under the same
# order (larger key, then lower expert), so the result is the same bits. Here is that argument on the CPU,
# with many exact ties:

# %%
g10 = torch.Generator().manual_seed(10)
keys = torch.randint(0, 40, (3, 896), generator=g10).double()          # few distinct values: many exact ties


def top16(k, idx):
    return sorted(idx, key=lambda e: (-k[e].item(), e))[:16]          # larger key, then lower expert


split_equal = all(top16(row, [e for wp in range(4) for e in top16(row, range(224 * wp, 224 * (wp + 1)))])
                  == top16(row, range(896)) for row in keys)
print("top-16 of the per-warp top-16s == top-16 of all 896 (with ties):", split_equal)

# %% [markdown]
# The builds at rank16 (shared width 384): one fused build per token bucket up to M = 4, then the top-k kernel,
# whose build does not depend on M. One compiled on the CPU:

# %%
Is = k3_rank(16).shared_intermediate
for key in rm.compile_keys(Is, [1, 2, 4, 8, 64]):
    print(" ", key)
compiled = nbtools.compile_on_cpu(rm.warmup, Is, [1])

# %% [markdown]
# ## 4. Against the reference
# On the CPU: the selection order and the weights. With a GPU: the fused kernel against `k3ref` at rank16 b1.
# `tests/gpu/test_router_down_topk.py` covers both paths, every bucket, and exact ties across warps.

# %%
assert split_equal
assert torch.allclose(ws.sum(-1), torch.full((4,), cfg.routed_scaling_factor, dtype=torch.float64))
assert torch.equal(ws, s.gather(1, ids) / s.gather(1, ids).sum(-1, keepdim=True) * cfg.routed_scaling_factor)
if torch.cuda.is_available():
    cg = k3_rank(16)
    m = random_layer(cg, 1, seed=0, device="cuda").mlp
    xg = torch.randn(1, cg.hidden_size, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    xg = xg.bfloat16()
    front = torch.cat([m.gate, m.down, m.shared_gate, m.shared_up]).contiguous()

    def run():
        return rm.router_down_topk(xg, front, m.e_score_correction_bias, shared=cg.shared_intermediate,
                                   scaling=cg.routed_scaling_factor)
    z, kid, _, _ = run()
    rid, _ = route(xg, m, cg, Precision.model())
    z_err = rel_rmse(z.float(), xg.float() @ m.down.float().T)
    shared_picks = len(set(kid[0].tolist()) & set(rid[0].tolist()))    # fp32 order may swap a near-tie
    print(f"live: {shared_picks} of 16 experts as k3ref picks, z {z_err:.1e}; "
          f"{nbtools.time_live(run):.1f} µs per call (graph replay)")
    assert shared_picks >= 15 and z_err < 1e-2
else:
    print("no GPU here: the recorded records' rel_err_vs_ref is the GPU's word")

# %% [markdown]
# ## 5. Measured: beside stock and the floor
# Stock runs the router GEMM, vLLM's top-k kernel and the latent GEMM (with a split-K reduce).
# One booking differs: at M ≤ 4 our front also computes the shared experts' gate/up, which stock books under
# `k3.moe.shared`. At full width those rows are 176 MB, so the front alone compares only at the ranks' widths.

# %%
recs = nbtools.sweep()
rows = [r for r in nbtools.stage_rows(nbtools.FUSIONS["front"], recs) if r["shape"] != "full"]
nbtools.show(rows)

# %% [markdown]
# At batch 1-2 the one fused launch beats stock's four kernels, although it also carries the shared gate/up.
# From M = 4 the two paths are close. The MoE half as a whole (notebook 06) is where the front's early start pays.

# %%
for r in rows:
    assert r["fast_us"] >= 0.8 * r["floor_us"], r
    if r["batch"] <= 2:
        assert 1.05 <= r["stock_us"] / r["fast_us"] <= 1.8, r
moe = nbtools.part_rows("moe", recs)
for r in moe:
    if r["batch"] == 1:
        assert r["stock_us"] / r["fast_us"] >= 1.2, r
print("ok")

# %% [markdown]
# ### Against vLLM's own layer
# The sweeps' stock above is an earlier composition of library kernels. vLLM 0.33's own layer, run kernel for
# kernel (`nbtools.vllm_layer()`: H100, rank16, its kernel time within 5 % of vLLM's engine, notebook 01), is
# the peer users actually have. Its front is a CuTe dot-product GEMV for the router, its grouped top-k kernel and
# a CuTe skinny GEMM for the latent down-projection: three lean launches, so the fused front leads by little
# (1.03-1.20x) although it also carries the shared experts' gate/up at M ≤ 4.

# %%
vl = nbtools.stage_rows(nbtools.FUSIONS["front"], nbtools.vllm_layer())
nbtools.show(vl)
for r in vl:
    assert r["fast_us"] < r["stock_us"], r
print("ok")

# %% [markdown]
# ## 6. What was tried
# The design note, [router_down_topk.md](../docs/kernels/router_down_topk.md), holds the numbers, the runs and
# the version table. Figures are H200 µs, kernel alone with the L2 flushed unless marked.
#
# | tried | measured | fate |
# |---|---|---|
# | the fused front above M = 4 | slower than one cuBLAS GEMM over the same weight | cuBLAS + `TopkFromLogits` there |
# | the top-k in torch ops after the GEMM | ~12 kernels, a 20 µs stable sort among them | replaced by `TopkFromLogits` |
# | the 16 selection rounds rolled into a loop (half the code) | the same time, L2 warm or flushed | removed |
# | all 56 loads before the first sigmoid | `TopkFromLogits` 21.3 → 13.1 µs at b1 | kept |
# | the z copy in batches (a store no longer waits for the next load) | 13.1 → 10.5 µs | kept |
# | bulk L2 prefetches before the PDL wait (front, tail) | slower | removed |
# | the shared experts' gate/up in the same pass (M ≤ 4) | the experts start 7 µs earlier, one launch fewer | kept |
# | the top-16 over 4 warps, then a merge | 11.0 → 8.6 µs warm at b1, bit-identical | kept |

# %% [markdown]
# ## 7. Pictures
# The front at the ranks' widths: stock and fast against the floor.

# %%
nbtools.plot_stage_bars(rows, "router + latent down");

# %% [markdown]
# One replay of the MoE half at rank16 on the H200, per batch. At M ≤ 4 the fused front is one kernel; at M = 8,
# cuBLAS's GEMM (grey) and the top-k kernel. With PDL the experts kernel starts before the front ends.

# %%
nbtools.plot_timelines(nbtools.replay_rows(recs, "H200", "k3_rank16", "moe", (1, 2, 4, 8)),
                       "MoE half, rank16, H200: one replay per batch");
