"""Thin wrappers around the single fused kernels that vLLM 0.33.0 itself runs for Kimi K3 on Hopper (SM90).

These replace the torch-op glue of the first stock path (27 small kernels per AttnRes, 8 for the router, 13 for
the shared SiTU, several per RMSNorm) so that ``StockImpl`` is what a competent vLLM user gets on an H200, not a
straw man. Every wrapper calls vLLM's own op with the argument conventions vLLM's K3 model uses; the citations
below are paths inside the vllm-0.33.0 wheel.

Importing this module needs only torch: vLLM is imported lazily, inside the functions. ``vllm_available()``
says whether the real ops can run here (vLLM importable, its compiled ops loaded, a CUDA device). Each op also
has a plain-torch ``*_emulated`` twin with the kernel's arithmetic and rounding points, for CPU tests and for
checking the real op on the GPU.

Which vLLM code path K3 takes on SM90 (and why these ops, not the inductor forms): K3 is in
``DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES`` (config/vllm.py), so ``_maybe_enable_breakable_cudagraph`` sets
``compilation_config.mode = NONE``; then ``custom_ops`` defaults to ``["all"]`` (CustomOps run their
``forward_cuda``) and ``CudaPlatform.get_default_ir_op_priority`` gives ``rms_norm = ["vllm_c", "native"]``.
``KimiLinearModel`` has no ``@support_torch_compile`` anyway.

Ops (vLLM 0.33.0 file:function -> what K3 calls):

* ``attn_res``: ``vllm/models/kimi_k3/nvidia/ops/attn_res.py:attn_res`` (Triton ``_attn_res_kernel``; the
  native ``ops.kimi_k3_attn_res`` is SM100-only), called as ``KimiDecoderLayer._pre_attn_norm`` /
  ``_post_attn_norm`` in ``vllm/models/kimi_k3/nvidia/model.py`` do.
* ``situ_and_mul``: ``torch.ops._C.situ_and_mul(out, x, beta, linear_beta)`` as
  ``vllm/model_executor/layers/activation.py:SituAndMul.forward_cuda`` (KimiMLP's act_fn; shared experts).
* ``rms_norm``: ``torch.ops._C.rms_norm(out, x, w, eps)`` as ``vllm/kernels/vllm_c.py:rms_norm`` (the "vllm_c"
  impl of ``vllm.ir.ops.rms_norm`` that ``RMSNorm.forward_cuda`` dispatches to; needs w.dtype == x.dtype).
* ``q_kv_rms_norm``: ``vllm/models/common/ops/fused_qk_rmsnorm.py:fused_q_kv_rmsnorm`` (one Triton launch for
  MLA's q_a_layernorm and kv_a_layernorm; ``MultiHeadLatentAttention._apply_q_lora_attention`` in mla.py).
* ``router_topk``: ``vllm/model_executor/layers/fused_moe/router/gate_linear.py:GateLinear.forward`` (bf16
  weight, out_dtype fp32: tier 1 CuTe DSL ``ll_bf16_gemm`` for M <= 16 when cutlass-dsl is importable, else
  tier 6 ``torch.mm(x, w.T, out_dtype=fp32)``) + ``.../router/grouped_topk_router.py:fused_grouped_topk`` ->
  ``vllm/_custom_ops.py:grouped_topk`` (``torch.ops._moe_C.grouped_topk``, one fused CUDA kernel). Router
  choice: ``router_factory.create_fused_moe_router`` keeps ``GroupedTopKRouter`` for K3 (use_grouped_topk,
  1 group, top-1 group) because degrading to FusedTopKBiasRouter would change the advertised routing method
  (DeepSeekV3 -> MiniMax2); ``grouped_topk`` then takes ``fused_grouped_topk`` (VLLM_USE_FUSED_MOE_GROUPED_TOPK
  defaults to 1, n_group <= 32, topk <= 32, bias present), sigmoid scoring (scoring_func=1).
* ``gate_sigmoid_mul``: ``vllm/models/kimi_k3/nvidia/mla.py:_gate_sigmoid_mul`` (``torch.compile``d
  ``attn_out * gate.sigmoid()``, one Inductor kernel), re-declared here because importing mla.py pulls in the
  whole K3 model package.

CUDA graphs: no op syncs the host; outputs are ``torch.empty`` (graph-pool friendly). Compile-on-first-call
ops must see one eager call before capture (the trace harness warms up twice): the AttnRes Triton kernel (one
JIT specialisation per (num_blocks, block_write_idx, HAS_DELTA, BLOCK_L); no autotuning), the fused q/kv
RMSNorm Triton kernel, the CuTe DSL ``ll_bf16_gemm`` (one compile per M <= 4, one per split-K config for
M 5..16) and the ``torch.compile`` of ``gate_sigmoid_mul``. ``situ_and_mul``, ``rms_norm`` and
``grouped_topk`` are precompiled CUDA. The AttnRes, fused-norm and ll_bf16 kernels launch with PDL on SM90
(``current_platform.is_arch_support_pdl()``), as in vLLM.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import torch

__all__ = [
    "SITU_BETA", "SITU_LINEAR_BETA", "KERNELS_PER_LAYER_B1",
    "vllm_available", "attn_res", "situ_and_mul", "rms_norm", "q_kv_rms_norm", "router_topk",
    "gate_linear_fp32", "gate_sigmoid_mul",
    "attn_res_emulated", "situ_and_mul_emulated", "rms_norm_emulated", "router_topk_emulated",
]

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0

# Expected launches of StockImpl(ops="vllm") for one KDA+MoE layer (k3_rank16, batch 1, non-boundary layer),
# stage by stage. Library kernels we do not control (cuBLAS) may add a split-K reduce; fla's and Marlin's
# counts are those of stock_kda.KERNELS_EXPECTED_NULL_SLOT and stock_moe.KERNELS_EXPECTED.
KERNELS_PER_LAYER_B1 = {
    "k3.attn_res": 1,          # _attn_res_kernel (p += delta in place, mix, input_layernorm)
    "k3.kda.in_proj": 2,       # packed in_proj_qkvgfab GEMM + f_b_proj GEMM
    "k3.kda.core": 12,         # fla 0.6.0 path with the null-slot glue (unchanged by this module): 3 Triton + 9 torch
    "k3.o_proj": 1,            # GEMM (cuBLAS may add a split-K reduce kernel to any GEMM here)
    "k3.attn_res_mlp": 1,      # _attn_res_kernel (p += a in place, mix, post_attention_layernorm)
    "k3.router": 2,            # ll_bf16_gemm (fp32 logits) + grouped_topk_fused_kernel
    "k3.moe.down": 1,          # GEMM
    "k3.moe.experts": 6,       # Marlin W4A16: align x2, GEMM1, situ_and_mul, GEMM2, moe_sum
    "k3.moe.shared": 3,        # gate_up GEMM, situ_and_mul, down GEMM
    "k3.moe.up": 3,            # rms_norm (routed_expert_norm), up GEMM, + shared
}


# ----------------------------------------------------------------------------------------------------------
# availability
# ----------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def vllm_available() -> tuple[bool, str]:
    """(True, "vllm <version>") when the vLLM ops can run here: CUDA device, ``vllm._custom_ops`` with
    ``_C.situ_and_mul``, ``_C.rms_norm`` and ``_moe_C.grouped_topk`` registered, and vLLM's AttnRes module
    loadable; else (False, reason). Cached; never raises."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed"
    try:
        import vllm
        import vllm._custom_ops  # noqa: F401  (loads _C and _moe_C)
    except Exception as ex:                                          # noqa: BLE001
        return False, f"import vllm._custom_ops failed: {type(ex).__name__}: {str(ex)[:200]}"
    missing = [n for ns, n in (("_C", "situ_and_mul"), ("_C", "rms_norm"), ("_moe_C", "grouped_topk"))
               if not hasattr(getattr(torch.ops, ns), n)]
    if missing:
        return False, f"vLLM compiled ops missing: {missing}"
    try:
        _attn_res_module()
    except Exception as ex:                                          # noqa: BLE001
        return False, f"vLLM AttnRes module not loadable: {type(ex).__name__}: {str(ex)[:200]}"
    return True, f"vllm {getattr(vllm, '__version__', '?')}"


