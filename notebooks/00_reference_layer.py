# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 — One Kimi K3 decoder layer, op by op
#
# This notebook steps through one K3 layer of each kind with the readable reference `k3ref`. It runs at `tiny()`
# size on the CPU: the Attention-Residuals mix, KDA (or Gated MLA), the second mix, and the Stable LatentMoE with
# its MXFP4 experts. Then it counts the bytes every op of one decode step must move, at full width and per
# tensor-parallel rank. Those bytes over the copy bandwidth are the **byte floor**: no kernel can beat it.
# It ends with the floor beside the measured stock and fused layers. Section numbers refer to the layer
# specification, `docs/k3-layer.md`.

# %%
import torch

from k3ref import K3DecoderLayer, Precision, ResidualStream, allocate_state, k3, k3_rank, random_layer, tiny
from k3ref.attnres import attn_res_mix, attn_res_u
from k3ref.bytes import floor_us, layer_bytes, part_bytes
from k3ref.kda import kda_projections
from k3ref.moe import route
from k3ref.norms import rms_norm

torch.manual_seed(0)
cfg = tiny()
P = Precision.model()          # BF16 activations, FP32 math: the model's own rounding points
print(cfg.describe())

# %% [markdown]
# ## Attention Residuals (section 6)
# There is no residual stream. A layer mixes the completed blocks `B` and the partial sum `p` with a softmax over
# RMS-normalised sources scored against a learned pseudo-query `u = γ ⊙ π`, and mixes the *raw* sources.

# %%
layer = 3                                        # an MLA+MoE layer of tiny(), one block boundary behind it
w = random_layer(cfg, layer, seed=0)
N = 2
stream = ResidualStream.from_embeddings(torch.randn(N, cfg.hidden_size).bfloat16(), cfg.max_blocks)
nb = cfg.num_blocks_before(layer)
stream.blocks[:, :nb] = torch.randn(N, nb, cfg.hidden_size).bfloat16()
stream.delta = (0.5 * torch.randn(N, cfg.hidden_size)).bfloat16()
sources = torch.cat([stream.blocks[:, :nb].float(), (stream.partial.float() + stream.delta.float())[:, None]], 1)
r = torch.rsqrt(sources.pow(2).mean(-1) + cfg.rms_norm_eps)
scores = r * (sources @ attn_res_u(w.attn_res, P))
print("sources per token:", sources.shape[1], " mixing weights:", torch.softmax(scores, -1)[0].tolist())
x = rms_norm(attn_res_mix(sources, attn_res_u(w.attn_res, P), cfg.rms_norm_eps), w.input_layernorm, cfg.rms_norm_eps)
print("attention input x:", tuple(x.shape), x.dtype)

# %% [markdown]
# ## Both layer kinds, one decode step each
# `decode_step` runs the whole layer over explicit state: the KDA conv and recurrent state (`[slots, H, V, K]`
# FP32), or the MLA latent cache. A slot index `< 0` is padding: no read, no write.

# %%
results = {}
for layer in (1, 3):
    w = random_layer(cfg, layer, seed=0)
    L = K3DecoderLayer(cfg, w, P)
    st = allocate_state(cfg, layer, 4, max_len=16, P=P)
    s = ResidualStream.from_embeddings(torch.randn(3, cfg.hidden_size).bfloat16(), cfg.max_blocks)
    s.delta = (0.5 * torch.randn(3, cfg.hidden_size)).bfloat16()
    before = {k: v.clone() for k, v in vars(st).items()}
    L.decode_step(s, st, torch.tensor([2, -1, 0]))
    untouched = all(torch.equal(v[1], before[k][1]) and torch.equal(v[3], before[k][3]) for k, v in vars(st).items())
    results[L.kind] = s.delta
    print(f"{L.kind}: output {tuple(s.delta.shape)} {s.delta.dtype}, |delta| = {s.delta.float().norm():.3f}, "
          f"other slots untouched: {untouched}")

# %% [markdown]
# ## Inside KDA (section 7) and the router (section 10)

# %%
w1 = random_layer(cfg, 1, seed=0)
pr = kda_projections(x.bfloat16(), w1.attn, P)
print({k: tuple(v.shape) for k, v in pr.items()})
ids, weights = route(x.bfloat16(), w1.mlp, cfg, P)
print("experts of token 0:", ids[0].tolist(), " weights sum to", float(weights[0].sum()))

# %% [markdown]
# ## Bytes per decode step and the floor (section 14)
# Every weight is touched once, the KDA state is read and written, and only the routed experts that were picked
# are read (16 at batch 1). The floor is the bytes over the copy bandwidth. Here we use 4.3 TB/s, the H200's
# nominal figure; each recorded trace measures the copy bandwidth of its own run.

# %%
COPY_TBPS = 4.3
print(f"{'shape':10s} {'kind':9s} {'MB':>9s} {'floor µs':>9s}   largest stages")
for name, c in (("full", k3()), ("k3_rank8", k3_rank(8)), ("k3_rank16", k3_rank(16))):
    for kind in ("kda_moe", "mla_moe"):
        st = layer_bytes(c, kind, 1, distinct_experts=16, context=1024)
        tot = part_bytes(st, "layer")
        top = sorted(st, key=lambda s: -s.total)[:3]
        print(f"{name:10s} {kind:9s} {tot / 1e6:9.1f} {floor_us(tot, COPY_TBPS):9.1f}   "
              + ", ".join(f"{s.stage} {s.total / 1e6:.1f}" for s in top))

# %% [markdown]
# At TP16 a KDA+MoE layer must move ~214 MB per rank: ~50 µs at 4.3 TB/s. More than half of it (router, latent
# down and up projections) is replicated on every rank.

# %%
# The assertion cell: executing this notebook is a test.
st16 = layer_bytes(k3_rank(16), "kda_moe", 1, distinct_experts=16)
assert abs(part_bytes(st16, "layer") / 1e6 - 214.0) < 1.0
assert all(not torch.isnan(v).any() for v in results.values())
assert untouched
print("ok")

# %% [markdown]
# ## Pictures: where the bytes are, and what the cards measured
# First, the bytes of one decode step per stage, at batch 1 and 64. At batch 64 the routed experts dominate.
# Then the layer at batch 1 as recorded on each card, stock beside fast, with its floor.
# The sweep files are chosen in one place, `k3fast.measure.nbtools.SWEEPS`.

# %%
from k3fast.measure import nbtools  # noqa: E402

plt = nbtools.pyplot()
fig, ax = plt.subplots(figsize=(7, 4))
labels = []
for x, (name, c, b) in enumerate((("rank16", k3_rank(16), 1), ("rank16", k3_rank(16), 64),
                                  ("rank8", k3_rank(8), 1), ("rank8", k3_rank(8), 64))):
    bottom = 0.0
    for s in layer_bytes(c, "kda_moe", b):
        ax.bar(x, s.total / 1e6, bottom=bottom, color=nbtools.STAGE_COLORS[s.stage], label=s.stage if x == 0 else None)
        bottom += s.total / 1e6
    labels.append(f"{name} b{b}")
ax.set_xticks(range(len(labels)), labels)
ax.set(ylabel="MB per decode step", title="bytes by stage (kda_moe, uniform routing)")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()

# %%
b1 = [r for r in nbtools.part_rows("layer", nbtools.sweep()) if r["batch"] == 1]
nbtools.plot_stage_bars(b1, "the layer at batch 1 (graph replay)");

# %%
# Structural facts of the recorded sweeps: nothing beats its floor, and the fused layer is faster than stock.
for r in b1:
    assert r["floor_us"] <= r["fast_us"] < r["stock_us"], r
print("ok")
