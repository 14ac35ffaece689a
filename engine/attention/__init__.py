"""Attention backends behind one interface, registered by name (``torch``, ``triton``)."""

from kvfleet.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    get_backend,
    register_backend,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "register_backend"]
