"""The fused decode layer (``impl="fast"``): the CuTe DSL kernels of k3fast.kernels chained with PDL over the same
static buffers as the other implementations (k3fast.layer_io.LayerIO).

A KDA + MoE layer at batch 1 is six launches:

    attention half   attnres_rms_gemv_ring   AttnRes #1 + input RMSNorm + packed in_proj [q|k|v|g|f_a|b]
                     kda_conv_gate_step      short conv + SiLU, f_b + decay gate, beta, L2 norms, delta rule, gated norm
                     oproj_attnres           o_proj + partial-sum update + AttnRes #2 + post-attention RMSNorm
    MoE half         router_down_topk        router logits + latent down-projection + top-16 + the shared experts'
                                             gate/up + SiTU, one pass over x
                     moe_mxfp4_experts       routed experts: MXFP4 decoded in registers, SiTU, w2, weighted combine
                     moe_tail                routed_expert_norm + latent up-projection + shared down-projection + add

Which kernel runs each stage depends on the batch: a ``DecodePlan`` holds those choices. Every threshold in it is a
measured crossover between one of our kernels and cuBLAS (or between two of our kernels); the figures are in the
kernels' design notes under docs/kernels/. Weights are re-laid once at construction (packed in_proj, packed front,
MXFP4 tiles); nothing is compiled or allocated on the hot path after the first eager call. MLA layers run the
fused MoE half; their attention half is the stock one by default, or FusedMLA (the plan's ``mla_attention``): our
in_proj, latent decode attention and o_proj kernels with torch ops between them, not yet measured.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from k3ref import K3Config
from k3ref.attnres import attn_res_u
from k3ref.precision import Precision
from k3ref.weights import KDAWeights, LayerWeights, MoEWeights

from .nvtx import stage


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Which kernel runs each stage of the fused layer at batch M (one token per request, M <= 64).

    The defaults are the shipped path; ``CONTENDERS`` below names the few alternatives that are still measured.
    docs/kernels/<module>.md gives the measurement behind each threshold."""

    # in_proj at M <= 2: "ring" streams the weights through a bulk-copy shared-memory ring (rms_gemv_ring); "fma"
    # loads them with 16-byte register loads (rms_gemv). The ring is ~4 us faster at rank16 b1.
    in_proj_small: str = "ring"
    # in_proj / o_proj GEMMs at 8 < M <= 64 where they run apart from their AttnRes norm: "auto" takes the WGMMA
    # cluster split-K GEMM (gemm_wgmma_splitk) at the widths where it beat cuBLAS in every run (in_proj rows <=
    # 8192; o_proj input width 1536, and 768 from M = 17), cuBLAS elsewhere; "cublas" takes cuBLAS everywhere.
    wide_gemm: str = "auto"
    # o_proj + AttnRes #2 + post-attention RMSNorm as one kernel (oproj_attnres) up to this batch and o_proj input
    # width; beyond either, o_proj's GEMM runs apart and the AttnRes norm is its own kernel. At full width (K =
    # 12288) the fused kernel's GEMV streams at ~1 TB/s, cuBLAS at ~3.
    oproj_fused_max_m: int = 8
    oproj_fused_max_k: int = 1536
    # router + latent down + top-16 + shared gate/up as one kernel (router_down_topk's FMA path) up to this batch;
    # above it one cuBLAS GEMM over the same packed weight and the TopkFromLogits kernel. 0 = cuBLAS everywhere.
    front_fused_max_m: int = 4
    # the MoE tail as one kernel (moe_tail) up to this batch; above it RMSNorm + two cuBLAS GEMMs + add. moe_tail's
    # swap-AB GEMV re-reads the activations per warp and falls behind cuBLAS past two 8-token tiles.
    tail_fused_max_m: int = 16
    # the routed-experts kernel at batch buckets 4 / 8 also carries the split-expert work items and takes them when
    # few experts hold every pair (skewed routing); False runs its whole-pass items only.
    experts_alt_items: bool = True
    # the MLA layers' attention half: "stock" (vLLM's kernels, StockImpl) or "fused" (FusedMLA: our in_proj, latent
    # decode attention and o_proj kernels with torch ops between them). "stock": beside vLLM's own MLA layer FusedMLA
    # is ahead at 1K cached tokens, even at 8K and behind at 32K (docs/kernels/mla_latent_decode.md).
    mla_attention: str = "stock"
    # FusedMLA's split combine: "decode" (the last split of each request and head group combines, inside
    # mla_latent_decode; the split count capped where that one CTA's reads balance a split's share of the cache) or
    # "uv_gate" (every split publishes its partial and the splits fill one wave of SMs; mla_uv_gate's combine build
    # sums them, a CTA per head and 64-dim slice of the latent)
    mla_combine: str = "decode"

    def __post_init__(self):
        if self.in_proj_small not in ("ring", "fma"):
            raise ValueError(f"in_proj_small must be 'ring' or 'fma', got {self.in_proj_small!r}")
        if self.mla_attention not in ("stock", "fused"):
            raise ValueError(f"mla_attention must be 'stock' or 'fused', got {self.mla_attention!r}")
        if self.mla_combine not in ("decode", "uv_gate"):
            raise ValueError(f"mla_combine must be 'decode' or 'uv_gate', got {self.mla_combine!r}")
        if self.wide_gemm not in ("auto", "cublas"):
            raise ValueError(f"wide_gemm must be 'auto' or 'cublas', got {self.wide_gemm!r}")
        # the fused front folds the shared experts' gate/up only on its warp-per-row path (M <= 4)
        if not 0 <= self.front_fused_max_m <= 4:
            raise ValueError(f"front_fused_max_m must be in 0..4, got {self.front_fused_max_m}")
        if not 0 <= self.tail_fused_max_m <= 64:
            raise ValueError(f"tail_fused_max_m must be in 0..64, got {self.tail_fused_max_m}")
        if not 0 <= self.oproj_fused_max_m <= 64:
            raise ValueError(f"oproj_fused_max_m must be in 0..64, got {self.oproj_fused_max_m}")

    # ----------------------------------------------------------------------------------- the rules, by stage
    def in_proj_engine(self, M: int, K: int, N: int) -> tuple[str, dict]:
        """The in_proj's path at M tokens for a [N, K] weight: ("ring" | "fma" | "norm+ring_mma" | "norm+wgmma" |
        "cublas", the WGMMA GEMM's plan pins)."""
        from .kernels import gemm_wgmma_splitk, rms_gemv_ring
        if M <= 2:
            return self.in_proj_small, {}
        if rms_gemv_ring.mma_applicable(M, K, N):
            return "norm+ring_mma", {}
        if self.wide_gemm == "auto" and rms_gemv_ring.MMA_MAX_M < M <= 64 and N <= 8192:
            # the plan's own tiles at rank16 up to M = 16; clusters of 4 x 112 rows above it (the only split whose
            # weight moves while the 256-CTA norm before it runs); 2 x 96 rows at rank8's 6288 rows
            pins = {} if N <= 4096 and M <= 16 else (
                {"ksplit": 4, "bn": 112, "xrows": "auto"} if N <= 4096 else {"ksplit": 2, "bn": 96, "xrows": "auto"})
            if gemm_wgmma_splitk.applicable(M, K, N, **pins):
                return "norm+wgmma", pins
        return "cublas", {}

    def o_proj_engine(self, M: int, Kp: int, N: int = 7168) -> str:
        """o_proj's path at M tokens for a [N, Kp] weight: "fused" (oproj_attnres), or its GEMM apart ("wgmma" |
        "cublas") followed by the AttnRes #2 norm kernel."""
        from .kernels import gemm_wgmma_splitk
        if M <= self.oproj_fused_max_m and Kp <= self.oproj_fused_max_k:
            return "fused"
        wide = self.wide_gemm == "auto" and (Kp == 1536 or (Kp == 768 and M >= 17))
        if wide and gemm_wgmma_splitk.applicable(M, Kp, N):
            return "wgmma"
        return "cublas"

    def front_engine(self, M: int) -> str:
        """The router front at M tokens: "fused" (router_down_topk) or "cublas" (GEMM + TopkFromLogits)."""
        return "fused" if M <= self.front_fused_max_m else "cublas"

    def tail_engine(self, M: int) -> str:
        return "fused" if M <= self.tail_fused_max_m else "cublas"

    def stages(self, cfg: K3Config, M: int) -> dict[str, str]:
        """What runs at each stage of a KDA + MoE layer at batch M (for logs, records and tests)."""
        from .kernels.kda_conv_gate_step import proj_width
        return {"in_proj": self.in_proj_engine(M, cfg.hidden_size, proj_width(cfg.kda_heads))[0],
                "kda": "kda_conv_gate_step",
                "o_proj": self.o_proj_engine(M, cfg.kda_heads * cfg.kda_head_dim, cfg.hidden_size),
                "router": self.front_engine(M),
                "experts": "moe_mxfp4_experts" + ("" if self.experts_alt_items else " (whole passes)"),
                "tail": self.tail_engine(M)}


