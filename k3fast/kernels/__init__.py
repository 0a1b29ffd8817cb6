"""The fused CuTe DSL decode kernels for sm_90a, one module per fusion, each named after the reference ops it
replaces. Kernel modules import only the DSL glue (``k3fast.kernels._dsl``) and each other; nothing here imports
the layer, the peers or the measuring tools."""
