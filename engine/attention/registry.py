"""Attention backends by name: the runner asks :func:`get_backend` for ``cpu``, ``torch`` or ``triton``.

Where it sits: above the backends (``engine/attention/*_backend.py``), which know only the
interface (``engine/attention/base.py``); the runner calls :func:`get_backend` once. The
built-in backends are imported on first use, so torch-only users never load triton;
:func:`register_backend` adds another by name (it wins over a built-in of that name).
"""

from __future__ import annotations

from collections.abc import Callable

from kvfleet.engine.attention.base import AttentionBackend

BackendFactory = Callable[[], AttentionBackend]
BUILTIN = ("cpu", "torch", "triton")
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    _REGISTRY[name] = factory


def _builtin(name: str) -> BackendFactory | None:
    if name == "torch":
        from kvfleet.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from kvfleet.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "cpu":
        from kvfleet.engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend
    return None


def get_backend(name: str) -> AttentionBackend:
    factory = _REGISTRY.get(name) or _builtin(name)
    if factory is None:
        raise ValueError(f"attention backend {name!r} is unknown; known: {sorted({*_REGISTRY, *BUILTIN})}")
    return factory()
