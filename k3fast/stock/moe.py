"""The "stock" routed-expert path that vLLM 0.33.0 runs for Kimi K3's MXFP4 experts on H200 (SM90).

What vLLM 0.33.0 actually runs on Hopper (read from the wheel; notes/vllm_marlin_mxfp4.md has the
citations):

* K3's experts are compressed-tensors ``mxfp4-pack-quantized`` (FLOAT, 4 bit, GROUP 32, symmetric,
  no input quant), so ``CompressedTensorsMoEMethod.get_moe_method`` picks
  ``CompressedTensorsW4A4Mxfp4MoEMethod``. That class does NOT go through the mxfp4 oracle's priority
  list (where Humming is moved ahead of Marlin on SM90 by ``prioritize_humming``); it consults
  ``select_mxfp4_moe_backend`` only for ``--moe-backend b12x`` or a FlashInfer MoE-EP backend.
  Otherwise: CUTLASS W4A4 if ``ops.mxfp4_experts_quant_supported(cc)`` (SM100..SM119 only), XPU on
  XPU, else **MarlinExperts (W4A16: BF16 activations, MXFP4 weights, E8M0 scales)**. So with default
  flags H200 runs Marlin, not Humming / Triton / FlashInfer-CUTLASS.
* Weights: w13 = cat([w1, w3], dim=rows) (gate first, NOT interleaved); ``prepare_moe_fp4_layer_for_
  marlin`` repacks every expert with ``gptq_marlin_repack`` and permutes the E8M0 scales.
* Activation: ``MoEActivation.SITU`` is a first-class MoE activation. Marlin runs GEMM1 into a BF16
  buffer, then ``apply_moe_activation`` -> ``torch.ops._C.situ_and_mul(out, in, beta, linear_beta)``
  (gate = first half = w1 rows, up = second half = w3 rows), then GEMM2. No fused epilogue, no trick.
* Routing weights: ``apply_router_weight_on_input=False``; GEMM2 runs with ``mul_topk_weights=True``
  (the weight multiplies each BF16 (token, expert) output row in the GEMM2 epilogue), then
  ``ops.moe_sum`` reduces the 16 rows per token.

Per call (B <= 403 tokens => moe block size 8) that is 6 launches; see ``KERNELS_EXPECTED``.

Importing this module needs only torch. vLLM and a GPU are needed only to build/call
``MarlinMXFP4Experts``. ``reference_experts`` is pure torch (CPU is fine).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch

TOPK = 16                     # num_experts_per_token
SITU_BETA = 4.0               # activation_situ_beta
SITU_LINEAR_BETA = 25.0       # activation_situ_linear_beta
GROUP = 32                    # MXFP4 block size (one E8M0 byte per 32 input columns)

# Launches per __call__ for B * 16 routed rows, E = 896 experts, no EP, BF16 activations.
# (name, what it does). Marlin picks moe_block_size = 8 while B*16/E/8 < 0.9 (B <= 403), 16 above.
KERNELS_EXPECTED: list[tuple[str, str]] = [
    ("vllm::moe::moe_align_block_size_kernel<int32>",
     "grid=2: block 0 counts rows per expert, scans, writes expert_ids and num_tokens_post_pad; "
     "block 1 fills sorted_token_ids with the sentinel. (E=896 > 64 rules out the 1-kernel "
     "small-batch variant.)"),
    ("vllm::moe::count_and_sort_expert_tokens_kernel<int32>",
     "scatters each (token, slot) row index into its expert's padded segment (atomics on cumsum)"),
    ("marlin_moe_wna16::Marlin<bf16 x fe2m1f, scales fe8m0, group 32, m_block_size_8>",
     "GEMM1: [B*16, dL] x w13^T -> [B*16, 2I] BF16 (fp32 accumulate, fp32 global reduce via c_tmp)"),
    ("vllm::situ_and_mul_kernel<c10::BFloat16>",
     "SiTU-GLU: [B*16, 2I] -> [B*16, I] BF16, gate = cols [0, I) (w1), up = cols [I, 2I) (w3)"),
    ("marlin_moe_wna16::Marlin<...> (same template family, top_k=1, mul_topk_weights=True)",
     "GEMM2: [B*16, I] x w2^T -> [B*16, dL] BF16, each row times its BF16-rounded routing weight"),
    ("vllm::moe::moe_sum_vec_dynamic_kernel<c10::BFloat16> (or moe_sum_scalar_kernel)",
     "ops.moe_sum: [B, 16, dL] -> [B, dL] BF16 (topk=16 has no fixed-TOPK specialisation; "
     "specialisations exist for 1, 2, 4, 6, 8, 9)"),
]


# --------------------------------------------------------------------------------------------
# Pure-torch reference (CPU)
# --------------------------------------------------------------------------------------------

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Exact MXFP4 dequantisation: packed [..., n, k/2] uint8, scale [..., n, k/32] uint8 ->
    [..., n, k]. Low nibble = even column; code bit 3 = sign; low 3 bits index
    {0, .5, 1, 1.5, 2, 3, 4, 6}; value = +-mag * 2^(s-127) (byte 255 -> NaN, as in OCP E8M0).
    Every value is exact in fp32 and (for scales in BF16's range) in bf16."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError("packed and scale must be uint8")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != k:
        raise ValueError(f"shape mismatch: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    pos = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    table = torch.cat([pos, -pos])                                    # codes 0..15
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    vals = table[codes]                                               # [..., n, k]
    s = scale.to(torch.int32)
    # 2^(s-127) built from fp32 bits: exact for every byte (s=0 is the subnormal 2^-127).
    mult = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23).view(torch.float32)
    mult = torch.where(s == 255, torch.full_like(mult, float("nan")), mult)
    vals = (vals.unflatten(-1, (-1, GROUP)) * mult.unsqueeze(-1)).flatten(-2)
    return vals.to(dtype)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def situ_glu(a: torch.Tensor, c: torch.Tensor, beta: float = SITU_BETA,
             linear_beta: float | None = SITU_LINEAR_BETA) -> torch.Tensor:
    """SiTU(a, c) = [beta*tanh(a/beta)*sigmoid(a)] * [lb*tanh(c/lb)] in fp32 (vLLM SituAndMul.forward_native)."""
    a = a.float()
    c = c.float()
    g = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    if linear_beta is not None and linear_beta > 0:
        c = linear_beta * torch.tanh(c / linear_beta)
    return g * c


@torch.no_grad()
def reference_experts(z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w1_packed: torch.Tensor, w1_scale: torch.Tensor,
                      w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                      w2_packed: torch.Tensor, w2_scale: torch.Tensor, *,
                      situ_beta: float = SITU_BETA, situ_linear_beta: float = SITU_LINEAR_BETA,
                      rounding: str = "spec") -> torch.Tensor:
    """r[b] = sum_j w[b,j] * SiTU(z W1_e^T, z W3_e^T) W2_e^T, e = topk_ids[b,j]; checkpoint layout.

    Shapes: z [B, dL]; topk_ids [B, k] int; topk_weights [B, k] fp32; w1/w3_packed [E, I, dL/2],
    w1/w3_scale [E, I, dL/32], w2_packed [E, dL, I/2], w2_scale [E, dL, I/32] (all uint8).
    Only the experts that appear in ``topk_ids`` are dequantised. GEMMs are fp32 on exact weights.

    ``rounding``:
      * ``"spec"`` (default; docs/k3-layer.md §11 and §15): a, c -> bf16; SiTU in fp32 -> bf16;
        y_e -> bf16; r = bf16(sum_j w_j * fp32(y_e)) with an fp32 sum.
      * ``"marlin"``: the rounding points of the vLLM Marlin path: as "spec", but each weighted row
        is rounded, bf16(y_e * bf16(w_j)), before the fp32 sum (GEMM2 epilogue does __hmul2 in
        bf16; moe_sum is assumed to accumulate in fp32, then one bf16 rounding).
      * ``"none"``: no intermediate rounding; returns fp32.
    Returns bf16 [B, dL] (fp32 for ``"none"``).
    """
    if rounding not in ("spec", "marlin", "none"):
        raise ValueError(f"rounding must be 'spec', 'marlin' or 'none', got {rounding!r}")
    rnd = (lambda t: t) if rounding == "none" else _bf16
    B, dL = z.shape
    zf = z.float()
    ids = topk_ids.long()
    w = topk_weights.float()
    acc = torch.zeros(B, dL, dtype=torch.float32, device=z.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        W1 = dequant_mxfp4(w1_packed[e], w1_scale[e])                  # [I, dL]
        W3 = dequant_mxfp4(w3_packed[e], w3_scale[e])                  # [I, dL]
        W2 = dequant_mxfp4(w2_packed[e], w2_scale[e])                  # [dL, I]
        x = zf[tok]
        a = rnd(x @ W1.T)
        c = rnd(x @ W3.T)
        h = rnd(situ_glu(a, c, situ_beta, situ_linear_beta))
        y = rnd(h @ W2.T)
        ww = w[tok, slot].unsqueeze(1)
        contrib = _bf16(y * _bf16(ww)) if rounding == "marlin" else y * ww
        acc.index_add_(0, tok, contrib)
    return acc if rounding == "none" else acc.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# vLLM 0.33.0 Marlin MXFP4 MoE (GPU)
# --------------------------------------------------------------------------------------------

def marlin_block_size_m(num_tokens: int, topk: int, num_experts: int) -> int:
    """vLLM's ``fused_marlin_moe`` M-block choice (experts/marlin_moe.py)."""
    block_size_m = 64
    for block_size_m in (8, 16, 32, 48, 64):
        if num_tokens * topk / num_experts / block_size_m < 0.9:
            break
    return block_size_m


