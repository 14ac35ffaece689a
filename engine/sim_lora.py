"""The simulated engine's LoRA adapters (``kvfleet engine --simulate --lora-modules ...``).

Where it sits: an ASGI layer in front of the simulated engine's HTTP app, in its API process
(no torch, no weights). A request whose ``model`` names an adapter takes an adapter slot
before it reaches the engine, then goes on under the base model's name: at most
``--max-loras`` adapters are resident; a known, non-resident adapter loads on demand, costing
``--sim-lora-load-ms`` of simulated time, into a free slot or in place of the least recently
used idle adapter; with every slot busy it waits. The layer adds what the real engine serves
(docs/architecture.md §5): ``/load``'s ``lora`` field, the adapters in ``/v1/models`` (with
``parent``, the base model, and ``root``, the path), ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's bodies), vLLM's ``vllm:lora_requests_info`` gauge and
kvfleet's ``kvfleet:lora_*`` metrics. The engine's prefix cache is not keyed by adapter here.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvfleet.openai_api import APIError
from kvfleet.protocol import LoraLoad
from kvfleet.sse import DONE, SseReader

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class LoraMetrics:
    """vLLM's ``vllm:lora_requests_info`` and kvfleet's per-adapter counters, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.info = Gauge(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (value: the time of the update)",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        self.requests = Counter("kvfleet:lora_requests", "Requests per adapter", ["adapter"], registry=r)
        self.tokens = Counter(
            "kvfleet:lora_tokens", "Tokens per adapter (prompt, generation)", ["adapter", "kind"], registry=r
        )
        self.loads = Counter("kvfleet:lora_loads", "Adapter loads onto the device", ["adapter"], registry=r)
        self.evictions = Counter("kvfleet:lora_evictions", "Adapters evicted", ["adapter"], registry=r)
        self.resident = Gauge("kvfleet:lora_resident", "Adapters resident on the device", registry=r)


class SimAdapters:
    """Adapter residency: at most ``max_loras`` resident, LRU among idle ones, each load taking ``load_s``."""

    def __init__(self, modules: dict[str, str], max_loras: int, load_s: float) -> None:
        if max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
        if load_s < 0:
            raise ValueError(f"--sim-lora-load-ms must be >= 0, got {load_s * 1e3}")
        self.modules = dict(modules)
        self.max_loras = max_loras
        self.load_s = load_s
        self.resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.running: Tally[str] = Tally()  # requests holding the adapter (loading or in the engine)
        self.waiting: Tally[str] = Tally()  # requests waiting for a slot
        self.loaded: dict[str, asyncio.Event] = {}  # set once the adapter's load is done
        self.changed = asyncio.Condition()
        self.metrics = LoraMetrics()

    def snapshot(self) -> LoraLoad:
        return LoraLoad(
            max_loras=self.max_loras,
            resident=list(self.resident),
            running=sorted(a for a, n in self.running.items() if n > 0),
            waiting=sorted(a for a, n in self.waiting.items() if n > 0),
        )

    def _take_slot(self, name: str) -> bool:
        # Invariant: len(resident) <= max_loras, and only an adapter no request holds is evicted.
        if name in self.resident:
            self.resident.move_to_end(name)
            return True
        if len(self.resident) >= self.max_loras:
            victim = next((a for a in self.resident if self.running[a] == 0), None)
            if victim is None:
                return False
            del self.resident[victim]
            self.loaded.pop(victim, None)
            self.metrics.evictions.labels(victim).inc()
        self.resident[name] = None
        self.loaded[name] = asyncio.Event()
        self.metrics.loads.labels(name).inc()
        asyncio.get_running_loop().call_later(self.load_s, self.loaded[name].set)
        return True

    async def acquire(self, name: str) -> None:
        """Hold ``name`` for one request: resident, loaded, and not evictable until :meth:`release`."""
        self.waiting[name] += 1
        try:
            async with self.changed:
                await self.changed.wait_for(lambda: self._take_slot(name))
                self.running[name] += 1
        finally:
            self.waiting[name] -= 1
        self.metrics.requests.labels(name).inc()
        self.metrics.resident.set(len(self.resident))
        try:
            await self.loaded[name].wait()
        except BaseException:  # the client left during the load: the adapter is not held
            self.release(name)
            raise

    def release(self, name: str) -> None:
        """The request is done with ``name`` (safe in a ``finally`` of a cancelled task: nothing awaits)."""
        self.running[name] -= 1
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def add(self, name: str, path: str) -> None:
        if not name or not path:
            raise APIError(400, "lora_name and lora_path are both required", param="lora_name")
        if name in self.modules:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded", param="lora_name")
        self.modules[name] = path

    async def remove(self, name: str) -> None:
        if name not in self.modules:
            raise APIError(
                404, f"The lora adapter '{name}' is not loaded", param="lora_name", code="model_not_found"
            )
        if self.running[name] or self.waiting[name]:
            raise APIError(409, f"The lora adapter '{name}' is in use by requests", param="lora_name")
        async with self.changed:
            del self.modules[name]
            if self.resident.pop(name, 0) is None:
                self.metrics.evictions.labels(name).inc()
            self.loaded.pop(name, None)
            self.changed.notify_all()

    def update_info(self) -> None:
        lora = self.snapshot()
        self.metrics.info.clear()  # one series: the current sets (vLLM keeps every past one)
        labels = (",".join(lora.running), ",".join(lora.waiting), str(self.max_loras))
        self.metrics.info.labels(*labels).set(time.time())
        self.metrics.resident.set(len(self.resident))


class SimLoraMiddleware:
    """The ASGI layer that serves the adapters of :class:`SimAdapters` in front of the engine's app."""

    def __init__(self, app: ASGIApp, adapters: SimAdapters, base_model: str) -> None:
        self.app, self.adapters, self.base_model = app, adapters, base_model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope.get("method"), scope.get("path")
        try:
            if scope["type"] == "http" and method == "GET" and path in ("/load", "/v1/models", "/metrics"):
                await self._amended(scope, receive, send, path)
            elif scope["type"] == "http" and method == "POST" and path in ADMIN_PATHS:
                await self._admin(receive, send, path)
            elif scope["type"] == "http" and method == "POST" and path in GENERATION_PATHS:
                await self._generate(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        except APIError as err:
            await _respond(send, err.status_code, orjson.dumps(err.body()), b"application/json")

    async def _amended(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """The engine's answer to ``/load``, ``/v1/models`` or ``/metrics``, with the adapters added."""
        start: Message = {}
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        body, status = b"".join(chunks), int(start.get("status", 500))
        if status == 200:
            body = self._amend(path, body)
        kind = dict(start.get("headers") or []).get(b"content-type", b"application/json")
        await _respond(send, status, body, kind)

    def _amend(self, path: str, body: bytes) -> bytes:
        if path == "/metrics":
            self.adapters.update_info()
            return body + generate_latest(self.adapters.metrics.registry)
        obj = orjson.loads(body)
        if path == "/load":
            obj["lora"] = self.adapters.snapshot().model_dump()
        else:
            created = obj["data"][0].get("created", int(time.time())) if obj.get("data") else int(time.time())
            obj["data"] += [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvfleet",
                    "root": path_,
                    "parent": self.base_model,
                }
                for name, path_ in self.adapters.modules.items()
            ]
        return orjson.dumps(obj)

    async def _admin(self, receive: Receive, send: Send, path: str) -> None:
        try:
            body = orjson.loads(await _read_body(receive) or b"{}")
        except orjson.JSONDecodeError:
            raise APIError(400, "the body is not JSON") from None
        name = str(body.get("lora_name") or "") if isinstance(body, dict) else ""
        if path == "/v1/load_lora_adapter":
            self.adapters.add(name, str(body.get("lora_path") or "") if isinstance(body, dict) else "")
            message = f"Success: LoRA adapter '{name}' added successfully."
        else:
            await self.adapters.remove(name)
            message = f"Success: LoRA adapter '{name}' removed successfully."
        await _respond(send, 200, message.encode(), b"text/plain; charset=utf-8")

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await _read_body(receive)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in self.adapters.modules:
            await self.app(scope, _replay(raw, receive), send)
            return
        assert isinstance(body, dict)
        await self.adapters.acquire(name)
        tally = _Usage()
        try:
            body["model"] = self.base_model
            await self.app(scope, _replay(orjson.dumps(body), receive), tally.watching(send))
        finally:
            self.adapters.release(name)
            tokens = self.adapters.metrics.tokens
            tokens.labels(name, "prompt").inc(tally.prompt)
            tokens.labels(name, "generation").inc(tally.generation)


ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class _Usage:
    """The tokens of one response: its ``usage`` when it carries one, else its content chunks."""

    def __init__(self) -> None:
        self.prompt = self.generation = self._chunks = 0
        self._usage = False
        self._sse: SseReader | None = None
        self._json = b""

    def watching(self, send: Send) -> Send:
        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers") or []).get(b"content-type", b"")
                self._sse = SseReader() if kind.startswith(b"text/event-stream") else None
            elif message["type"] == "http.response.body":
                self._feed(message.get("body", b""), final=not message.get("more_body", False))
            await send(message)

        return watched

    def _feed(self, data: bytes, final: bool) -> None:
        if self._sse is not None:
            for payload in self._sse.feed(data):
                if payload != DONE:
                    self._observe(payload)
        else:
            self._json += data
            if final:
                self._observe(self._json)
        if final and not self._usage:
            self.generation = self._chunks

    def _observe(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage = True
            self.prompt = int(usage.get("prompt_tokens") or 0)
            self.generation = int(usage.get("completion_tokens") or 0)
        if obj.get("choices"):
            self._chunks += 1


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _respond(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
