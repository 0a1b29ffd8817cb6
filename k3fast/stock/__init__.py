"""The peers the fused layer is measured against: the reference as an implementation (``ref``, ``compiled``) and
``stock``, the library kernels a serving stack runs on Hopper (cuBLAS, fla's Triton KDA, vLLM's fused ops and its
Marlin MXFP4 MoE)."""
