"""Attention backends behind one interface, registered by name (``cpu``, ``torch``, ``triton``; ``auto`` picks one)."""

from kvfleet.engine.attention.base import AttentionBackend, AttentionMetadata, LayerKV
from kvfleet.engine.attention.registry import get_backend, register_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKV", "get_backend", "register_backend"]
