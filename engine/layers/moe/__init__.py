"""Mixture-of-experts layers: the router (``router.py``), the grouped expert compute over any linear
method (``grouped.py``) and its plain torch reference (``reference.py``), used by ``model/moe.py``."""

from kvfleet.engine.layers.moe.grouped import (
    Activation,
    ExpertGroups,
    Experts,
    KernelExperts,
    StackedExperts,
    grouped_moe,
)
from kvfleet.engine.layers.moe.router import Routing, get_router, register_router

__all__ = [
    "Activation",
    "ExpertGroups",
    "Experts",
    "KernelExperts",
    "Routing",
    "StackedExperts",
    "get_router",
    "grouped_moe",
    "register_router",
]
