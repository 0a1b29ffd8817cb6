"""Long decodes against the reference: how far an implementation's state and outputs drift from k3ref in fp64 over
thousands of steps, beside k3ref's own model-precision path over the same steps.

One layer decodes ``steps`` tokens per request. Every step feeds the same fresh random AttnRes inputs (block rows,
partial sum, previous delta) to three copies of the layer, each with its own state:

* ``exact``  k3ref in fp64 (no rounding anywhere): the truth;
* ``model``  k3ref in model precision (BF16 activations, FP32 state): what Hugging Face's code computes, and the
             error a deployment already accepts;
* ``impl``   the implementation under test (``fast`` by default) on the same weights.

Requests join at different steps (``starts``): before its start a request is a padding row (slot -1), so its state
slot must stay all zeros, and afterwards the requests carry different sequence lengths (KDA: steps of recurrence;
MLA: cached rows). Every ``every`` steps the record gets, over the active requests, the relative RMS error against
``exact`` of the attention half's output (the MoE input) and of the state (KDA recurrent state, or the cache rows
written so far), for ``impl`` and for ``model``; every ``every_out`` steps also the whole layer output.

Why the model path is the yardstick: the fused kernels round at the same points as the model (BF16 activations,
FP32 state) but sum in other orders, so their error against fp64 should follow the model path's curve, not the
bf16 ulp of one step. A kernel bug that leaks into the state (a missed decay, a stale conv row) grows step after
step, which the ratio to the model path exposes long before an absolute bound would.

    python -m k3fast.measure.reliability --shape k3_rank16 --layer 1 --batch 8 --steps 2000 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from k3ref import Precision, preset
from k3ref.compare import rel_rmse
from k3ref.state import KDAState, MLACache
from k3ref.weights import random_layer

from ..layer_io import LayerIO
from .impls import make_impl


def default_starts(batch: int, steps: int) -> list[int]:
    """Request i joins at step i * steps / (2 * batch): the last one decodes about half as many tokens as the
    first, so the batch holds every length in between."""
    return [i * steps // (2 * batch) for i in range(batch)]


def _state(cfg, layer, slots, max_len, P, device):
    if cfg.is_kda_layer(layer):
        return KDAState.allocate(cfg, slots, P, device)
    return MLACache.allocate(cfg, slots, max_len, P, device)


def _io(cfg, layer, batch, state, dtype, device) -> LayerIO:
    d = cfg.hidden_size
    z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)
    return LayerIO(cfg, layer, z(batch, cfg.max_blocks, d), z(batch, d), z(batch, d) if layer > 0 else None, state,
                   slots=torch.full((batch,), -1, dtype=torch.int32, device=device), x_mlp=z(batch, d),
                   out=z(batch, d))


def _state_tensor(st) -> torch.Tensor:
    return st.recurrent if isinstance(st, KDAState) else st.kv


def long_decode(shape: str = "k3_rank16", layer: int = 1, batch: int = 1, steps: int = 2000, *,
                impl: str = "fast", starts: list[int] | None = None, every: int = 20, every_out: int = 200,
                seed: int = 0, device: str = "cuda", log=None) -> dict:
    """Decode ``steps`` tokens on three copies of layer ``layer`` (exact / model / impl) and return the error record
    (see the module docstring). Raises AssertionError if a padding row's state slot is written."""
    cfg = preset(shape)
    starts = default_starts(batch, steps) if starts is None else list(starts)
    if len(starts) != batch or min(starts) < 0 or max(starts) >= steps:
        raise ValueError(f"starts: expected {batch} steps in 0..{steps - 1}, got {starts}")
    w = random_layer(cfg, layer, seed=seed, device=device)
    is_kda = cfg.is_kda_layer(layer)
    n_slots = batch + 1                                   # slot 0 stays unused: every write must miss it
    max_len = -(-(steps + 16) // 64) * 64                 # whole 64-token pages (the stock MLA path's page size)
    exact_P = Precision.exact()
    paths = {"exact": _io(cfg, layer, batch, _state(cfg, layer, n_slots, max_len, exact_P, device), torch.float64,
                          device),
             "model": _io(cfg, layer, batch, _state(cfg, layer, n_slots, max_len, Precision.model(), device),
                          torch.bfloat16, device),
             "impl": _io(cfg, layer, batch, _state(cfg, layer, n_slots, max_len, Precision.model(), device),
                         torch.bfloat16, device)}
    runners = {"exact": make_impl("ref", cfg, w), "model": make_impl("ref", cfg, w),
               "impl": make_impl(impl, cfg, w, max_batch=batch) if impl not in ("ref", "compiled")
               else make_impl(impl, cfg, w)}
    runners["exact"].P = exact_P
    starts_t = torch.tensor(starts, device=device)
    g = torch.Generator(device=device).manual_seed(seed + 7)
    curve = []
    t0 = time.perf_counter()
    for t in range(steps):
        active = starts_t <= t
        slots = torch.where(active, torch.arange(1, batch + 1, device=device), -1).to(torch.int32)
        blocks = torch.randn(batch, cfg.max_blocks, cfg.hidden_size, generator=g, device=device).to(torch.bfloat16)
        partial = torch.randn(batch, cfg.hidden_size, generator=g, device=device).to(torch.bfloat16)
        delta = (0.5 * torch.randn(batch, cfg.hidden_size, generator=g, device=device)).to(torch.bfloat16)
        for io in paths.values():
            io.blocks.copy_(blocks)
            io.partial.copy_(partial)
            if io.delta is not None:
                io.delta.copy_(delta)
            io.slots.copy_(slots)
        want_out = (t + 1) % every_out == 0 or t == steps - 1
        for name, io in paths.items():
            runners[name].attn(io)
            if want_out:
                runners[name].moe(io)
        # padding rows write nothing: a slot whose request has not started is still all zeros everywhere
        for name, io in paths.items():
            idle = (~active).nonzero().flatten() + 1
            if len(idle):
                assert not _state_tensor(io.state)[idle].any(), f"{name}: a padding row wrote its slot at step {t}"
            assert not _state_tensor(io.state)[0].any(), f"{name}: the unused slot 0 was written at step {t}"
        if (t + 1) % every == 0 or want_out:
            rows = active.nonzero().flatten()
            live = rows + 1
            ex = paths["exact"]
            rec = {"step": t + 1, "active": int(active.sum())}
            for name in ("impl", "model"):
                io = paths[name]
                rec[f"{name}_x_mlp"] = rel_rmse(io.x_mlp[rows].double(), ex.x_mlp[rows])
                if is_kda:
                    rec[f"{name}_state"] = rel_rmse(io.state.recurrent[live].double(), ex.state.recurrent[live])
                    rec[f"{name}_conv"] = rel_rmse(io.state.conv[live].double(), ex.state.conv[live])
                else:
                    n = int(ex.state.lengths.max())
                    rec[f"{name}_state"] = rel_rmse(io.state.kv[live, :n].double(), ex.state.kv[live, :n])
                if want_out:
                    rec[f"{name}_out"] = rel_rmse(io.out[rows].double(), ex.out[rows])
            bad = [k for k, v in rec.items() if isinstance(v, float) and v != v]
            if bad:
                raise AssertionError(f"NaN error at step {t + 1}: {bad}")
            curve.append(rec)
            if log and (t + 1) % (every * 25) == 0:
                log(f"  step {t + 1}: impl x_mlp {rec['impl_x_mlp']:.2e} state {rec['impl_state']:.2e} | "
                    f"model x_mlp {rec['model_x_mlp']:.2e} state {rec['model_state']:.2e}")
    return {"kind": "long_decode", "shape": shape, "layer": layer,
            "layer_kind": "kda" if is_kda else "mla", "batch": batch, "steps": steps, "starts": starts,
            "impl": impl, "seed": seed, "every": every, "every_out": every_out, "wall_s": time.perf_counter() - t0,
            "curve": curve}


def summarize(rec: dict) -> dict:
    """Worst errors over the run and the largest impl / model ratio, per quantity."""
    out = {}
    for q in ("x_mlp", "state", "conv", "out"):
        pts = [(c[f"impl_{q}"], c[f"model_{q}"]) for c in rec["curve"] if f"impl_{q}" in c]
        if pts:
            out[q] = {"impl_max": max(i for i, _ in pts), "model_max": max(m for _, m in pts),
                      "ratio_max": max(i / max(m, 1e-30) for i, m in pts),
                      "impl_last": pts[-1][0], "model_last": pts[-1][1]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m k3fast.measure.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="k3_rank16")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--impl", default="fast")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rec = long_decode(a.shape, a.layer, a.batch, a.steps, impl=a.impl, device=a.device, log=print)
    rec["summary"] = summarize(rec)
    with open(a.out, "w") as f:
        json.dump({"records": [rec]}, f, indent=1)
    print(json.dumps(rec["summary"], indent=1))


if __name__ == "__main__":
    main()