DEFAULT_PLAN = DecodePlan()

# The live alternatives to the shipped plan, each measured beside it in one run: (plan, what it tests).
CONTENDERS: dict[str, tuple[DecodePlan, str]] = {
    "fast-v51": (DecodePlan(experts_alt_items=False),
                 "routed experts without the split-expert items at buckets 4 / 8 (open: rank16 b8 uniform)"),
    "fast-infma": (DecodePlan(in_proj_small="fma"),
                   "in_proj at M <= 2 with register loads instead of the bulk-copy ring (what the ring buys)"),
    "fast-cublas": (DecodePlan(wide_gemm="cublas"),
                    "in_proj / o_proj GEMMs on cuBLAS at M > 8 (what our WGMMA split-K GEMM buys)"),
    "fast-front0": (DecodePlan(front_fused_max_m=0),
                    "router front as cuBLAS GEMM + top-k kernel at every batch (what the fused front buys)"),
    "fast-taildsl": (DecodePlan(tail_fused_max_m=64),
                     "moe_tail at every batch (where cuBLAS overtakes the swap-AB GEMV)"),
    "fast-mla": (DecodePlan(mla_attention="fused"),
                 "MLA layers' attention half on FusedMLA (open: ahead of vLLM's FA3 MLA at 1K tokens, behind at 32K)"),
    "fast-mla-uvc": (DecodePlan(mla_attention="fused", mla_combine="uv_gate"),
                     "FusedMLA with a wave of splits and their combine in mla_uv_gate, sliced by latent dim "
                     "(open: undecided against fast-mla)"),
}


# ------------------------------------------------------------------------------ the stages, as functions
# Shared by FastImpl and the torch custom ops (k3fast.ops), so both give the same bits at every batch.

@contextlib.contextmanager
def blas_library(lib: str | None, device: torch.device):
    """torch's preferred BLAS library set to ``lib`` ("cublaslt" / "cublas") around the calls inside, then restored;
    a no-op for None or a CPU tensor (a CPU build of torch refuses cublasLt). The setting is global, so it is held
    only around the one GEMM that wants it; in a CUDA graph the library is chosen once, at capture."""
    if lib not in (None, "cublas", "cublaslt"):
        raise ValueError(f"lib: expected None, 'cublas' or 'cublaslt', got {lib!r}")
    if lib is None or device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(lib)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)