_ATTN_RES_MOD = "vllm.models.kimi_k3.nvidia.ops.attn_res"


@functools.lru_cache(maxsize=None)
def _attn_res_module():
    """vLLM's ``models/kimi_k3/nvidia/ops/attn_res.py``. Importing it by its package name runs
    ``vllm/models/kimi_k3/__init__.py``, which imports the whole K3 model (attention backends, FlashInfer, ...);
    so the file itself is loaded (same code, same Triton kernel) unless the package is already imported."""
    if _ATTN_RES_MOD in sys.modules:
        return sys.modules[_ATTN_RES_MOD]
    import vllm
    path = os.path.join(os.path.dirname(vllm.__file__), "models", "kimi_k3", "nvidia", "ops", "attn_res.py")
    if os.path.isfile(path):
        spec = importlib.util.spec_from_file_location("k3fast._vllm_kimi_k3_attn_res", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(_ATTN_RES_MOD)


def _platform():
    from vllm.platforms import current_platform
    return current_platform


@functools.lru_cache(maxsize=None)
def _ones(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------
# AttnRes
# ----------------------------------------------------------------------------------------------------------

def attn_res(blocks: torch.Tensor, n_blocks: int, partial: torch.Tensor, delta: torch.Tensor | None,
             norm_w: torch.Tensor | None, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None, eps: float,
             block_write_idx: int = -1, *, out_norm_eps: float | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """One AttnRes site through vLLM's kernel; returns x [M, d] in ``partial``'s dtype (bf16).

    blocks [M, R >= n_blocks, d] bf16 (row stride free, unit stride along d); n_blocks: completed blocks mixed
    (``ceil(l/12)`` before attention, ``+1`` before the MLP at a boundary layer); partial [M, d] bf16 = p, updated
    IN PLACE to bf16(p + delta) when delta is given (delta None: p is only read); norm_w = ``*_res_norm.weight``
    [d] and proj_w = ``*_res_proj.weight`` [1, d] or [d] (vLLM passes ``.squeeze(0)``); or norm_w=None and
    proj_w = the pre-multiplied u = norm_w * proj_w (then a ones vector is passed as the norm weight; the kernel
    forms fp32(norm) * fp32(proj) in registers, so u should be fp32 to stay exact); out_norm_w = the following
    RMSNorm's weight (input_layernorm / post_attention_layernorm) or None for no output norm (the model's final
    mix); eps = the ``*_res_norm`` eps (the score's key norm), out_norm_eps defaults to eps; block_write_idx >= 0
    stores the updated p into blocks[:, block_write_idx] (a block boundary), -1 none.

    This is vLLM's call: ``_pre_attn_norm`` = attn_res(prefix=p, delta=delta, blocks, res_norm.weight,
    res_proj.weight.squeeze(0), input_layernorm.weight, num_blocks=ceil(l/12), block_write_idx=l//12 if
    l % 12 == 0 else -1, eps, output_norm_eps); ``_post_attn_norm`` = the same with delta=a (or, at a boundary,
    prefix=a and delta=None), num_blocks=ceil(l/12)+boundary, block_write_idx=-1.

    ``out``: an optional [M, d] buffer for x. vLLM's function allocates its own output; with ``out`` the same
    ``_attn_res_kernel`` is launched with exactly vLLM's launch parameters (BLOCK_L, num_warps, num_stages,
    PDL) but writes into ``out`` (saves the copy into a static buffer; on SM100 dense 7168-wide inputs, where
    vLLM would run its native op, the function is called and its result copied).

    Semantics vs k3ref.attnres (pre_attention / pre_mlp): same rounding points. p + delta in fp32, rounded once
    to bf16 (stored, and that bf16 value is the mixed source and the block written); scores
    r_i * sum_d v_i[d] * (fp32(norm) * fp32(proj))[d] with r_i = rsqrt(mean(v_i^2) + eps); softmax and mix in
    fp32 over the RAW sources; the output RMSNorm normalises the FP32 mix (vLLM, = k3ref; HF rounds m to bf16
    first) and rounds once after the weight multiply. Differences are summation order only: tl.sum trees vs
    torch matmul/mean; an online softmax over source tiles of BLOCK_L (1 when num_blocks <= 1 or M >= 256, else
    4) that divides the fp32 mix by the denominator at the end (k3ref normalises alpha first); tl.rsqrt and
    tl.exp instead of torch's. n_blocks == 0 returns p (normed) exactly, as k3ref's one-source softmax does."""
    d = partial.shape[-1]
    qk = proj_w.reshape(-1)
    if qk.shape[0] != d:
        raise ValueError(f"proj_w must have {d} entries, got {tuple(proj_w.shape)}")
    if norm_w is None:
        norm_w = _ones(d, qk.dtype, str(qk.device))
    if out_norm_eps is None:
        out_norm_eps = eps
    if not 0 <= n_blocks <= blocks.shape[1]:
        raise ValueError(f"n_blocks={n_blocks} outside [0, {blocks.shape[1]}]")
    if not -1 <= block_write_idx < blocks.shape[1]:
        raise ValueError(f"block_write_idx={block_write_idx} outside [-1, {blocks.shape[1]})")
    mod = _attn_res_module()
    args = (partial, delta, blocks, norm_w, qk, out_norm_w, int(n_blocks), int(block_write_idx), float(eps),
            float(out_norm_eps))
    if out is None:
        return mod.attn_res(*args)
    if out.shape != partial.shape or out.dtype != partial.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(partial.shape)} {partial.dtype} with unit stride along d")
    if _attn_res_takes_native_path(*args):
        out.copy_(mod.attn_res(*args))
        return out
    _launch_attn_res_triton(mod, out, *args)
    return out


def _attn_res_takes_native_path(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                                block_write_idx, eps, output_norm_eps) -> bool:
    """vLLM attn_res's test for its SM100 native op (copied condition)."""
    hidden_size = prefix.shape[1]
    return bool(hidden_size == 7168 and prefix.stride(0) == hidden_size
                and (delta is None or delta.stride(0) == hidden_size)
                and 0 <= num_blocks <= 8 and num_blocks <= blocks.shape[1]
                and -1 <= block_write_idx < blocks.shape[1]
                and _platform().is_device_capability_family(100)
                and hasattr(torch.ops._C, "kimi_k3_attn_res"))


def _launch_attn_res_triton(mod, output, prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                            num_blocks, block_write_idx, eps, output_norm_eps) -> None:
    """The Triton branch of vLLM's attn_res, verbatim except that ``output`` is given."""
    num_tokens, hidden_size = prefix.shape
    assert prefix.stride(-1) == 1
    assert delta is None or delta.stride(-1) == 1
    assert blocks.stride(-1) == 1
    assert norm_weight.stride(-1) == 1
    assert qk_weight.stride(-1) == 1
    assert output_norm_weight is None or output_norm_weight.stride(-1) == 1
    from vllm.triton_utils import triton
    if num_tokens >= 256 or num_blocks <= 1:
        block_l, num_warps = 1, 4
    else:
        block_l, num_warps = 4, 8
    mod._attn_res_kernel[(num_tokens,)](
        prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, output,
        prefix.stride(0), 0 if delta is None else delta.stride(0), blocks.stride(0), blocks.stride(1),
        output.stride(0), num_blocks, hidden_size, block_write_idx, eps, output_norm_eps,
        HAS_DELTA=delta is not None, WRITE_BLOCK=block_write_idx >= 0,
        APPLY_OUTPUT_NORM=output_norm_weight is not None, BLOCK_L=block_l,
        BLOCK_D=triton.next_power_of_2(hidden_size), num_warps=num_warps, num_stages=2,
        launch_pdl=_platform().is_arch_support_pdl(),
    )


def attn_res_emulated(blocks, n_blocks, partial, delta, norm_w, proj_w, out_norm_w, eps, block_write_idx=-1, *,
                      out_norm_eps=None, out=None):
    """Plain-torch twin of ``attn_res`` (same contract, same in-place effects, the kernel's rounding points)."""
    d = partial.shape[-1]
    u = proj_w.reshape(-1).float() * (1.0 if norm_w is None else norm_w.float())
    out_norm_eps = eps if out_norm_eps is None else out_norm_eps
    p = partial.float()
    if delta is not None:
        partial.copy_((p + delta.float()).to(partial.dtype))
        p = partial.float()
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = partial.to(blocks.dtype)
    if n_blocks == 0:
        m = p
    else:
        src = torch.cat([blocks[:, :n_blocks].float(), p[:, None]], dim=1)           # [M, n+1, d]
        r = torch.rsqrt((src * src).sum(-1) * (1.0 / d) + eps)
        s = (src * u).sum(-1) * r
        e = torch.exp(s - s.amax(-1, keepdim=True))
        m = (e[..., None] * src).sum(1) / e.sum(-1, keepdim=True)
    y = m
    if out_norm_w is not None:
        y = m * torch.rsqrt((m * m).sum(-1, keepdim=True) * (1.0 / d) + out_norm_eps) * out_norm_w.float()
    y = y.to(partial.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


# ----------------------------------------------------------------------------------------------------------
# SiTU-GLU, RMSNorm
# ----------------------------------------------------------------------------------------------------------

def situ_and_mul(ac: torch.Tensor, beta: float = SITU_BETA, linear_beta: float | None = SITU_LINEAR_BETA, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """h [M, I] = SiTU(ac[:, :I]) * softclip(ac[:, I:]) through ``torch.ops._C.situ_and_mul(out, ac, beta,
    linear_beta)`` (vLLM SituAndMul.forward_cuda; linear_beta None -> -1.0 = "unset", up passed through).
    ac [M, 2I] bf16 contiguous: gate first (w1 / shared gate_proj rows), up second (w3 / up_proj).

    Semantics vs k3ref.norms.situ_glu: bf16 inputs, fp32 math, one bf16 rounding (= k3ref's stock rounding
    points). The CUDA kernel forms the sigmoid through tanh, 2*tanh(a/4) * (1 + tanh(a/2)) * 25*tanh(c/25) (as
    documented in vLLM's AMD ``situ_vllm`` twin), with CUDA tanhf: ulp-level differences from torch's
    sigmoid * tanh."""
    if ac.stride(-1) != 1 or not ac.is_contiguous():
        raise ValueError("situ_and_mul needs a contiguous [M, 2I] input (the kernel assumes packed rows)")
    import vllm._custom_ops  # noqa: F401
    dh = ac.shape[-1] // 2
    if out is None:
        out = torch.empty(ac.shape[:-1] + (dh,), dtype=ac.dtype, device=ac.device)
    torch.ops._C.situ_and_mul(out, ac, float(beta), -1.0 if linear_beta is None else float(linear_beta))
    return out


def situ_and_mul_emulated(ac, beta=SITU_BETA, linear_beta=SITU_LINEAR_BETA, *, out=None):
    dh = ac.shape[-1] // 2
    a, c = ac[..., :dh].float(), ac[..., dh:].float()
    g = (beta / 2.0) * torch.tanh(a / beta) * (1.0 + torch.tanh(a / 2.0))      # beta*tanh(a/beta)*sigmoid(a)
    if linear_beta is not None and linear_beta > 0:
        c = linear_beta * torch.tanh(c / linear_beta)
    y = (g * c).to(ac.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm_w(x) through ``torch.ops._C.rms_norm(out, x, w, eps)`` = vLLM's "vllm_c" rms_norm
    (``vllm/kernels/vllm_c.py:rms_norm``; RMSNorm.forward_cuda -> ir.ops.rms_norm with priority
    ["vllm_c", "native"]). x [..., n] with unit stride along n (a row stride is fine: column slices of a
    packed GEMM output need no copy); out contiguous.

    vLLM only takes the C kernel when w.dtype == x.dtype (K3's norm weights are bf16); otherwise its IR
    falls back to the native torch form, reproduced here (weight multiply after rounding x*rstd to w.dtype).
    Semantics vs k3ref.norms.rms_norm: sum of squares in fp32, rsqrtf(mean + eps), y = bf16(x * rstd * w) in
    fp32 with one rounding (0.33's libtorch-stable kernel; older vLLM rounded x*rstd to bf16 first); block
    reduction order differs."""
    if w.dtype != x.dtype:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype) * w
        y = y.to(x.dtype)
        if out is not None:
            out.copy_(y)
            return out
        return y
    import vllm._custom_ops  # noqa: F401
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops._C.rms_norm(out, x, w, float(eps))
    return out


def rms_norm_emulated(x, w, eps, *, out=None):
    xf = x.float()
    y = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def q_kv_rms_norm(q: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, kv_w: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's q_a_layernorm and kv_a_layernorm in ONE launch: vLLM's
    ``vllm/models/common/ops/fused_qk_rmsnorm.py:fused_q_kv_rmsnorm(q_c, kv_c, q_a_layernorm.weight,
    kv_a_layernorm.weight, eps)`` (Triton, grid (M, 2)). q [M, 1536], kv [M, 512]: column slices of the packed
    q_a|kv_a|g output are fine (unit stride along the row). Returns contiguous (q_normed, kv_normed).
    Semantics: fp32 x * rrms * fp32(w), one rounding (= k3ref). Falls back to two ``rms_norm`` launches if the
    module cannot be imported."""
    try:
        from vllm.models.common.ops import fused_q_kv_rmsnorm
    except Exception:                                                  # noqa: BLE001
        return rms_norm(q, q_w, eps), rms_norm(kv, kv_w, eps)
    return fused_q_kv_rmsnorm(q, kv, q_w.contiguous(), kv_w.contiguous(), float(eps))


# ----------------------------------------------------------------------------------------------------------
# router
# ----------------------------------------------------------------------------------------------------------

LL_BF16_MAX_TOKENS = 16          # GateLinear.LL_BF16_MAX_TOKENS


@functools.lru_cache(maxsize=None)
def _ll_bf16_allowed() -> bool:
    """GateLinear's tier-1 eligibility for a bf16 weight with out_dtype fp32: CUDA SM90 or SM100 family,
    not VLLM_BATCH_INVARIANT, no bias, cutlass-dsl importable (``ll_bf16.is_available``)."""
    plat = _platform()
    import vllm.envs as envs
    if not plat.is_cuda() or envs.VLLM_BATCH_INVARIANT:
        return False
    if not (plat.is_device_capability((9, 0)) or plat.is_device_capability_family(100)):
        return False
    from vllm.model_executor.kernels.linear.cute_dsl.ll_bf16 import is_available
    return bool(is_available())


def gate_linear_fp32(x: torch.Tensor, w_gate: torch.Tensor) -> torch.Tensor:
    """Router logits [M, E] fp32 = x [M, d] bf16 @ w_gate [E, d] bf16 ^T, dispatched as GateLinear.forward does
    for K3 (weight bf16, out_dtype fp32): M <= 16 -> CuTe DSL ``ll_bf16_gemm`` (dot-product kernel for M <= 4,
    split-K above; PDL; the M == 1 instance prefetches the weight under PDL), otherwise (or without cutlass-dsl)
    cuBLAS ``torch.mm(x, w.T, out_dtype=float32)``. Both accumulate in fp32 with one fp32 output."""
    if (x.dtype == torch.bfloat16 and w_gate.dtype == torch.bfloat16 and x.shape[0] <= LL_BF16_MAX_TOKENS
            and _ll_bf16_allowed()):
        from vllm.model_executor.kernels.linear.cute_dsl.ll_bf16 import ll_bf16_gemm
        return ll_bf16_gemm(x, w_gate)
    if w_gate.dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
        try:
            return torch.mm(x, w_gate.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):    # a torch without mm(out_dtype=): bf16 GEMM, then a cast launch
            return torch.nn.functional.linear(x, w_gate).float()
    return torch.nn.functional.linear(x.to(w_gate.dtype), w_gate).float()


def router_topk(x: torch.Tensor, w_gate: torch.Tensor, e_bias: torch.Tensor, top_k: int = 16,
                scaling: float = 1.0, *, renormalize: bool = True, num_expert_group: int = 1,
                topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """K3's routing as vLLM 0.33 runs it on SM90: ``gate_linear_fp32`` (GateLinear) then
    ``ops.grouped_topk(logits, num_expert_group, topk_group, top_k, renormalize, routed_scaling_factor,
    e_score_correction_bias, scoring_func=1)`` (``fused_grouped_topk``, sigmoid). x [M, d] bf16, w_gate [E, d]
    bf16, e_bias [E] fp32. Returns (ids [M, k] int32, weights [M, k] fp32), the layout Marlin's MoE takes.

    Semantics vs k3ref.moe.route: sigmoid computed as 0.5*tanh(0.5*l)+0.5 (``sigmoid_accurate``, tanhf) in
    fp32; candidates sigmoid + bias; selection by a stable warp top-k (ties -> lower expert index, as k3ref's
    stable sort); weights = unbiased sigmoid / (1e-20 + sum over the k) * scaling, fp32 (= k3ref, incl. the
    1e-20). Slot order = descending biased score (k3ref too). Only the logits' fp32 summation order (CuTe /
    cuBLAS vs torch) and the tanh-form sigmoid differ, at the ulp level; a near-tie may flip an expert."""
    import vllm._custom_ops as ops
    logits = gate_linear_fp32(x, w_gate)
    weights, ids = ops.grouped_topk(logits, int(num_expert_group), int(topk_group), int(top_k), bool(renormalize),
                                    float(scaling), e_bias, 1)
    return ids, weights


def router_topk_emulated(x, w_gate, e_bias, top_k=16, scaling=1.0, *, renormalize=True, num_expert_group=1,
                         topk_group=1):
    """Plain-torch twin of ``router_topk`` (one expert group only)."""
    if num_expert_group != 1 or topk_group != 1:
        raise NotImplementedError("emulation covers K3's single expert group")
    logits = torch.nn.functional.linear(x.float(), w_gate.float())
    s = 0.5 * torch.tanh(0.5 * logits) + 0.5
    biased = s + e_bias.float()
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    ws = s.gather(-1, ids)
    scale = scaling / (1e-20 + ws.sum(-1, keepdim=True)) if renormalize else scaling
    return ids.to(torch.int32), (ws * scale).float()


# ----------------------------------------------------------------------------------------------------------
# MLA output gate
# ----------------------------------------------------------------------------------------------------------

_GATE_MUL = None


def gate_sigmoid_mul(attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``attn_out * gate.sigmoid()`` compiled exactly as vLLM's mla.py:_gate_sigmoid_mul
    (``torch.compile(backend=current_platform.simple_compile_backend)``): one Inductor kernel, fp32 inside,
    one bf16 rounding (k3ref rounds once too). Compiles on the first call (warm up before graph capture)."""
    global _GATE_MUL
    if _GATE_MUL is None:
        backend = _platform().simple_compile_backend

        def _gate_sigmoid_mul(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            return a * g.sigmoid()
        _GATE_MUL = torch.compile(_gate_sigmoid_mul, backend=backend)
    return _GATE_MUL(attn_out, gate)


# ----------------------------------------------------------------------------------------------------------
# The KDA decode path and the low-latency GEMMs of vLLM's own layer (variant "vllm-layer")
# ----------------------------------------------------------------------------------------------------------
# vLLM 0.33's KimiK3DeltaAttention._forward on SM90 at 6 heads per rank (TP16) takes its Triton decode path: the
# native ``ops.fused_kda_decode`` serves 12 / 24 / 48 / 96 heads only and FlashInfer's fused decode is SM10x only
# (``resolve_kda_decode_backend`` in vllm/models/kimi_k3/nvidia/kda.py). That path is three launches between the
# projections and o_proj: ``causal_conv1d_update`` (vllm/model_executor/layers/mamba/ops/causal_conv1d.py),
# ``fused_recurrent_kda_packed_decode`` (vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py) and
# ``rms_norm_gated`` (vllm/third_party/flash_linear_attention/ops/kda.py, the kernel behind o_norm's
# FusedRMSNormGated with sigmoid). Both state kernels treat slot 0 as vLLM's null block (NULL_BLOCK_ID): no state is
# read or written for it and the packed decode writes zero rows. The native fused op (12 / 24 / 48 / 96 heads) does
# not skip it: a padding row (vLLM pads with slot 0) updates slot 0's state, which vLLM reserves and never reads,
# so the harness keeps slot 0 spare (layer_io.make_io). The projections K3 registers in its SM90 table
# (vllm/models/kimi_k3/nvidia/low_latency_gemm.py: o_proj [7168, 768], the latent down / up projections, ...) run
# vLLM's CuTe DSL skinny GEMM for the batch sizes the table lists, cuBLAS otherwise (``try_low_latency_gemm``).

# One KDA+MoE layer of StockImpl(ops="vllm-layer") at k3_rank16, batch 1, a non-boundary layer, in launch order:
# the kernel names vLLM's own layer launched inside a vLLM 0.33 engine on an H100 (the engine run traces/index.json
# names as ``vllm_e2e``, per_layer.kda_moe.kernel_names), each as the prefix our launch shares with it. "harness:"
# entries are ours alone.
KERNELS_VLLM_LAYER_B1 = {
    "attn": ["_attn_res_kernel",
             "nvjet_sm90",                              # in_proj_qkvgfab (cuBLAS split-K) ...
             "void cublasLt::splitKreduce_kernel",      # ... and its reduce
             "nvjet_sm90",                              # f_b_proj (cuBLAS)
             "harness: slots.clamp_min(0)",             # our padding (-1) as vLLM's null block (0), where the step
                                                        # gives no state_indices (an eager call outside the trace)
             "_causal_conv1d_update_kernel",
             "fused_recurrent_kda_packed_decode_kernel",
             "layer_norm_gated_fwd_kernel",
             "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_skinny_gemmCuteSkinnyGemm",   # o_proj
             "_attn_res_kernel"],
    "moe": ["kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_ll_bf16_dotprodLLBf16Dotprod",
            "void vllm::moe::single_group_topk",
            "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_skinny_gemmCuteSkinnyGemm",    # down
            "void vllm::moe::moe_align_block_size_kernel",
            "void vllm::moe::count_and_sort_expert_tokens_kernel",
            "void marlin_moe_wna16::Marlin",
            "void vllm::situ_and_mul_kernel",
            "void marlin_moe_wna16::Marlin",
            "void vllm::moe::moe_sum_vec_dynamic_kernel",
            "nvjet_sm90",                               # shared gate/up (cuBLAS split-K) ...
            "void cublasLt::splitKreduce_kernel",       # ... and its reduce
            "void vllm::situ_and_mul_kernel",
            "nvjet_sm90",                               # shared down
            "void vllm::rms_norm_kernel",
            "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_skinny_gemmCuteSkinnyGemm",    # up
            "void at::native::vectorized_elementwise_kernel"],   # routed + shared
}


# One MLA+MoE layer of StockImpl(ops="vllm-layer") at k3_rank16, batch 1 (vLLM's FLASH_ATTN_MLA decode on SM90,
# k3fast.stock.mla.FA3MLADecodeCore), as above against per_layer.mla_moe.kernel_names: the attention half, then the
# MoE half (the same launches as a KDA layer's). The step's paging metadata and FA3's split schedule are built once
# per step outside the layer, as vLLM's attention builder builds them; vLLM launches g_proj on a side stream, so its
# GEMM sits later in the engine's launch order, in the same count.
KERNELS_VLLM_LAYER_MLA_B1 = {
    "attn": ["_attn_res_kernel",
             "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_skinny_gemmCuteSkinnyGemm",   # q_a | kv_a
             "nvjet_sm90",                              # g_proj (cuBLAS split-K) ...
             "void cublasLt::splitKreduce_kernel",      # ... and its reduce
             "Kernel",                                  # the fused q_a / kv_a RMSNorm
             "nvjet_sm90",                              # q_b_proj
             "nvjet_sm90",                              # W_UK (bmm)
             "void vllm::kimi_k3_fused_ops::fusedKimiK3MLADecodeQConcatKVCacheKernel",
             "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90",
             "void cutlass::device_kernel<flash::FlashAttnFwdCombine",
             "nvjet_sm90",                              # W_UV (bmm)
             "triton_poi_fused_mul_sigmoid",            # the output gate
             "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_skinny_gemmCuteSkinnyGemm",   # o_proj
             "_attn_res_kernel"],
    "moe": KERNELS_VLLM_LAYER_B1["moe"],
}


# The same at a TP8 rank (k3_rank8, batch 1), against the TP8 engine's per_layer kernel names (traces/index.json's
# vllm_layers_h100). Two things differ from TP16: at 12 KDA heads vLLM runs its native fused KDA decode op (one
# kernel for the conv, the recurrence and the gated norm), and K3's low-latency table lists more of the TP8 rank's
# projections, so the packed in_proj, f_b, the shared experts' GEMMs, g_proj and q_b leave cuBLAS (the CuTe skinny
# GEMM, or the dsv3 fused-A GEMM where the table names it at this batch). vLLM launches the shared experts before the
# top-k and g_proj on a side stream; the counts per half are what match.
_SKINNY = "kernel_cutlass_kernel_vllmmodel_executorkernelslinearcute_dsl_skinny_gemmCuteSkinnyGemm"
# the MoE half: the routed part and the tail as at TP16; the shared experts' two GEMMs on the table
_MOE_TP8_B1 = (KERNELS_VLLM_LAYER_B1["moe"][:9]                     # router .. moe_sum: the same launches
               + [_SKINNY,                                          # shared gate/up [1536, 7168]
                  "void vllm::situ_and_mul_kernel",
                  _SKINNY]                                          # shared down [7168, 768]
               + KERNELS_VLLM_LAYER_B1["moe"][-3:])                 # RMSNorm, up, add
KERNELS_VLLM_LAYER_TP8_B1 = {
    "attn": ["_attn_res_kernel",
             _SKINNY,                                      # in_proj_qkvgfab [6288, 7168]
             "void fused_a_gemm_kernel",                   # f_b [1536, 128] (dsv3 fused-A GEMM)
             "void (anonymous namespace)::kda_decode_fusion_many_heads_kernel",
             _SKINNY,                                      # o_proj
             "_attn_res_kernel"],
    "moe": _MOE_TP8_B1,
}
KERNELS_VLLM_LAYER_MLA_TP8_B1 = {
    "attn": ["_attn_res_kernel",
             _SKINNY,                                      # q_a | kv_a
             _SKINNY,                                      # g_proj [1536, 7168]
             "Kernel",                                     # the fused q_a / kv_a RMSNorm
             _SKINNY,                                      # q_b_proj [2304, 1536]
             "nvjet_sm90",                                 # W_UK (bmm)
             "void vllm::kimi_k3_fused_ops::fusedKimiK3MLADecodeQConcatKVCacheKernel",
             "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90",
             "void cutlass::device_kernel<flash::FlashAttnFwdCombine",
             "nvjet_sm90",                                 # W_UV (bmm)
             "triton_poi_fused_mul_sigmoid",
             _SKINNY,                                      # o_proj
             "_attn_res_kernel"],
    "moe": _MOE_TP8_B1,
}


@functools.lru_cache(maxsize=None)
def vllm_layer_available() -> tuple[bool, str]:
    """(True, "") when the KDA decode kernels and the low-latency GEMM table of vLLM's own layer import here (on
    top of ``vllm_available``); else (False, reason). Importing them imports vLLM's K3 model package."""
    ok, why = vllm_available()
    if not ok:
        return ok, why
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update  # noqa: F401
        from vllm.models.kimi_k3.nvidia.low_latency_gemm import try_low_latency_gemm  # noqa: F401
        from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda_packed_decode  # noqa: F401
        from vllm.third_party.flash_linear_attention.ops.kda import rms_norm_gated  # noqa: F401
    except Exception as ex:                                          # noqa: BLE001
        return False, f"vLLM's KDA decode path does not import: {type(ex).__name__}: {str(ex)[:200]}"
    return True, ""


def low_latency_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T as a K3 projection runs in vLLM on SM90: the CuTe DSL skinny GEMM where K3's shape table lists
    (N, K) at this batch, cuBLAS otherwise."""
    from vllm.models.kimi_k3.nvidia.low_latency_gemm import try_low_latency_gemm
    y = try_low_latency_gemm(x, w)
    return torch.nn.functional.linear(x, w) if y is None else y


# Head counts per rank that vLLM 0.33's native fused KDA decode serves on SM90 (``is_fused_kda_decode_supported``):
# a TP8 rank (12 heads) and TP1 (96) take it, a TP16 rank (6) the Triton path.
NATIVE_KDA_HEADS = (12, 24, 48, 96)


def native_kda_decode(heads: int) -> bool:
    """Whether vLLM's layer decodes ``heads`` KDA heads per rank with its native fused op (conv, gated delta rule and
    gated RMSNorm in one launch) rather than its three Triton kernels."""
    return heads in NATIVE_KDA_HEADS and hasattr(torch.ops._C, "fused_kda_decode")


def native_conv_weight(conv_w: torch.Tensor, proj: int) -> torch.Tensor:
    """[3P, 4] conv taps -> vLLM's decode_conv1d_weight layout [3 (q, k, v), 4 taps, P] in fp32 (the dtype of K3's
    conv1d parameter, which vLLM declares float32; the native op refuses any other)."""
    return conv_w.view(3, proj, -1).transpose(1, 2).contiguous().to(torch.float32)


def kda_decode_core(qkv: torch.Tensor, g_out: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                    conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor, conv_w: torch.Tensor,
                    a_log: torch.Tensor, dt_bias: torch.Tensor, o_norm: torch.Tensor, *, heads: int,
                    head_dim: int, lower_bound: float, eps: float,
                    conv_w_native: torch.Tensor | None = None) -> torch.Tensor:
    """The KDA decode step between the projections and o_proj, as vLLM 0.33 runs it at this head count: its native
    fused op (``native_kda_decode``; ``conv_w_native`` from ``native_conv_weight``) or its Triton path.

    qkv [M, 3P] bf16 (a column slice of the packed in_proj output: contiguous rows), g_out [M, P] (the output gate's
    slice), f [M, P] (f_b_proj's output), b [M, H] (beta's slice), the state pools conv_state [S, 3P, 3] bf16 and
    rec_state [S, H, D, D] fp32, slots [M] int32 with 0 = vLLM's null block (padding), conv_w [3P, 4], o_norm [D]
    fp32. Returns the gated-normed o [M, P] bf16."""
    M, H, D = qkv.shape[0], heads, head_dim
    if native_kda_decode(H):
        import vllm._custom_ops as ops
        if conv_w_native is None:
            raise ValueError("conv_w_native: vLLM's native KDA decode needs the [3, 4, P] conv weight")
        o = torch.empty(1, M, H, D, dtype=qkv.dtype, device=qkv.device)
        ops.fused_kda_decode(x=qkv, weight=conv_w_native, bias=None, conv_state=conv_state,
                             raw_g=f.view(1, M, H, D), raw_beta=b.unsqueeze(0), A_log=a_log, dt_bias=dt_bias,
                             state_indices=slots, state=rec_state, out=o, lower_bound=lower_bound,
                             output_gate=g_out.view(M, H, D), norm_weight=o_norm, norm_eps=eps)
        return o.view(M, H * D)
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda_packed_decode
    from vllm.third_party.flash_linear_attention.ops.kda import rms_norm_gated
    x = causal_conv1d_update(qkv, conv_state, conv_w, None, activation="silu", conv_state_indices=slots,
                             validate_data=True, out=torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device))
    o = torch.empty(1, M, H, D, dtype=qkv.dtype, device=qkv.device)
    fused_recurrent_kda_packed_decode(mixed_qkv=x, raw_g=f.view(1, M, H, D), raw_beta=b.unsqueeze(0), A_log=a_log,
                                      dt_bias=dt_bias, lower_bound=lower_bound, initial_state=rec_state,
                                      state_indices=slots, out=o)
    y = rms_norm_gated(o.view(M, H, D), g_out.view(M, H, D), o_norm, None, "sigmoid", eps=eps)
    return y.view(M, H * D)
