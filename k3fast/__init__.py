"""k3fast: the K3 decode step fused in CuTe DSL for sm_90a, plus the stock and compiled peers, the
trace/benchmark tooling and the bytes-and-floor reports.

Importing k3fast needs neither a GPU nor CuTe DSL: kernel modules import ``cutlass`` lazily, at their
first compile (k3fast.kernels._dsl pins CUTE_DSL_ARCH=sm_90a when nothing else was chosen).
"""