def attnres_in_proj(blocks, n_blocks, partial, delta, u, w_ln, w, *, eps, block_write, partial_out,
                    plan: DecodePlan = DEFAULT_PLAN):
    """AttnRes #1 + input RMSNorm + the packed in_proj, on the path ``plan`` picks for this batch. Returns (y,
    partial_out): y = bf16(RMSNorm(AttnRes mix) @ w^T), p' = bf16(p + delta) written to partial_out (and to
    blocks[:, block_write] when block_write >= 0)."""
    from .kernels import gemm_wgmma_splitk, rms_gemv, rms_gemv_ring
    M = partial.shape[0]
    engine, pins = plan.in_proj_engine(M, w.shape[1], w.shape[0])
    common = dict(eps=eps, block_write=block_write, partial_out=partial_out)
    if engine == "ring":
        return rms_gemv_ring.attnres_rms_gemv_ring(blocks, n_blocks, partial, delta, u, w_ln, w, **common)
    if engine == "fma":
        return rms_gemv.attnres_rms_gemv(blocks, n_blocks, partial, delta, u, w_ln, w, early_trigger=True, **common)
    if engine in ("norm+ring_mma", "norm+wgmma"):
        # the norm kernel launches the GEMM right after its PDL wait, so the GEMM's weights stream while it runs
        x, partial_out = rms_gemv.attnres_rmsnorm(blocks, n_blocks, partial, delta, u, w_ln, early_trigger=True,
                                                  **common)
        if engine == "norm+ring_mma":
            return rms_gemv_ring.gemv_ring_mma(x, w), partial_out
        return gemm_wgmma_splitk.gemm_wgmma(x, w, **pins), partial_out
    # cublasLt picks one split-free kernel at rank16 M = 64 where cuBLAS adds a split-K reduce kernel
    with blas_library("cublaslt", partial.device):
        return rms_gemv.attnres_rms_gemv(blocks, n_blocks, partial, delta, u, w_ln, w, **common)


def oproj_attnres_any(y, w_o, blocks, n_blocks, p1, u_mlp, w_post, *, eps, boundary, out_x=None, out_partial=None,
                      zeros=None, plan: DecodePlan = DEFAULT_PLAN):
    """o_proj + partial-sum update + AttnRes #2 + post-attention RMSNorm on the path ``plan`` picks. Returns (x_mlp,
    p''): p'' = bf16(p1 + y W_o^T), or y W_o^T alone at a block boundary (p'' then starts the new block). ``zeros``:
    a zero tensor shaped like p1 for the boundary case where the GEMM runs apart (so nothing is allocated in a
    graph)."""
    from .kernels import gemm_wgmma_splitk, oproj_attnres, rms_gemv
    engine = plan.o_proj_engine(y.shape[0], w_o.shape[1], w_o.shape[0])
    if engine == "fused":
        return oproj_attnres.oproj_attnres(y, w_o, blocks, n_blocks, p1, u_mlp, w_post, eps=eps, boundary=boundary,
                                           out_x=out_x, out_partial=out_partial)
    a = gemm_wgmma_splitk.gemm_wgmma(y, w_o) if engine == "wgmma" else F.linear(y, w_o)
    p = (zeros if zeros is not None else torch.zeros_like(p1)) if boundary else p1
    return rms_gemv.attnres_rmsnorm(blocks, n_blocks, p, a, u_mlp, w_post, eps=eps, out=out_x,
                                    partial_out=out_partial)


def router_front(x, front, e_bias, *, shared, n_experts, top_k, scaling, plan: DecodePlan = DEFAULT_PLAN):
    """Router logits + latent down-projection + top-k + the shared experts' gate/up + SiTU over the packed front
    weight [W_r; W_down; shared gate/up]: returns (z, topk_ids, topk_w, h)."""
    from .kernels.router_down_topk import router_down_topk, router_down_topk_cublas
    fn = router_down_topk if plan.front_engine(x.shape[0]) == "fused" else router_down_topk_cublas
    return fn(x, front, e_bias, shared=shared, n_experts=n_experts, top_k=top_k, scaling=scaling)


def moe_tail_cublas(r, w_norm, w_up, h, w_sd, *, eps, out=None):
    """moe_tail's contract on library kernels: one RMSNorm kernel on the bf16 r (fp32 inside, one rounding, as
    k3ref), two cuBLAS GEMMs and the add, with k3ref's roundings: bf16 r_hat, bf16 routed and shared, their sum
    rounded once. w_norm: routed_expert_norm.weight (bf16 in the checkpoint)."""
    with stage("k3.moe.shared"):
        shared = F.linear(h, w_sd)
    with stage("k3.moe.up"):
        rn = F.rms_norm(r, (r.shape[-1],), w_norm.to(r.dtype), eps)
        return torch.add(F.linear(rn, w_up), shared, out=out)


def moe_tail_any(r, w_norm, w_up, h, w_sd, *, eps, out=None, plan: DecodePlan = DEFAULT_PLAN):
    """routed_expert_norm + latent up-projection + shared down-projection + add on the path ``plan`` picks."""
    if plan.tail_engine(r.shape[0]) == "fused":
        from .kernels.moe_tail import moe_tail
        with stage("k3.moe.up"):
            return moe_tail(r, w_norm, w_up, h, w_sd, eps=eps, out=out)
    return moe_tail_cublas(r, w_norm, w_up, h, w_sd, eps=eps, out=out)


# ----------------------------------------------------------------------------------------------- the halves

