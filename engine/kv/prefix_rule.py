"""The prefix-cache hit rule across KV cache groups, as vLLM's coordinator finds it.

Where it sits: ``KVCacheManager.find_cached_prefix`` asks :func:`common_hit_blocks` how many of a
sequence's first full blocks it may take from the cache when it has several groups
(``engine/kv/groups.py``) or a sliding window. Pure and torch-free.

A hit of ``n`` blocks means the sequence resumes at token ``n * block_size``. A full-attention group
needs all ``n`` blocks cached; a sliding group of window W needs only the blocks the next query
reads, those from :func:`skipped_blocks` on (the last ``ceil((W - 1) / block_size)``, or all ``n``
when fewer); the blocks before them stay placeholders (vLLM's ``find_longest_cache_hit`` of its
``FullAttentionManager`` and ``SlidingWindowManager``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def skipped_blocks(window: int | None, num_tokens: int, block_size: int) -> int:
    """The first blocks no query from position ``num_tokens`` on reads (0 for full attention)."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def _full_run(cached: Callable[[int], bool], bound: int) -> int:
    n = 0
    while n < bound and cached(n):
        n += 1
    return n


# Invariant: the result n <= bound is the largest whose blocks skipped_blocks(n)..n-1 are all cached.
def _sliding_run(cached: Callable[[int], bool], bound: int, window: int, block_size: int) -> int:
    need = -(-(window - 1) // block_size)  # blocks before the resuming token that it reads
    if need == 0:
        return bound
    run = 0  # blocks i+1 .. i+run are cached
    for i in range(bound - 1, -1, -1):
        if not cached(i):
            run = 0
            continue
        run += 1
        if run == need:
            return i + run
    return run  # blocks 0 .. run-1 cached, fewer than need: a hit of run blocks reads them all


# Invariant: the result is the largest n <= max_blocks valid for every group (each step only lowers
# the bound to the largest n valid for one group, so no larger common n is ever skipped).
def common_hit_blocks(
    windows: Sequence[int | None], block_size: int, max_blocks: int, cached: Callable[[int, int], bool]
) -> int:
    """How many first blocks hit in every group; ``cached(group, i)``: block i is cached for group."""
    n = max_blocks
    while True:
        m = n
        for g, window in enumerate(windows):
            hit = lambda i, g=g: cached(g, i)  # noqa: E731
            m = _full_run(hit, m) if window is None else _sliding_run(hit, m, window, block_size)
        if m == n:
            return n
        n = m
