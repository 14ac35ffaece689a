"""How many bytes weights hold, however they are stored: every tensor reachable from them, once.

Where it sits: :meth:`~.base.LinearMethod.resident_bytes` counts one kernel's weights and
``loader/resident.py`` a whole model's (its parameters, its embedding and every resolved matmul),
which the loaders log at start. A weight may live in packed blocks, int8 rows and their scales, or
the parts of a concatenated matmul: each storage is counted once (two views of one storage once).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_DEPTH = 4  # a matmul → its parts → a weight record → its tensors


def storage_bytes(held: Iterable[object]) -> int:
    """Bytes of every distinct storage the objects ``held`` reach (a library's opaque copy uncounted)."""
    seen: dict[int, int] = {}
    for tensor in (t for obj in held for t in _tensors(obj, _DEPTH)):
        if tensor.is_meta:
            continue
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:  # opaque (a GEMM library's packed copy): its size is not exposed
            continue
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensors(obj: object, depth: int) -> Iterator[torch.Tensor]:
    """The tensors ``obj`` is or holds, through containers and attributes ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        yield from (t for v in vars(obj).values() if not isinstance(v, dict) for t in _tensors(v, depth - 1))
    elif depth > 0 and isinstance(obj, list | tuple):
        yield from (t for item in obj for t in _tensors(item, depth - 1))
    elif depth > 0:
        yield from (t for v in _attributes(obj) for t in _tensors(v, depth - 1))


def _attributes(obj: object) -> list[object]:
    """The values of ``obj``'s instance attributes: its ``__dict__`` and every ``__slots__`` entry."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                values.append(getattr(obj, name))
    return values