class _AttentionEnds:
    """What both attention halves share: AttnRes #1 + input RMSNorm + the layer's packed projection at one end,
    o_proj + partial-sum update + AttnRes #2 + post-attention RMSNorm at the other, and the scratch they keep."""

    def _ends_init(self, cfg: K3Config, w: LayerWeights, plan: DecodePlan) -> None:
        P = Precision.model()
        self.cfg, self.layer, self.plan = cfg, w.layer, plan
        self.u_attn = attn_res_u(w.attn_res, P).float().contiguous()
        self.u_mlp = attn_res_u(w.mlp_res, P).float().contiguous()
        self.w_ln, self.w_post = w.input_layernorm, w.post_attention_layernorm
        self._bufs: dict = {}

    def _in(self, blocks, partial, delta, w_packed):
        """(the packed projection's output [M, N], p') with p' = p + delta in a scratch row: the fused prologue reads
        p in every CTA, so it may not write p in place; o_proj + AttnRes #2 reads p' and writes the layer's sum."""
        cfg, l = self.cfg, self.layer
        boundary = cfg.is_block_boundary(l)
        p1 = self._buf("p1", partial)
        z, _ = attnres_in_proj(blocks, cfg.num_blocks_before(l), partial, delta, self.u_attn, self.w_ln, w_packed,
                               eps=cfg.rms_norm_eps, block_write=(l // cfg.attn_res_block_size) if boundary else -1,
                               partial_out=p1, plan=self.plan)
        return z, p1

    def _out(self, y, w_o, blocks, p1, x_mlp, partial, partial_out) -> None:
        cfg, l = self.cfg, self.layer
        boundary = cfg.is_block_boundary(l)
        oproj_attnres_any(y, w_o, blocks, cfg.num_blocks_before(l) + int(boundary), p1, self.u_mlp, self.w_post,
                          eps=cfg.rms_norm_eps, boundary=boundary, out_x=x_mlp,
                          out_partial=partial if partial_out is None else partial_out,
                          zeros=self._buf("p0", p1, zero=True), plan=self.plan)

    def _check_ends(self, blocks, partial, delta, x_mlp, partial_out) -> tuple[int, torch.device]:
        """The arguments both halves share, checked before any launch; returns (M, the weights' device)."""
        from .kernels._dsl import check_tensor
        d, dev = self.cfg.hidden_size, self.in_proj.device
        check_tensor("partial", partial, dtype=torch.bfloat16, device=dev)
        if partial.dim() != 2 or partial.shape[1] != d or not 1 <= partial.shape[0] <= 64:
            raise ValueError(f"partial: expected [M, {d}] with M in 1..64, got {list(partial.shape)}")
        M = partial.shape[0]
        # the block rows may be a strided view (vLLM's AttnRes rows); each row must be compact
        check_tensor("blocks", blocks, dtype=torch.bfloat16, device=dev, contiguous=False)
        if blocks.dim() != 3 or blocks.shape[0] != M or blocks.shape[2] != d or blocks.stride(2) != 1:
            raise ValueError(f"blocks: expected [{M}, n, {d}] with compact rows, got {list(blocks.shape)} "
                             f"(strides {blocks.stride()})")
        for name, t in (("delta", delta), ("x_mlp", x_mlp), ("partial_out", partial_out)):
            if t is not None:
                check_tensor(name, t, dtype=torch.bfloat16, shape=(M, d), device=dev)
        return M, dev

    def _buf(self, name: str, like: torch.Tensor, zero: bool = False, shape=None) -> torch.Tensor:
        """A scratch tensor like ``like`` (or of ``shape``), owned here, allocated at the first call of each shape
        (before any graph replays it; ``zero``: zeroed once and never written)."""
        shape = tuple(like.shape) if shape is None else tuple(shape)
        key = (name, shape)
        t = self._bufs.get(key)
        if t is None:
            make = torch.zeros if zero else torch.empty
            t = self._bufs[key] = make(shape, dtype=like.dtype, device=like.device)
        return t


class FusedKDA(_AttentionEnds):
    """The KDA attention half of layer ``layer`` on the fused kernels: AttnRes #1 + input RMSNorm + packed in_proj,
    the KDA step, o_proj + AttnRes #2 + post-attention RMSNorm. Three launches at small batch.

    ``in_proj``: the packed [q|k|v|g|f_a|b|pad] weight when the caller already holds it in that layout (vLLM's
    in_proj_qkvgfab is); None packs it from ``w.attn``. ``null_slot``: slot 0 also marks padding (vLLM's
    NULL_BLOCK_ID). ``check_slots``: refuse out-of-pool or shared slot indices before launch in eager calls (a host
    sync; kda_conv_gate_step); a caller that owns the slot bookkeeping (the vLLM plug-in) turns it off."""

    def __init__(self, cfg: K3Config, w: LayerWeights, *, plan: DecodePlan = DEFAULT_PLAN,
                 in_proj: torch.Tensor | None = None, null_slot: bool = False, check_slots: bool = True):
        from .kernels.kda_conv_gate_step import proj_width
        a = w.attn
        if not isinstance(a, KDAWeights):
            raise TypeError(f"w.attn: expected KDAWeights (layer {w.layer} is not a KDA layer)")
        self._ends_init(cfg, w, plan)
        self.null_slot, self.check_slots = null_slot, check_slots
        width = proj_width(cfg.kda_heads)
        if in_proj is None:
            # one [q|k|v|g|f_a|b] weight, zero rows up to the KDA step's packed width
            rows = torch.cat([a.q_proj, a.k_proj, a.v_proj, a.g_proj, a.f_a_proj, a.b_proj])
            in_proj = torch.cat([rows, rows.new_zeros(width - rows.shape[0], rows.shape[1])]).contiguous()
        elif tuple(in_proj.shape) != (width, cfg.hidden_size):
            raise ValueError(f"in_proj: expected the packed [{width}, {cfg.hidden_size}] weight, got "
                             f"{list(in_proj.shape)}")
        self.in_proj = in_proj
        self.conv_w = torch.cat([a.q_conv, a.k_conv, a.v_conv]).view(-1, cfg.short_conv_kernel_size).float()
        self.conv_w = self.conv_w.contiguous()
        self.f_b, self.a_log, self.dt_bias, self.o_proj = a.f_b_proj, a.A_log, a.dt_bias, a.o_proj
        self.o_norm = a.o_norm.float().contiguous()

    def __call__(self, blocks, partial, delta, conv_state, rec_state, slots, x_mlp, partial_out=None) -> None:
        """blocks [M, 8, d] (AttnRes block rows), partial [M, d] (the block's partial sum), delta [M, d] or None (the
        previous layer's MoE output), the KDA state pool and the requests' slots; writes the MoE half's input into
        x_mlp [M, d] and the layer's partial sum p'' into partial_out (default: partial, in place)."""
        from .kernels.kda_conv_gate_step import check_slot_indices, kda_conv_gate_step
        cfg = self.cfg
        # every argument before the first launch, so a bad one leaves the AttnRes rows and partial sums untouched
        self._check(blocks, partial, delta, conv_state, rec_state, slots, x_mlp, partial_out)
        if self.check_slots and not (slots.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_slot_indices(slots, rec_state.shape[0], null_slot=self.null_slot)
        with stage("k3.kda.in_proj"):
            proj, p1 = self._in(blocks, partial, delta, self.in_proj)
        with stage("k3.kda.core"):
            y = kda_conv_gate_step(proj, self.f_b, self.conv_w, self.a_log, self.dt_bias, self.o_norm, conv_state,
                                   rec_state, slots, heads=cfg.kda_heads, lower_bound=cfg.gate_lower_bound,
                                   eps=cfg.rms_norm_eps, early_trigger=True, null_slot=self.null_slot,
                                   check_slots=False)
        with stage("k3.o_proj"):
            self._out(y, self.o_proj, blocks, p1, x_mlp, partial, partial_out)

    def _check(self, blocks, partial, delta, conv_state, rec_state, slots, x_mlp, partial_out) -> None:
        from .kernels._dsl import check_tensor
        from .kernels.kda_conv_gate_step import check_state_pools
        M, dev = self._check_ends(blocks, partial, delta, x_mlp, partial_out)
        check_state_pools(conv_state, rec_state, heads=self.cfg.kda_heads, head_dim=self.cfg.kda_head_dim)
        check_tensor("slots", slots, dtype=torch.int32, shape=(M,), device=dev, align=4)
        if conv_state.device != dev:
            raise ValueError(f"conv_state: expected device {dev} (the layer's weights), got {conv_state.device}")


class FusedMLA(_AttentionEnds):
    """The Gated MLA attention half of layer ``layer`` (docs/k3-layer.md section 8) on the fused kernels that exist:
    AttnRes #1 + input RMSNorm + the packed [q_a | kv_a | g] projection (the in_proj path of the plan), q_a's
    RMSNorm + the absorbed query projection in one GEMV (rms_gemv with one AttnRes source, which is the plain
    RMSNorm), kv_a's RMSNorm + the cache append + the decode attention over the latent cache (mla_latent_decode),
    W_UV + the sigmoid gate (mla_uv_gate), and o_proj + AttnRes #2 + post-attention RMSNorm: five launches (the
    q_a GEMV reads q_a in place, a column slice of the projection output).

    The absorbed query weight W_Q = [W_UK,h^T W_qb,nope,h | W_qb,pe,h] per head ([H * 576, 1536]) is formed once
    in fp32 and rounded to bf16: Q = RMSNorm(q_a) W_Q^T in one pass, where k3ref rounds q (bf16) and then q_lat
    (bf16). W_Q is 2.5x the bytes of q_b + W_UK (10.6 MB against 4.3 MB at k3_rank16), two launches fewer.

    The cache is paged as vLLM pages it: a pool of 64-row pages, a block table per request and the rows each request
    attends over after this step (its own new row included; 0 for a padded request) -- the per-step metadata a
    serving engine computes once for all layers. k3fast.layer_io.mla_paged_view gives them for the harness's
    [slots, Lmax, 576] cache. ``check_paging``: refuse lengths past the block table, pages outside the pool and two
    requests appending to one row before launch in eager calls (a host sync; mla_latent_decode.check_paging); a
    caller that owns the paging (the vLLM plug-in) turns it off."""

    def __init__(self, cfg: K3Config, w: LayerWeights, *, plan: DecodePlan = DEFAULT_PLAN, nsm: int = 132,
                 in_proj: torch.Tensor | None = None, check_paging: bool = True):
        from k3ref.mla import _split_kv_b
        from k3ref.weights import MLAWeights
        a = w.attn
        if not isinstance(a, MLAWeights):
            raise TypeError(f"w.attn: expected MLAWeights (layer {w.layer} is not an MLA layer)")
        self._ends_init(cfg, w, plan)
        self.nsm, self.check_paging = nsm, check_paging
        # the split combine in mla_uv_gate (the latent decode's deferred build) or inside the latent decode
        self.defer = plan.mla_combine == "uv_gate"
        # [q_a | kv_a (512 + 64) | g]: one pass over x for the three projections (vLLM's fused_qkv_a_g_proj holds
        # them in this order already: ``in_proj``)
        rows = cfg.q_lora_rank + cfg.kv_cache_dim + cfg.mla_heads * cfg.v_head_dim
        if in_proj is not None:
            if tuple(in_proj.shape) != (rows, cfg.hidden_size) or not in_proj.is_contiguous():
                raise ValueError(f"in_proj: expected a contiguous [{rows}, {cfg.hidden_size}] weight "
                                 f"[q_a | kv_a | g], got {list(in_proj.shape)}")
            self.in_proj = in_proj
        else:
            self.in_proj = torch.cat([a.q_a_proj, a.kv_a_proj_with_mqa, a.g_proj]).contiguous()
        self.q_a_ln, self.o_proj = a.q_a_layernorm, a.o_proj
        self.kv_norm = a.kv_a_layernorm.float().contiguous()
        W_UK, W_UV = _split_kv_b(a, cfg)                  # [H, 128, 512] each
        H, dn = cfg.mla_heads, cfg.qk_nope_head_dim
        qb = a.q_b_proj.view(H, cfg.qk_head_dim, cfg.q_lora_rank).float()
        q_lat_w = torch.einsum("hdc,hdk->hck", W_UK.float(), qb[:, :dn])     # [H, 512, 1536]
        self.W_Q = torch.cat([q_lat_w, qb[:, dn:]], dim=1).reshape(H * cfg.kv_cache_dim, cfg.q_lora_rank)
        self.W_Q = self.W_Q.to(torch.bfloat16).contiguous()
        self.W_UV = W_UV.contiguous()                    # [H, 128, 512]
        # the AttnRes pseudo-query of the q_a RMSNorm call below: with one source its softmax weight is 1 whatever
        # the query, so zeros serve
        self.u_single = torch.zeros(cfg.q_lora_rank, dtype=torch.float32, device=a.q_a_proj.device)
        self.scale = cfg.qk_head_dim ** -0.5

    def __call__(self, blocks, partial, delta, kv_pages, block_table, seqlens, x_mlp, partial_out=None) -> None:
        """As FusedKDA, with the MLA cache: kv_pages [P, 64, 576] bf16, block_table [M, MAXP] int32, seqlens [M] int32
        (rows to attend after this step; the step's own row, position seqlens - 1, is written here)."""
        from .kernels import rms_gemv
        from .kernels._dsl import check_tensor
        from .kernels.mla_latent_decode import PAGE, check_paging, make_workspace, mla_latent_decode
        from .kernels.mla_uv_gate import mla_uv_gate
        cfg = self.cfg
        H = cfg.mla_heads
        # every argument before the first launch, so a bad one leaves the AttnRes rows, the partial sums and the
        # cache untouched
        M, dev = self._check_ends(blocks, partial, delta, x_mlp, partial_out)
        check_tensor("kv_pages", kv_pages, dtype=torch.bfloat16, shape=(None, PAGE, cfg.kv_cache_dim), device=dev)
        check_tensor("block_table", block_table, dtype=torch.int32, shape=(M, None), device=dev, align=4)
        check_tensor("seqlens", seqlens, dtype=torch.int32, shape=(M,), device=dev, align=4)
        if self.check_paging and not (seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_paging(block_table, seqlens, kv_pages.shape[0], lengths_name="seqlens")
        with stage("k3.mla.in_proj"):
            z, p1 = self._in(blocks, partial, delta, self.in_proj)
            qa = z[:, :cfg.q_lora_rank]
        with stage("k3.mla.q_b"):
            # RMSNorm(q_a) W_Q^T: the AttnRes GEMV with no block and no delta mixes p alone (weight 1), so its
            # prologue is q_a's RMSNorm; it reads q_a in place, a column slice of the projection output (the
            # p_strided builds), and writes p' (a copy of q_a) to scratch
            no_blocks = self._buf("no_blocks", qa, shape=(M, rms_gemv.NB_MAX, cfg.q_lora_rank), zero=True)
            Q, _ = rms_gemv.attnres_rms_gemv(no_blocks, 0, qa, None, self.u_single, self.q_a_ln, self.W_Q,
                                             eps=cfg.rms_norm_eps, partial_out=self._buf("qa_p", qa))
            Q = Q.view(M, H, cfg.kv_cache_dim)                                               # [M, H, 576] bf16
        with stage("k3.mla.core"):
            maxp = block_table.shape[1]
            ws = self._bufs.get(("ws", M, maxp))
            if ws is None:
                ws = self._bufs[("ws", M, maxp)] = make_workspace(M, H, maxp, partial.device, self.nsm, self.defer)
            # the kernel writes the step's row [RMSNorm(c~_kv) | k_pe] into its page, then attends over it
            o_lat = mla_latent_decode(Q, kv_pages, block_table, seqlens, scale=self.scale, workspace=ws, nsm=self.nsm,
                                      proj=z, proj_col=cfg.q_lora_rank, kv_norm=self.kv_norm,
                                      eps=cfg.rms_norm_eps, defer=self.defer)  # [M, H, 512] bf16, or the partials
            # W_UV per head and the sigmoid gate (g read in place from the projection output); k3ref.bytes counts
            # W_UV in this stage
            y = mla_uv_gate(o_lat, self.W_UV, z, g_col=cfg.q_lora_rank + cfg.kv_cache_dim)
        with stage("k3.o_proj"):
            self._out(y, self.o_proj, blocks, p1, x_mlp, partial, partial_out)


class FusedMoE:
    """The MoE half on the fused kernels: router + latent down + top-k + shared gate/up, the MXFP4 routed experts,
    and the tail (routed_expert_norm + latent up + shared down + add). Every token is independent, so any number of
    rows runs as chunks of at most 64 (the kernels' widest batch bucket).

    ``experts``: the routed experts already in the kernel layout (prepare_mxfp4_experts), or None to re-lay
    ``m``'s checkpoint tensors here. ``workspace``: the experts kernel's scratch, which layers that run one after
    another on one stream may share (None: one of its own)."""

    MAX_ROWS = 64

    def __init__(self, cfg: K3Config, m: MoEWeights, *, plan: DecodePlan = DEFAULT_PLAN, experts=None,
                 workspace=None):
        from .kernels.moe_mxfp4_experts import make_workspace, prepare_mxfp4_experts
        from .kernels.router_down_topk import prepare_front_shared_weight
        if not isinstance(m, MoEWeights):
            raise TypeError("m: expected MoEWeights (layer 0's dense MLP has no fused path)")
        self.cfg, self.plan = cfg, plan
        self.experts = experts if experts is not None else prepare_mxfp4_experts(
            m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed, m.w2_scale)
        # [W_r; W_down; shared gate/up]: the front reads x once for the router, the latent and the shared experts
        self.front = prepare_front_shared_weight(m.gate, m.down, m.shared_gate, m.shared_up)
        self.shared = m.shared_gate.shape[0]
        self.e_bias = m.e_score_correction_bias.float().contiguous()
        self.tail_norm, self.up, self.shared_down = m.norm.contiguous(), m.up, m.shared_down
        self.workspace = workspace if workspace is not None or m.gate.device.type != "cuda" else \
            make_workspace(cfg.routed_expert_hidden_size, m.gate.device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, d] bf16 -> the MoE output [M, d] (into ``out`` when given)."""
        if x.shape[0] <= self.MAX_ROWS:
            return self._rows(x, out)
        if out is None:
            out = torch.empty_like(x)
        for i in range(0, x.shape[0], self.MAX_ROWS):
            self._rows(x[i:i + self.MAX_ROWS], out[i:i + self.MAX_ROWS])
        return out

    def _rows(self, x, out):
        from .kernels.moe_mxfp4_experts import make_workspace, moe_mxfp4_experts
        cfg = self.cfg
        with stage("k3.router"):
            z, ids, ws, h = router_front(x, self.front, self.e_bias, shared=self.shared, n_experts=cfg.num_experts,
                                         top_k=cfg.num_experts_per_token, scaling=cfg.routed_scaling_factor,
                                         plan=self.plan)
        if self.workspace is None:
            self.workspace = make_workspace(cfg.routed_expert_hidden_size, x.device)
        with stage("k3.moe.experts"):
            r = moe_mxfp4_experts(z, ids, ws, self.experts, None, None, None, situ_beta=cfg.situ_beta,
                                  situ_linear_beta=cfg.situ_linear_beta, workspace=self.workspace,
                                  alt_parts=None if self.plan.experts_alt_items else 0)
        return moe_tail_any(r, self.tail_norm, self.up, h, self.shared_down, eps=cfg.rms_norm_eps, out=out,
                            plan=self.plan)


# ----------------------------------------------------------------------------------------------- the layer

class FastImpl:
    """One decoder layer's decode step on the fused kernels: ``attn(io)``, ``moe(io)`` and ``layer(io)`` read and
    write only ``io``'s static tensors, so each can be captured in a CUDA graph after one eager call (which
    compiles the kernels and allocates the scratch buffers)."""
    name = "fast"

    def __init__(self, cfg: K3Config, w: LayerWeights, *, plan: DecodePlan = DEFAULT_PLAN, max_batch: int = 64):
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan: expected a DecodePlan, got {type(plan).__name__}")
        if not 1 <= max_batch <= 64:
            raise ValueError(f"max_batch must be in 1..64 (the kernels' largest batch bucket), got {max_batch}")
        if not isinstance(w.mlp, MoEWeights):
            raise ValueError("FastImpl covers the MoE layers (1..92); layer 0's dense MLP has no fused path")
        self.cfg, self.w, self.plan = cfg, w, plan
        self.kda = self.mla = self.stock_attn = None
        if isinstance(w.attn, KDAWeights):
            self.kda = FusedKDA(cfg, w, plan=plan)
        elif plan.mla_attention == "fused":
            self.mla = FusedMLA(cfg, w, plan=plan)
        else:
            from .stock.layer import StockImpl
            # the attention half only: FusedMoE serves the MoE half, so no Marlin copy of the experts
            self.stock_attn = StockImpl(cfg, w, max_batch=max_batch, with_moe=False)
        self.fused_moe = FusedMoE(cfg, w.mlp, plan=plan)
        # the record's fast_variant: "default", or the fields that differ from the shipped plan
        diff = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
                if getattr(plan, f.name) != getattr(DEFAULT_PLAN, f.name)}
        self.variant = "default" if not diff else ", ".join(f"{k}={v}" for k, v in diff.items())

    def attn(self, io) -> None:
        if self.stock_attn is not None:
            return self.stock_attn.attn(io)
        if self.mla is not None:
            if io.mla_step is not None:
                step = io.mla_step
                pages, table, seqlens = step.pages, step.block_table, step.seqlens
            else:
                from .layer_io import mla_paged_view
                pages, table, seqlens = mla_paged_view(io.state, io.slots)
            return self.mla(io.blocks, io.partial, io.delta, pages, table, seqlens, io.x_mlp)
        self.kda(io.blocks, io.partial, io.delta, io.state.conv, io.state.recurrent, io.slots, io.x_mlp)

    def moe(self, io) -> None:
        self.fused_moe(io.x_mlp, out=io.out)

    def layer(self, io) -> None:
        self.attn(io)
        self.moe(io)


# ------------------------------------------------------------------------------------------------- warm-up

def _warm_attention_ends(cfg: K3Config, layers, batches, N: int, Kp: int, *, plan: DecodePlan, device) -> None:
    """Compile the two ends every attention half shares for these layers: AttnRes #1 + input RMSNorm + the packed
    [N, d] projection, and o_proj (input width Kp) + AttnRes #2 + post-attention RMSNorm, on the plan's paths."""
    from .kernels import gemm_wgmma_splitk, oproj_attnres, rms_gemv, rms_gemv_ring
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    # the AttnRes sites: (blocks mixed, has a delta, block written) for AttnRes #1 and #2 of each layer
    in_sites, out_sites = set(), set()
    for l in layers:
        boundary, nb = cfg.is_block_boundary(l), cfg.num_blocks_before(l)
        in_sites.add((nb, l > 0, l // cfg.attn_res_block_size if boundary else -1))
        out_sites.add((nb + int(boundary), True, -1))
    by_engine: dict[str, list[int]] = {}
    for M in batches:
        by_engine.setdefault(plan.in_proj_engine(M, d, N)[0], []).append(M)
    for engine, ms in by_engine.items():
        if engine == "ring":
            rms_gemv_ring.warmup(ms, K=d, N=N, sites=sorted(in_sites), eps=eps)
        elif engine == "fma":
            rms_gemv.warmup(ms, K=d, N=(N,), sites=sorted(in_sites), eps=eps, early_trigger=True)
        elif engine == "cublas":
            rms_gemv.warmup(ms, K=d, N=(N,), sites=sorted(in_sites), eps=eps)
        else:       # the norm kernel launching its GEMM right after its wait
            rms_gemv.warmup(ms, K=d, sites=sorted(in_sites), eps=eps, norm_triggers=(True,))
            if engine == "norm+ring_mma":
                rms_gemv_ring.warmup(ms, K=d, N=N, sites=(), eps=eps, mma_shapes=[(N, d)])
            else:
                for M in ms:
                    gemm_wgmma_splitk.warmup(N, d, [M], **plan.in_proj_engine(M, d, N)[1])
    fused = [M for M in batches if plan.o_proj_engine(M, Kp, d) == "fused"]
    apart = [M for M in batches if M not in fused]
    if fused:
        oproj_attnres.warmup([Kp], sorted({s[0] for s in out_sites}), fused, device=device)
    if apart:
        rms_gemv.warmup(apart, K=d, sites=sorted(out_sites), eps=eps)
        wide = [M for M in apart if plan.o_proj_engine(M, Kp, d) == "wgmma"]
        if wide:
            gemm_wgmma_splitk.warmup(d, Kp, wide)


def warmup(cfg: K3Config, layers, batches, *, plan: DecodePlan = DEFAULT_PLAN, nsm: int = 132,
           device=None, null_slot: bool = False, experts_layout: str = "rot") -> int:
    """Compile every kernel FastImpl runs for these layer indices and batch sizes under ``plan`` (and, with
    ``device``, allocate the kernels' per-device workspaces), so that nothing compiles on the hot path or inside a
    CUDA-graph capture. ``null_slot`` and ``experts_layout``: as the layer's FusedKDA and prepared experts have
    them. Returns the number of kernels compiled by this call. Needs the CuTe DSL, not a GPU."""
    from .kernels import kda_conv_gate_step, moe_mxfp4_experts, moe_tail, rms_gemv, router_down_topk
    from .kernels._dsl import COMPILE_LOG
    n0 = len(COMPILE_LOG)
    batches = sorted(set(batches))
    if not batches or batches[0] < 1 or batches[-1] > 64:
        raise ValueError(f"batches must lie in 1..64, got {batches}")
    eps = cfg.rms_norm_eps
    kda_layers = [l for l in layers if cfg.is_kda_layer(l)]
    if kda_layers:
        H = cfg.kda_heads
        _warm_attention_ends(cfg, kda_layers, batches, kda_conv_gate_step.proj_width(H), H * cfg.kda_head_dim,
                             plan=plan, device=device)
        kda_conv_gate_step.warmup(H, batches, lower_bound=cfg.gate_lower_bound, eps=eps, early_trigger=True,
                                  null_slot=null_slot)
    mla_layers = [l for l in layers if not cfg.is_kda_layer(l) and cfg.is_moe_layer(l)]
    if mla_layers and plan.mla_attention == "fused":
        from .kernels import mla_latent_decode, mla_uv_gate
        _warm_attention_ends(cfg, mla_layers, batches, cfg.q_lora_rank + cfg.kv_cache_dim +
                             cfg.mla_heads * cfg.v_head_dim, cfg.mla_heads * cfg.v_head_dim, plan=plan,
                             device=device)
        # RMSNorm(q_a) + the absorbed query projection: one AttnRes source, no delta
        rms_gemv.warmup(batches, K=cfg.q_lora_rank, N=(cfg.mla_heads * cfg.kv_cache_dim,), sites=[(0, False, -1)],
                        eps=eps, strided_p=True)
        defer = plan.mla_combine == "uv_gate"
        mla_latent_decode.warmup([cfg.mla_heads], append=(True,), defer=(defer,))
        mla_uv_gate.warmup(batches, combine=(defer,))
    # the MoE half, the same in every layer from 1 on
    fronts = [M for M in batches if plan.front_engine(M) == "fused"]
    if fronts:
        router_down_topk.warmup(cfg.shared_intermediate, fronts, device=device)
    if len(fronts) < len(batches):
        router_down_topk.warmup(cfg.shared_intermediate, [M for M in batches if M not in fronts], fused=False,
                                device=device)
    moe_mxfp4_experts.warmup(cfg, batches, nsm=nsm, alt_parts=None if plan.experts_alt_items else 0,
                             layout=experts_layout)
    tails = [M for M in batches if plan.tail_engine(M) == "fused"]
    if tails:
        moe_tail.warmup(cfg.shared_intermediate, tails)
    return len(COMPILE_LOG) - n0
