"""``stock``: what a serving stack runs on Hopper from library kernels, the peer the fused layer is measured against.

* cuBLAS GEMMs through torch, packed the way vLLM packs them (one in_proj GEMM for q|k|v|g|f_a|b, one gate_up GEMM
  for the shared experts, one q_a|kv_a|g GEMM for MLA);
* fla's Triton KDA kernels: the conv update, the fused recurrent step with the in-kernel lower-bounded gate, the
  gated RMSNorm;
* vLLM 0.33's Marlin W4A16 MoE for the MXFP4 experts (docs/vllm-marlin-mxfp4.md);
* ``ops="vllm"`` (variant "vllm-ops"): vLLM 0.33's own fused kernels for AttnRes, the router (GateLinear + fused
  grouped top-k), the shared experts' SiTU, the RMSNorms and the MLA gate (k3fast.stock.vllm_ops); ``ops="torch"``
  (variant "torch-glue", also the fallback where vLLM cannot run) composes those steps from torch ops;
* MLA: packed GEMMs and a torch absorbed attention over the latent cache.

``ops="vllm-layer"`` (variant "vllm-layer") runs what vLLM 0.33's own layer runs on SM90, kernel for kernel: on top
of the vllm-ops kernels, vLLM's KDA decode at this head count (its Triton path at TP16's 6 heads, its native fused op
at 12 / 96; k3fast.stock.vllm_ops.kda_decode_core), K3's low-latency GEMM table (CuTe skinny GEMMs and the dsv3
fused-A GEMM) on every projection whose local shape the table lists, as vLLM installs it, and the FLASH_ATTN_MLA
decode of the MLA layers (k3fast.stock.mla.FA3MLADecodeCore). ``vllm_ops.KERNELS_VLLM_LAYER_B1`` lists its launches
beside the ones recorded from vLLM's engine. It is the default: against vLLM 0.33's own KDA+MoE and MLA+MoE layers
inside engines on the same H100 its summed kernel time is within 5 % at batch 1 / 8 / 64 at the TP16 and TP8 ranks
(traces/index.json's ``vllm_layer_check_h100`` beside ``vllm_layers_h100``; ``python -m k3fast.measure.report
--engine-match``). "vllm" (variant
"vllm-ops": fla's KDA kernels with torch glue, cuBLAS projections, FlashMLA) stays as the composition a user of
vLLM's ops would write by hand, and as the fallback where FlashAttention-3 or K3's own ops are missing.

Like every implementation it exposes ``attn(io)``, ``moe(io)`` and ``layer(io)`` over k3fast.layer_io.LayerIO's
static tensors; stages are marked with k3fast.nvtx ranges.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3ref import K3Config, Precision, ResidualStream
from k3ref.attnres import pre_attention, pre_mlp
from k3ref.kda import kda_core, kda_projections
from k3ref.mla import mla_core, mla_latents, mla_output
from k3ref.moe import route, routed_experts, shared_experts
from k3ref.norms import rms_norm, situ_glu
from k3ref.state import KDAState, MLACache
from k3ref.weights import KDAWeights, LayerWeights, MoEWeights

from ..layer_io import LayerIO
from ..nvtx import stage


def _linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 -> FP32 GEMM (cuBLAS through torch.mm's out_dtype where available)."""
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return F.linear(x, w).float()


def _fa3_core_type():
    from .mla import FA3MLADecodeCore
    return FA3MLADecodeCore


# ops -> the record's stock_variant
OPS = {"vllm-layer": "vllm-layer", "vllm": "vllm-ops", "torch": "torch-glue"}


def default_variant() -> tuple[str, str | None]:
    """The variant ``StockImpl()`` runs on this machine (its default ``ops``, CUDA weights) and why it fell back
    (None when it did not): what a record names as its stock before any layer is built."""
    from .vllm_ops import vllm_available, vllm_layer_available
    ok, why = vllm_layer_available()
    if ok:
        return OPS["vllm-layer"], None
    ok2, why2 = vllm_available()
    return (OPS["vllm"], why) if ok2 else (OPS["torch"], why2)


