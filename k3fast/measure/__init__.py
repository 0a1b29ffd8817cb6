"""The measuring tools: traces and benchmarks (CUDA-graph replay, cold L2, bytes and floors), the report that
writes README's results, PTX checks, provenance, and the notebooks' helpers. Product code never imports these."""
