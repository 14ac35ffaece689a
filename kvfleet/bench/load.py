"""The load-generation core: stream N requests at an OpenAI-compatible server, open or closed loop.

Where it sits: ``kvfleet bench`` (``kvfleet/bench/cli.py``), the figures in ``bench/`` and
the router's benches call :func:`run_load` with a :class:`LoadSpec`; it returns one
``RequestRecord`` per request for ``summarize``. Only standard OpenAI fields are sent
(``stream``, ``stream_options.include_usage``, ``max_tokens``, ``temperature``), so it runs
against any server, vLLM's included. Completions prompts are token-id lists, so their
length is exact on any tokenizer; chat prompts are words (about one token each).

Open loop: requests start at Poisson arrival times of ``rate`` per second, whatever the
server's pace. Closed loop: ``concurrency`` clients each send the next request when their
last one ends. Neither: every request starts at once.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from tqdm import tqdm

from kvfleet.bench.dists import Distribution
from kvfleet.bench.stats import BenchSummary, RequestRecord, summarize

# Token ids 33..126 are printable ASCII in byte-level vocabularies (GPT-2, Llama 3, Qwen2, tiny).
TOKEN_RANGE = (33, 126)
WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "was",
    "with",
    "as",
    "at",
    "by",
    "an",
)


@dataclass(frozen=True)
class LoadSpec:
    url: str  # the server's base URL (a trailing /v1 is accepted)
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: Literal["completions", "chat"] = "completions"
    num_requests: int = 100
    rate: float | None = None  # requests/s, Poisson (open loop)
    concurrency: int | None = None  # closed loop
    input_len: Distribution = Distribution("fixed", 128)
    output_len: Distribution = Distribution("fixed", 128)
    shared_prefix: float = 0.0  # fraction of each prompt taken from one prefix all requests share
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. {"ignore_eos": True} for vLLM

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give rate (open loop) or concurrency (closed loop), not both")
        if not 0.0 <= self.shared_prefix <= 1.0:
            raise ValueError(f"shared_prefix must be in [0, 1], got {self.shared_prefix}")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class PlannedRequest:
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    model: str

    def summary(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> BenchSummary:
        return summarize(self.records, self.duration_s, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


def plan_requests(spec: LoadSpec, rng: random.Random) -> list[PlannedRequest]:
    """Prompts and output lengths; the first ``shared_prefix`` of every prompt is the same prefix."""
    lengths = [(spec.input_len.sample(rng), spec.output_len.sample(rng)) for _ in range(spec.num_requests)]
    longest = max(n for n, _ in lengths)
    prefix = [rng.randint(*TOKEN_RANGE) for _ in range(longest)]
    planned = []
    for n, out in lengths:
        shared = round(spec.shared_prefix * n)
        ids = prefix[:shared] + [rng.randint(*TOKEN_RANGE) for _ in range(n - shared)]
        prompt: list[int] | str = (
            ids if spec.endpoint == "completions" else " ".join(WORDS[t % len(WORDS)] for t in ids)
        )
        planned.append(PlannedRequest(prompt, n, out))
    return planned


def arrival_offsets(n: int, rate: float | None, rng: random.Random) -> list[float]:
    """Start offsets in seconds: a Poisson process of ``rate`` (exponential gaps), the first at 0; all 0 without a rate."""
    if rate is None:
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def request_body(spec: LoadSpec, model: str, p: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **spec.extra_body,
    }
    if spec.endpoint == "completions":
        body["prompt"] = p.prompt
    else:
        body["messages"] = [{"role": "user", "content": p.prompt}]
    return body


async def stream_one(
    client: httpx.AsyncClient,
    spec: LoadSpec,
    body: dict[str, Any],
    prompt_len: int,
    clock: Callable[[], float],
) -> RequestRecord:
    """Send one streaming request; time its content chunks; take token counts from usage, else count chunks."""
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    record = RequestRecord(ok=False, start=clock(), prompt_tokens=prompt_len)
    chunks, last, usage = 0, record.start, None
    try:
        async with client.stream(
            "POST", spec.base_url + path, json=body, headers=headers, timeout=spec.timeout_s
        ) as resp:
            if resp.status_code != 200:
                record.error = _http_error(resp.status_code, await resp.aread())
                return record
            async for line in resp.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                if _content(chunk):
                    now = clock()
                    if record.ttft is None:
                        record.ttft = now - record.start
                    else:
                        record.itls.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}"
        return record
    record.e2e = clock() - record.start
    record.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    record.prompt_tokens = int(usage["prompt_tokens"]) if usage else prompt_len
    record.ok = record.ttft is not None or record.output_tokens == 0
    if not record.ok:
        record.error = "no content"
    return record


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return str(c.get("text") or (c.get("delta") or {}).get("content") or "")


def _http_error(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error") or {}
        detail = err.get("code") or err.get("type") or ""
    except (ValueError, AttributeError):
        detail = ""
    return f"HTTP {status} {detail}".strip()


async def discover_model(client: httpx.AsyncClient, spec: LoadSpec) -> str:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    resp = await client.get(spec.base_url + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def run_load(
    spec: LoadSpec,
    *,
    client: httpx.AsyncClient | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    progress: bool = False,
) -> LoadResult:
    """Run the whole load; every request is recorded, failures included."""
    rng = random.Random(spec.seed)
    planned = plan_requests(spec, rng)
    offsets = arrival_offsets(len(planned), spec.rate, rng)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    own = client is None
    http = client or httpx.AsyncClient(limits=limits, timeout=spec.timeout_s)
    bar = tqdm(total=len(planned), disable=not progress, desc="requests", unit="req")
    try:
        model = spec.model or await discover_model(http, spec)

        async def one(p: PlannedRequest) -> RequestRecord:
            record = await stream_one(http, spec, request_body(spec, model, p), p.prompt_len, clock)
            bar.update(1)
            return record

        start = clock()
        if spec.concurrency is not None:
            records = await _closed_loop(planned, spec.concurrency, one)
        else:
            records = await _open_loop(planned, offsets, one, clock, sleep, start)
        duration = clock() - start
    finally:
        bar.close()
        if own:
            await http.aclose()
    return LoadResult(records, duration, model)


async def _open_loop(
    planned: Sequence[PlannedRequest],
    offsets: Sequence[float],
    one: Callable[[PlannedRequest], Awaitable[RequestRecord]],
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[Any]],
    start: float,
) -> list[RequestRecord]:
    tasks = []
    for p, offset in zip(planned, offsets, strict=True):
        wait = start + offset - clock()
        if wait > 0:
            await sleep(wait)
        tasks.append(asyncio.ensure_future(one(p)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    planned: Sequence[PlannedRequest],
    concurrency: int,
    one: Callable[[PlannedRequest], Awaitable[RequestRecord]],
) -> list[RequestRecord]:
    records: list[RequestRecord | None] = [None] * len(planned)
    queue = iter(range(len(planned)))

    async def client_loop() -> None:
        for i in queue:  # a shared iterator: each index is taken by exactly one client
            records[i] = await one(planned[i])

    await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(planned)))))
    return [r for r in records if r is not None]