class StockImpl:
    """Library kernels, packed the way a serving stack packs them (one in_proj GEMM for q|k|v|g|f_a|b,
    one gate_up GEMM for the shared experts, one q_a|kv_a|g GEMM for MLA).

    ``ops``: "vllm-layer" (default) runs what vLLM 0.33's own layer runs (module docstring); "vllm" runs vLLM 0.33's
    fused kernels for AttnRes (Triton, p += delta and the block
    write in place, output RMSNorm fused), the router (GateLinear bf16 x bf16 -> fp32 + fused sigmoid/bias
    grouped top-k with renormalisation), the shared experts' SiTU (``_C.situ_and_mul``), the RMSNorms
    (``_C.rms_norm``; MLA's q_a/kv_a norms through vLLM's fused q/kv RMSNorm) and the MLA output gate, and pads
    the packed KDA in_proj to 16 rows as vLLM's in_proj_qkvgfab; "torch" keeps the torch-op glue. "vllm" falls
    back to "torch" when vLLM cannot run here (``stock_vllm_ops.vllm_available()``; reason in
    ``self.ops_fallback``). ``self.variant`` records what runs: "vllm-ops" or "torch-glue". Both are CUDA-graph
    capturable; the vllm ops that compile on first use (Triton AttnRes / q-kv norm, CuTe ll_bf16_gemm,
    torch.compile gate) need one eager call before capture. ``with_moe=False`` builds the attention half only (no
    Marlin copy of the experts, so no vLLM needed for it): what FastImpl runs on an MLA layer's stock attention."""
    name = "stock"

    def __init__(self, cfg: K3Config, w: LayerWeights, *, max_batch: int = 64, ops: str = "vllm-layer",
                 with_moe: bool = True):
        from .kda import pack_conv_weight
        if ops not in OPS:
            raise ValueError(f"ops must be one of {sorted(OPS)}, got {ops!r}")
        self.ops_fallback = None
        if ops == "vllm-layer":
            from .vllm_ops import vllm_layer_available
            ok, why = vllm_layer_available()
            if not ok:
                import warnings
                warnings.warn(f"StockImpl: vLLM's layer path unavailable ({why}); using the vllm-ops variant",
                              stacklevel=2)
                ops, self.ops_fallback = "vllm", why
        if ops == "vllm":
            from .vllm_ops import vllm_available
            ok, why = vllm_available()
            if ok and not w.input_layernorm.is_cuda:
                ok, why = False, "weights are not on a CUDA device"
            if not ok:
                import warnings
                warnings.warn(f"StockImpl: vLLM ops unavailable ({why}); using the torch-glue variant", stacklevel=2)
                ops, self.ops_fallback = "torch", why
        self.ops = ops
        self.variant = OPS[ops]
        self.cfg, self.w, self.P = cfg, w, Precision.model()
        a = w.attn
        if isinstance(a, KDAWeights):
            self.in_proj = torch.cat([a.q_proj, a.k_proj, a.v_proj, a.g_proj, a.f_a_proj, a.b_proj]).contiguous()
            if ops in ("vllm", "vllm-layer"):
                # vLLM's in_proj_qkvgfab pads each rank's rows to a multiple of 16 (kda.py: 10 rows at TP16,
                # 4 at TP8): same GEMM shape as vLLM; the padded output columns are never read.
                pad = -self.in_proj.shape[0] % 16
                if pad:
                    self.in_proj = torch.cat([self.in_proj, self.in_proj.new_zeros(pad, self.in_proj.shape[1])])
            self.kda_w = {"conv_q": a.q_conv.view(-1, 4), "conv_k": a.k_conv.view(-1, 4), "conv_v": a.v_conv.view(-1, 4),
                          "A_log": a.A_log, "dt_bias": a.dt_bias, "o_norm": a.o_norm}
            self.kda_w["conv_qkv"] = pack_conv_weight(self.kda_w)
            if ops == "vllm-layer":
                from .vllm_ops import native_conv_weight, native_kda_decode
                # vLLM keeps K3's conv1d weight in fp32 (params_dtype=torch.float32) for both decode paths
                self.kda_w["conv_qkv"] = self.kda_w["conv_qkv"].float()
                if native_kda_decode(cfg.kda_heads):
                    self.kda_w["conv_native"] = native_conv_weight(self.kda_w["conv_qkv"], cfg.kda_proj)
        else:
            self.mla_a = torch.cat([a.q_a_proj, a.kv_a_proj_with_mqa, a.g_proj]).contiguous()
            # the MLA core over the cache: vLLM's FLASH_ATTN_MLA path (vllm-layer), FlashMLA (vllm-ops), else k3ref's
            self.mla_core, self.mla_core_variant = None, "k3ref mla_core (torch)"
            if ops == "vllm-layer":
                from .mla import FA3MLADecodeCore, fa3_mla_available
                ok, why = fa3_mla_available()
                if ok:
                    self.mla_core = FA3MLADecodeCore(cfg, a)
                    self.mla_core_variant = "vllm fa3 split-kv (FLASH_ATTN_MLA)"
                    # vLLM's fused_qkv_a projection (q_a | kv_a) on K3's low-latency table, g_proj apart: the
                    # leading rows of the packed weight, a view
                    self.mla_qkv_a = self.mla_a[:cfg.q_lora_rank + cfg.kv_cache_dim]
                else:
                    self.mla_core_variant += f"; fa3 mla unavailable: {why}"
            if ops in ("vllm", "vllm-layer") and self.mla_core is None:
                from .mla import FlashMLADecodeCore, flashmla_available
                ok, why = flashmla_available()
                if ok:
                    self.mla_core, self.mla_core_variant = FlashMLADecodeCore(cfg, a), "vllm flashmla (dense bf16)"
                else:
                    self.mla_core_variant += f"; flashmla unavailable: {why}"
        m = w.mlp
        self.with_moe = with_moe
        if isinstance(m, MoEWeights) and with_moe:
            from .moe import MarlinMXFP4Experts
            self.experts = MarlinMXFP4Experts(m.w1_packed, m.w1_scale, m.w3_packed, m.w3_scale, m.w2_packed, m.w2_scale,
                                              situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta,
                                              max_batch=max_batch, topk=cfg.num_experts_per_token)
            self.shared_gate_up = torch.cat([m.shared_gate, m.shared_up]).contiguous()

    def attn(self, io: LayerIO) -> None:
        if self.ops in ("vllm", "vllm-layer"):
            return self._attn_vllm(io)
        from .kda import stock_kda_core
        cfg, w, P = self.cfg, self.w, self.P
        s = ResidualStream(io.blocks, io.partial, io.delta)
        with stage("k3.attn_res"):
            x = pre_attention(s, io.layer, w.attn_res, w.input_layernorm, cfg, P)
        if isinstance(w.attn, KDAWeights):
            Pw, H = cfg.kda_proj, cfg.kda_heads
            with stage("k3.kda.in_proj"):
                z = F.linear(x, self.in_proj)
                fa = z[:, 4 * Pw:4 * Pw + cfg.kda_head_dim]
                f = F.linear(fa, w.attn.f_b_proj)
            with stage("k3.kda.core"):
                y = stock_kda_core(z[:, :Pw], z[:, Pw:2 * Pw], z[:, 2 * Pw:3 * Pw], z[:, 3 * Pw:4 * Pw], f,
                                   z[:, 4 * Pw + cfg.kda_head_dim:], io.state.conv, io.state.recurrent, io.slots,
                                   self.kda_w, head_dim=cfg.kda_head_dim, lower_bound=cfg.gate_lower_bound,
                                   eps=cfg.rms_norm_eps, null_slot=0)
            with stage("k3.o_proj"):
                a = F.linear(y, w.attn.o_proj)
        else:
            ma = w.attn
            with stage("k3.mla.in_proj"):
                z = F.linear(x, self.mla_a)
                qa, kv, g = z.split([cfg.q_lora_rank, cfg.kv_cache_dim, cfg.mla_heads * cfg.v_head_dim], dim=-1)
                cq = F.rms_norm(qa.float(), (cfg.q_lora_rank,), ma.q_a_layernorm.float(), cfg.rms_norm_eps).bfloat16()
                ckv = F.rms_norm(kv[:, :cfg.kv_lora_rank].float(), (cfg.kv_lora_rank,), ma.kv_a_layernorm.float(),
                                 cfg.rms_norm_eps).bfloat16()
                rows = torch.cat([ckv, kv[:, cfg.kv_lora_rank:]], dim=-1)
            with stage("k3.mla.q_b"):
                q = F.linear(cq, ma.q_b_proj).view(-1, cfg.mla_heads, cfg.qk_head_dim)
            with stage("k3.mla.core"):
                o = mla_core(q, rows, ma, io.state.kv, io.state.lengths, io.slots, 1, cfg, P)
            with stage("k3.o_proj"):
                a = F.linear((o.float() * torch.sigmoid(g.float())).bfloat16(), ma.o_proj)
        with stage("k3.attn_res_mlp"):
            io.x_mlp.copy_(pre_mlp(s, io.layer, a, w.mlp_res, w.post_attention_layernorm, cfg, P))
        io.partial.copy_(s.partial)

    def moe(self, io: LayerIO) -> None:
        if not self.with_moe:
            raise RuntimeError("this StockImpl was built with with_moe=False (the attention half only)")
        if self.ops in ("vllm", "vllm-layer"):
            return self._moe_vllm(io)
        cfg, m = self.cfg, self.w.mlp
        x = io.x_mlp
        with stage("k3.router"):
            s = torch.sigmoid(_linear_f32(x, m.gate))
            ids = torch.topk(s + m.e_score_correction_bias, cfg.num_experts_per_token, dim=-1, sorted=False).indices
            ws = s.gather(1, ids)
            ws = ws / ws.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        with stage("k3.moe.down"):
            z = F.linear(x, m.down)
        with stage("k3.moe.experts"):
            r = self.experts(z, ids.to(torch.int32), ws)
        with stage("k3.moe.shared"):
            ac = F.linear(x, self.shared_gate_up)
            Is = cfg.shared_intermediate
            h = situ_glu(ac[:, :Is].float(), ac[:, Is:].float(), cfg.situ_beta, cfg.situ_linear_beta).bfloat16()
            shared = F.linear(h, m.shared_down)
        with stage("k3.moe.up"):
            rn = F.rms_norm(r.float(), (r.shape[-1],), m.norm.float(), cfg.rms_norm_eps).bfloat16()
            torch.add(F.linear(rn, m.up), shared, out=io.out)

    def layer(self, io: LayerIO) -> None:
        self.attn(io)
        self.moe(io)

    # -------------------------------------------------------------------------------- vLLM-ops variant
    def _kda_attn(self, x: torch.Tensor, io: LayerIO) -> torch.Tensor:
        """KDA projections + the decode core + o_proj (in_proj may be padded): fla's kernels with torch glue
        ("vllm" / "torch"), or vLLM's own Triton decode path and skinny-GEMM o_proj ("vllm-layer")."""
        from .kda import stock_kda_core
        cfg, w = self.cfg, self.w
        Pw, hd, H = cfg.kda_proj, cfg.kda_head_dim, cfg.kda_heads
        if self.ops == "vllm-layer":
            from . import vllm_ops as V
            a = w.attn
            with stage("k3.kda.in_proj"):
                z = V.low_latency_linear(x, self.in_proj)
                f = V.low_latency_linear(z[:, 4 * Pw:4 * Pw + hd], a.f_b_proj)
            with stage("k3.kda.core"):
                # vLLM's metadata carries its null block (0) for padded rows; the harness marks them -1 and gives
                # the step's indices in vLLM's form when it builds them outside the layer, as vLLM's builder does
                slots = io.state_indices if io.state_indices is not None else io.slots.clamp_min(0)
                y = V.kda_decode_core(z[:, :3 * Pw], z[:, 3 * Pw:4 * Pw], f, z[:, 4 * Pw + hd:4 * Pw + hd + H],
                                      io.state.conv, io.state.recurrent, slots, self.kda_w["conv_qkv"], a.A_log,
                                      a.dt_bias, a.o_norm, heads=H, head_dim=hd, lower_bound=cfg.gate_lower_bound,
                                      eps=cfg.rms_norm_eps, conv_w_native=self.kda_w.get("conv_native"))
            with stage("k3.o_proj"):
                return V.low_latency_linear(y, a.o_proj)
        with stage("k3.kda.in_proj"):
            z = F.linear(x, self.in_proj)
            f = F.linear(z[:, 4 * Pw:4 * Pw + hd], w.attn.f_b_proj)
        with stage("k3.kda.core"):
            y = stock_kda_core(z[:, :Pw], z[:, Pw:2 * Pw], z[:, 2 * Pw:3 * Pw], z[:, 3 * Pw:4 * Pw], f,
                               z[:, 4 * Pw + hd:4 * Pw + hd + H], io.state.conv, io.state.recurrent, io.slots,
                               self.kda_w, head_dim=hd, lower_bound=cfg.gate_lower_bound,
                               eps=cfg.rms_norm_eps, null_slot=0)
        with stage("k3.o_proj"):
            return F.linear(y, w.attn.o_proj)

    def _attn_vllm(self, io: LayerIO) -> None:
        """As vLLM's KimiDecoderLayer: attn_res #1 (p += delta in place, block write at a boundary, input
        norm), attention, attn_res #2 (p += a in place; at a boundary p := a), writing x_mlp directly."""
        from . import vllm_ops as V
        cfg, w, l = self.cfg, self.w, io.layer
        eps = cfg.rms_norm_eps
        boundary = cfg.is_block_boundary(l)
        nb = cfg.num_blocks_before(l)
        with stage("k3.attn_res"):
            x = V.attn_res(io.blocks, nb, io.partial, io.delta, w.attn_res.norm, w.attn_res.proj,
                           w.input_layernorm, eps, l // cfg.attn_res_block_size if boundary else -1)
        if isinstance(w.attn, KDAWeights):
            a = self._kda_attn(x, io)
        elif isinstance(self.mla_core, _fa3_core_type()):
            # vLLM's own MLA decode (KimiK3MLA.forward on SM90): q_a | kv_a on the low-latency table and g_proj apart,
            # the fused q / kv RMSNorm, q_b, then the FA3 path (W_UK, concat + cache insert, split-KV, W_UV)
            ma, R = w.attn, cfg.kv_lora_rank
            with stage("k3.mla.in_proj"):
                qkv = V.low_latency_linear(x, self.mla_qkv_a)
                g = V.low_latency_linear(x, ma.g_proj)
                qa, kv = qkv.split([cfg.q_lora_rank, cfg.kv_cache_dim], dim=-1)
                cq, ckv = V.q_kv_rms_norm(qa, kv[:, :R], ma.q_a_layernorm, ma.kv_a_layernorm, eps)
            with stage("k3.mla.q_b"):
                q = V.low_latency_linear(cq, ma.q_b_proj).view(-1, cfg.mla_heads, cfg.qk_head_dim)
            with stage("k3.mla.core"):
                o = self.mla_core(q, ckv, kv[:, R:], io.state.kv, io.state.lengths, io.slots, step=io.mla_step)
            with stage("k3.o_proj"):
                a = V.low_latency_linear(V.gate_sigmoid_mul(o, g), ma.o_proj)
        else:
            ma = w.attn
            with stage("k3.mla.in_proj"):
                z = F.linear(x, self.mla_a)
                qa, kv, g = z.split([cfg.q_lora_rank, cfg.kv_cache_dim, cfg.mla_heads * cfg.v_head_dim], dim=-1)
                cq, ckv = V.q_kv_rms_norm(qa, kv[:, :cfg.kv_lora_rank], ma.q_a_layernorm, ma.kv_a_layernorm, eps)
                rows = torch.cat([ckv, kv[:, cfg.kv_lora_rank:]], dim=-1)
            with stage("k3.mla.q_b"):
                q = F.linear(cq, ma.q_b_proj).view(-1, cfg.mla_heads, cfg.qk_head_dim)
            with stage("k3.mla.core"):
                if self.mla_core is not None:
                    o = self.mla_core(q, rows, io.state.kv, io.state.lengths, io.slots)
                else:
                    o = mla_core(q, rows, ma, io.state.kv, io.state.lengths, io.slots, 1, cfg, self.P)
            with stage("k3.o_proj"):
                a = F.linear(V.gate_sigmoid_mul(o, g), ma.o_proj)
        with stage("k3.attn_res_mlp"):
            if boundary:
                # vLLM rebinds prefix_sum = a (no copy); the static p buffer needs one copy, boundary layers only
                io.partial.copy_(a)
                V.attn_res(io.blocks, nb + 1, io.partial, None, w.mlp_res.norm, w.mlp_res.proj,
                           w.post_attention_layernorm, eps, -1, out=io.x_mlp)
            else:
                V.attn_res(io.blocks, nb, io.partial, a, w.mlp_res.norm, w.mlp_res.proj,
                           w.post_attention_layernorm, eps, -1, out=io.x_mlp)

    def _moe_vllm(self, io: LayerIO) -> None:
        """As vLLM's KimiMoE + LatentMoERunner tier 1 on one rank (collectives not run): GateLinear + fused
        grouped top-k, down GEMM, Marlin experts, routed_expert_norm, up GEMM + shared; shared experts =
        gate_up GEMM, situ_and_mul, down GEMM."""
        from . import vllm_ops as V
        cfg, m = self.cfg, self.w.mlp
        x = io.x_mlp
        with stage("k3.router"):
            ids, ws = V.router_topk(x, m.gate, m.e_score_correction_bias, cfg.num_experts_per_token,
                                    cfg.routed_scaling_factor)
        # vLLM installs K3's low-latency GEMM table on every unquantized projection whose local (N, K) it lists
        # (enable_kimi_k3_low_latency_gemm: the latent down / up, and at TP8 the shared experts too); the vllm-ops
        # variant runs cuBLAS throughout
        lin = V.low_latency_linear if self.ops == "vllm-layer" else F.linear
        with stage("k3.moe.down"):
            z = lin(x, m.down)
        with stage("k3.moe.experts"):
            r = self.experts(z, ids, ws)
        with stage("k3.moe.shared"):
            h = V.situ_and_mul(lin(x, self.shared_gate_up), cfg.situ_beta, cfg.situ_linear_beta)
            shared = lin(h, m.shared_down)
        with stage("k3.moe.up"):
            rn = V.rms_norm(r, m.norm, cfg.rms_norm_eps)
            torch.add(lin(rn, m.up), shared, out=io.out)
