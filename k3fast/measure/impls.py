"""The implementations the traces compare, by name: ``ref``, ``compiled``, ``stock`` and ``fast`` with its live
A/B contenders (k3fast.layer.CONTENDERS)."""
from __future__ import annotations

from k3ref import K3Config
from k3ref.weights import LayerWeights

from ..layer_io import LayerIO, make_io  # noqa: F401  (re-exported: the harness builds its buffers here)
from ..stock.layer import StockImpl
from ..stock.ref import CompiledImpl, RefImpl

IMPLS = {"ref": RefImpl, "compiled": CompiledImpl, "stock": StockImpl}


def impl_names() -> list[str]:
    """Every name make_impl accepts: the peers, "fast" and its live contenders."""
    from ..layer import CONTENDERS
    return sorted(IMPLS) + ["fast"] + list(CONTENDERS)


def make_impl(name: str, cfg: K3Config, w: LayerWeights, **kw):
    """The implementation ``name`` of one layer: "ref", "compiled", "stock" (keyword ``ops``), "fast" or one of
    k3fast.layer.CONTENDERS (keyword ``max_batch`` for stock and fast)."""
    from ..layer import CONTENDERS, DEFAULT_PLAN, FastImpl
    if name == "fast":
        return FastImpl(cfg, w, plan=DEFAULT_PLAN, **kw)
    if name in CONTENDERS:
        impl = FastImpl(cfg, w, plan=CONTENDERS[name][0], **kw)
        impl.name = name
        return impl
    if name not in IMPLS:
        raise ValueError(f"unknown implementation {name!r}; expected one of {impl_names()}")
    return IMPLS[name](cfg, w, **kw) if name == "stock" else IMPLS[name](cfg, w)
