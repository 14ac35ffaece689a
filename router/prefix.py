"""The router's own record of where prompt prefixes went: prefix affinity for the picker.

The prompt's text is cut into fixed-size chunks (``prefix_chunk_chars``) and hashed as
a chain, each hash covering its chunk and every chunk before it, as the engine's
prefix cache hashes full KV blocks. Two prompts share their first *n* hashes exactly
when they share their first *n* chunks, so "how many leading hashes has engine E
seen" estimates how much of the prompt E still has in its prefix cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvfleet.router.discovery import Service


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a completion, chat or embeddings request's prompt is made of, in order."""
    if "messages" in body:
        parts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, list):
                content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            parts.append(
                f"{message.get('role', '') if isinstance(message, Mapping) else ''}\n{content or ''}\n"
            )
        return "".join(parts)
    prompt = body.get("prompt", body.get("input", ""))  # an embeddings request's is its input
    if isinstance(prompt, list):
        return "".join(str(p) for p in prompt)
    return str(prompt)


def cache_namespace(cache_salt: str | None = None, adapter: str | None = None) -> str:
    """The prefix index's namespace of a request, as the engine keys its cache: by the tenant's
    cache salt and the LoRA adapter (``""``, the shared namespace, when neither is set)."""
    if cache_salt is None and adapter is None:
        return ""
    return "".join(f"{len(part)}:{part}" for part in (cache_salt or "", adapter or ""))


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The ``cache_salt`` the engine gets for a tenant's request (docs/architecture.md §6): the tenant,
    and the client's own salt, if any, within it. No client salt of one tenant yields another's."""
    parts = (tenant, client_salt or "")
    digest = hashlib.sha256(b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts))
    return f"tenant-{digest.hexdigest()}"


def engine_cache_salt(tenant: str, client_salt: str | None, shared: bool) -> str | None:
    """The ``cache_salt`` a request is sent with: the client's own where tenants share the prefix
    cache, else the tenant's (:func:`tenant_cache_salt`); the prefix index is keyed by it too."""
    return client_salt if shared else tenant_cache_salt(tenant, client_salt)


def shares_prefix_cache(service: Service | None, default: bool) -> bool:
    """An InferenceService's ``spec.routing.sharedPrefixCache``; the router's ``--shared-prefix-cache``
    for a model no InferenceService describes (or one that leaves it out)."""
    return default if service is None or service.shared_prefix_cache is None else service.shared_prefix_cache


def block_hashes(text: str, chunk_chars: int, namespace: str = "") -> list[int]:
    # Invariant: hashes[i] = H(hashes[i-1], text[i*c:(i+1)*c]) over full chunks only, so
    # hashes[i] identifies the whole prefix text[: (i+1)*c] within its namespace (the
    # engine's cache namespace: a tenant's cache salt, a LoRA adapter; "" is shared).
    data = text.encode("utf-8", "surrogatepass")  # validation refuses lone surrogates; never crash on one
    hashes: list[int] = []
    parent = hashlib.blake2b(namespace.encode(), digest_size=8).digest() if namespace else b""
    for start in range(0, len(data) - chunk_chars + 1, chunk_chars):
        digest = hashlib.blake2b(parent + data[start : start + chunk_chars], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


class PrefixIndex:
    """block hash → engines that were sent a prompt containing it; LRU-bounded.

    It also keeps, per engine, the distinct prompt starts (first block hashes) still in
    the index: how many different prefixes compete for that engine's cache.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, set[str]] = OrderedDict()
        self._starts: dict[str, set[int]] = {}

    def prompt_starts(self, engine: str) -> int:
        return len(self._starts.get(engine, ()))

    def __len__(self) -> int:
        return len(self._blocks)

    def matched_blocks(self, hashes: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """For each engine, how many of the leading ``hashes`` it has been sent."""
        result: dict[str, int] = {}
        for engine in engines:
            n = 0
            for h in hashes:
                holders = self._blocks.get(h)
                if holders is None or engine not in holders:
                    break
                n += 1
            result[engine] = n
        return result

    def record(self, hashes: Sequence[int], engine: str) -> None:
        # Invariant: at most ``capacity`` hashes are kept; the least recently recorded go first,
        # and an engine's starts are exactly the first hashes recorded for it still kept.
        if hashes:
            self._starts.setdefault(engine, set()).add(hashes[0])
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                self._blocks[h] = {engine}
            else:
                holders.add(engine)
                self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            gone, holders = self._blocks.popitem(last=False)
            for holder in holders:
                self._starts.get(holder, set()).discard(gone)

    def forget(self, engine: str) -> None:
        """An engine left (or restarted with an empty cache): drop it everywhere."""
        self._starts.pop(engine, None)
        for h in [h for h, holders in self._blocks.items() if engine in holders]:
            holders = self._blocks[h]
            holders.discard(engine)
            if not holders:
                del self._blocks[h]