def _align_sizes(numel: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """Sizes of sorted_token_ids / expert_ids exactly as vLLM's ``moe_align_block_size`` wrapper."""
    max_num_tokens_padded = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        max_num_tokens_padded = min(numel * block_size, max_num_tokens_padded)
    return max_num_tokens_padded, -(-max_num_tokens_padded // block_size)


class MarlinMXFP4Experts:
    """K3 routed experts through vLLM 0.33.0's Marlin W4A16 MoE, exactly as MarlinExperts runs them
    on SM90 (no EP, no LoRA, no post-GEMM2 hook, VLLM_MARLIN_INPUT_DTYPE unset).

    Construction takes the checkpoint layout stacked over experts (uint8 everywhere):
      w1_packed, w3_packed [E, I, dL/2]; w1_scale, w3_scale [E, I, dL/32];
      w2_packed [E, dL, I/2]; w2_scale [E, dL, I/32].
    For a TP-t rank pass the rank's slice (I/t rows of w1/w3, I/(2t) bytes and I/(32t) scale columns
    of w2); vLLM's TP16 padding to 256 rows is the caller's business.

    ``__call__(z, topk_ids, topk_weights)``: z [B, dL] bf16 (contiguous), topk_ids [B, 16] int32,
    topk_weights [B, 16] fp32 -> r [B, dL] bf16. No host syncs; all scratch except the moe_align
    outputs (mode="vllm", allocated per call exactly as vLLM does, graph-pool friendly) is allocated
    here for ``max_batch`` tokens, so the call can be captured in a CUDA graph.

    ``mode``:
      * ``"vllm"`` (default): calls vLLM's own ``fused_marlin_moe`` with the arguments
        ``MarlinExperts.apply`` passes (moe_sum -> ``ops.moe_sum``, caches, workspace, output).
      * ``"unrolled"``: the same op sequence written out (``ops.moe_align_block_size`` into
        preallocated buffers, 2x ``ops.moe_wna16_marlin_gemm``, ``apply_moe_activation``,
        ``ops.moe_sum``): identical launches, nothing allocated by Python per call.
    """

    KERNELS_EXPECTED = KERNELS_EXPECTED

    def __init__(self, w1_packed: torch.Tensor, w1_scale: torch.Tensor,
                 w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                 w2_packed: torch.Tensor, w2_scale: torch.Tensor, *,
                 situ_beta: float = SITU_BETA, situ_linear_beta: float = SITU_LINEAR_BETA,
                 max_batch: int = 64, topk: int = TOPK, device: torch.device | str | None = None,
                 mode: str = "vllm"):
        # Lazy vLLM imports (the module must import without vLLM or a GPU).
        import vllm._custom_ops as ops  # noqa: F401  (loads _C / _moe_C)
        from vllm.model_executor.layers.fused_moe.activation import (
            ApplyMoEActivationConfig, MoEActivation)
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            MARLIN_MAX_BLOCKS_PER_SM, marlin_make_workspace_new)
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            prepare_moe_fp4_layer_for_marlin)
        from vllm.scalar_type import scalar_types

        if mode not in ("vllm", "unrolled"):
            raise ValueError(f"mode must be 'vllm' or 'unrolled', got {mode!r}")
        for name, t in (("w1_packed", w1_packed), ("w1_scale", w1_scale), ("w3_packed", w3_packed),
                        ("w3_scale", w3_scale), ("w2_packed", w2_packed), ("w2_scale", w2_scale)):
            if t.dtype != torch.uint8 or t.dim() != 3:
                raise TypeError(f"{name} must be a 3-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        E, I, half_dL = w1_packed.shape
        dL = half_dL * 2
        if w3_packed.shape != (E, I, half_dL) or w2_packed.shape != (E, dL, I // 2):
            raise ValueError("w1/w3_packed must be [E, I, dL/2] and w2_packed [E, dL, I/2]")
        if (w1_scale.shape != (E, I, dL // GROUP) or w3_scale.shape != (E, I, dL // GROUP)
                or w2_scale.shape != (E, dL, I // GROUP)):
            raise ValueError("scales must be [E, I, dL/32] (w1, w3) and [E, dL, I/32] (w2)")
        # Marlin MoE constraints (marlin_utils.check_moe_marlin_supports_config, ops.cu checks).
        # moe_align_block_size: padded_num_experts = ceil(E/32)*32 must be < 1024.
        if dL % 128 or I % 64 or -(-E // 32) * 32 >= 1024:
            raise ValueError(f"unsupported shape for Marlin MoE: E={E}, I={I}, dL={dL}")

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())

        self.num_experts, self.intermediate, self.hidden = E, I, dL
        self.topk, self.max_batch, self.mode, self.device = topk, max_batch, mode, device
        self.quant_type = scalar_types.float4_e2m1f
        self.activation = MoEActivation.SITU
        # What ApplyMoEActivationConfig.from_configs builds for K3 (no clamp / alpha / beta).
        self.activation_config = ApplyMoEActivationConfig(
            activation_situ_beta=float(situ_beta),
            activation_situ_linear_beta=float(situ_linear_beta))

        # ---- weights: the exact vLLM repack (CompressedTensorsW4A4Mxfp4MoEMethod.
        # process_weights_after_loading -> prepare_moe_fp4_layer_for_marlin(layer)), on a shim layer.
        layer = torch.nn.Module()
        layer.moe_config = SimpleNamespace(num_local_experts=E, hidden_dim=dL,
                                           intermediate_size_per_partition=I)
        layer.params_dtype = torch.bfloat16
        P = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        # w13 rows: [w1 (gate); w3 (up)] -- RoutedExperts._load_w13 puts w1 first, w3 second.
        layer.w13_weight = P(torch.cat([w1_packed.to(device), w3_packed.to(device)], dim=1).contiguous())
        layer.w13_weight_scale = P(torch.cat([w1_scale.to(device), w3_scale.to(device)], dim=1).contiguous())
        layer.w2_weight = P(w2_packed.to(device).contiguous())
        layer.w2_weight_scale = P(w2_scale.to(device).contiguous())
        with torch.cuda.device(device):
            prepare_moe_fp4_layer_for_marlin(layer)   # input_dtype=None, as the W4A4 method calls it
        self.w13 = layer.w13_weight.data              # int32 [E, dL/16, 2*(2I)]
        self.w2 = layer.w2_weight.data                # int32 [E, I/16, 2*dL]
        self.w13_scale = layer.w13_weight_scale.data  # float8_e8m0fnu [E, dL/32, 2I]
        self.w2_scale = layer.w2_weight_scale.data    # float8_e8m0fnu [E, I/32, dL]
        del layer

        # ---- scratch, sized for max_batch (MarlinExperts.workspace_shapes; note the swap there:
        # workspace2 -> intermediate_cache13, workspace13 -> intermediate_cache2).
        rows = max_batch * topk
        self.cache13 = torch.empty(rows * max(2 * I, dL), dtype=torch.bfloat16, device=device)
        self.cache2 = torch.empty(rows * max(I, dL), dtype=torch.bfloat16, device=device)
        # Marlin locks: get_marlin_workspace's size (SMs * MARLIN_MAX_BLOCKS_PER_SM), zero-initialised
        # once; the kernel leaves them zero after each call.
        self.workspace = marlin_make_workspace_new(device, MARLIN_MAX_BLOCKS_PER_SM)
        # moe_align outputs for mode="unrolled": worst case over block sizes, sliced per call.
        max_sorted = max(_align_sizes(rows, E, bs)[0] for bs in (8, 16, 32, 48, 64))
        self.sorted_ids_buf = torch.empty(max_sorted, dtype=torch.int32, device=device)
        self.expert_ids_buf = torch.empty(max_sorted, dtype=torch.int32, device=device)
        self.num_tokens_post_pad = torch.empty(1, dtype=torch.int32, device=device)

    # ------------------------------------------------------------------------------------------
    def block_size_m(self, num_tokens: int) -> int:
        return marlin_block_size_m(num_tokens, self.topk, self.num_experts)

    def _check(self, z, topk_ids, topk_weights):
        B = z.shape[0]
        if B > self.max_batch:
            raise ValueError(f"batch {B} > max_batch {self.max_batch}")
        if z.dtype != torch.bfloat16 or z.shape[1] != self.hidden or not z.is_contiguous():
            raise ValueError(f"z must be contiguous bf16 [B, {self.hidden}]")
        if topk_ids.shape != (B, self.topk) or topk_weights.shape != (B, self.topk):
            raise ValueError(f"topk_ids / topk_weights must be [B, {self.topk}]")
        if topk_weights.dtype != torch.float32:
            raise TypeError("topk_weights must be fp32 (the Marlin kernel reads a float*)")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("topk_ids must be int32 (or int64)")
        if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
            raise ValueError("topk_ids / topk_weights must be contiguous (kernels index them flat)")

    def __call__(self, z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(z, topk_ids, topk_weights)
        if out is None:
            out = torch.empty_like(z)             # vLLM: hidden_states.new_empty(...)
        if z.shape[0] == 0:
            return out
        if self.mode == "vllm":
            return self._call_vllm(z, topk_ids, topk_weights, out)
        return self._call_unrolled(z, topk_ids, topk_weights, out)

    def _call_vllm(self, z, topk_ids, topk_weights, out):
        import vllm._custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe

        def moe_sum(inp, output, topk_ids, expert_map):      # MarlinExperts.moe_sum, no EP
            ops.moe_sum(inp, output)

        fused_marlin_moe(
            hidden_states=z, w1=self.w13, w2=self.w2, bias1=None, bias2=None,
            w1_scale=self.w13_scale, w2_scale=self.w2_scale,
            topk_weights=topk_weights, topk_ids=topk_ids,
            quant_type_id=self.quant_type.id,
            apply_router_weight_on_input=False,
            global_num_experts=self.num_experts,
            activation=self.activation, activation_func=None,
            activation_config=self.activation_config,
            moe_sum=moe_sum, expert_map=None,
            workspace=self.workspace,
            intermediate_cache13=self.cache13, intermediate_cache2=self.cache2,
            output=out, input_dtype=None, mul_topk_weights_in_gemm2=True)
        return out

    def _call_unrolled(self, z, topk_ids, topk_weights, out):
        import vllm._custom_ops as ops
        from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation

        M, K = z.shape
        E, N, topk = self.num_experts, self.intermediate, self.topk
        bs = self.block_size_m(M)
        n_sorted, n_blocks = _align_sizes(M * topk, E, bs)
        sorted_ids = self.sorted_ids_buf[:n_sorted]
        expert_ids = self.expert_ids_buf[:n_blocks]
        ntpp = self.num_tokens_post_pad
        # 2 launches (align + count_and_sort); expert_map=None, scatter_idx=None.
        ops.moe_align_block_size(topk_ids, E, bs, sorted_ids, expert_ids, ntpp, None, None)

        cache1 = self.cache13[: M * topk * 2 * N].view(M * topk, 2 * N)
        cache2 = self.cache2[: M * topk * N].view(M * topk, N)
        cache3 = self.cache13[: M * topk * K].view(M * topk, K)   # reuses cache1's storage, as vLLM

        ops.moe_wna16_marlin_gemm(
            z, cache1, self.w13, None, self.w13_scale, None, None, None, self.workspace,
            sorted_ids, expert_ids, ntpp, topk_weights,
            moe_block_size=bs, top_k=topk, mul_topk_weights=False, b_q_type=self.quant_type,
            size_m=M, size_n=2 * N, size_k=K,
            use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False)
        apply_moe_activation(self.activation, cache2, cache1,
                             activation_config=self.activation_config)   # situ_and_mul
        ops.moe_wna16_marlin_gemm(
            cache2, cache3, self.w2, None, self.w2_scale, None, None, None, self.workspace,
            sorted_ids, expert_ids, ntpp, topk_weights,
            moe_block_size=bs, top_k=1, mul_topk_weights=True, b_q_type=self.quant_type,
            size_m=M * topk, size_n=K, size_k=N,
            use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False)
        ops.moe_sum(cache3.view(M, topk, K), out)
        return out

    # ------------------------------------------------------------------------------------------
    def capture_graph(self, batch: int, warmup: int = 3):
        """Capture one call for ``batch`` tokens. Returns (graph, (z, topk_ids, topk_weights), out):
        fill the static inputs in place, then ``graph.replay()``."""
        dev = self.device
        z = torch.zeros(batch, self.hidden, dtype=torch.bfloat16, device=dev)
        ids = (torch.arange(batch * self.topk, device=dev) % self.num_experts).to(torch.int32)
        ids = ids.view(batch, self.topk).contiguous()
        w = torch.full((batch, self.topk), 1.0 / self.topk, dtype=torch.float32, device=dev)
        out = torch.empty(batch, self.hidden, dtype=torch.bfloat16, device=dev)
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(warmup):
                self(z, ids, w, out=out)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self(z, ids, w, out=out)
        return g, (z, ids, w), out


def expected_launch_names() -> Sequence[str]:
    return [name for name, _ in KERNELS_EXPECTED]
