"""The load-generation core: stream N requests at an OpenAI-compatible server, open or closed loop.

Where it sits: ``kvfleet bench`` (``kvfleet/bench/cli.py``), the figures in ``bench/`` and
the router's benches call :func:`run_load` with a :class:`LoadSpec`; it returns one
``RequestRecord`` per request for ``summarize``. Only standard OpenAI fields are sent
(``stream``, ``stream_options.include_usage``, ``max_tokens``, ``temperature``), so it runs
against any server, vLLM's included. Completions prompts are token-id lists, so their
length is exact on any tokenizer; chat prompts are words (about one token each).

Streams go through ``aiohttp`` and the split-on-blank-line reader of ``kvfleet/sse.py``:
with httpx's line iterator the client spent 279 µs of CPU per output token at concurrency
32 (most of what the engine step it was measuring costs); with these, 64 to 77 µs
(``bench/serving/serving_vs_offline.py``, several runs).

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

import aiohttp
from tqdm import tqdm

from kvfleet.bench.dists import Distribution
from kvfleet.bench.stats import BenchSummary, RequestRecord, summarize
from kvfleet.sse import DONE, SseReader

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
    session: aiohttp.ClientSession,
    spec: LoadSpec,
    body: dict[str, Any],
    prompt_len: int,
    clock: Callable[[], float],
) -> RequestRecord:
    """Send one streaming request; time its content chunks; take token counts from usage, else count chunks."""
    path = "/v1/completions" if spec.endpoint == "completions" else "/v1/chat/completions"
    record = RequestRecord(ok=False, start=clock(), prompt_tokens=prompt_len)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    try:
        async with session.post(
            spec.base_url + path,
            data=json.dumps(body),
            headers=_headers(spec, json_body=True),
            timeout=timeout,
        ) as resp:
            if resp.status != 200:
                record.error = _http_error(resp.status, await resp.read())
                return record
            usage = await _read_stream(resp, record, clock)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: a bad JSON event
        record.error = f"{type(exc).__name__}"
        return record
    if record.error is not None:
        return record
    record.e2e = clock() - record.start
    record.output_tokens = (
        int(usage["completion_tokens"]) if usage else len(record.itls) + (record.ttft is not None)
    )
    record.prompt_tokens = int(usage["prompt_tokens"]) if usage else prompt_len
    record.ok = record.ttft is not None or record.output_tokens == 0
    if not record.ok:
        record.error = "no content"
    return record


async def _read_stream(
    resp: aiohttp.ClientResponse, record: RequestRecord, clock: Callable[[], float]
) -> dict[str, Any] | None:
    """Read SSE events until ``[DONE]`` or the end; stamp each content chunk; the last usage seen.

    A chunk carrying several tokens (a server that coalesced a lagging stream) is one
    arrival: one ITL sample; the token count comes from usage. An error event (vLLM sends
    ``{"error": {...}}`` or ``{"object": "error", ...}`` mid-stream) ends the request as failed.
    """
    reader, usage, last = SseReader(), None, record.start
    async for data in resp.content.iter_any():
        for payload in reader.feed(data):
            if payload == DONE:
                return usage
            chunk = json.loads(payload)
            if "error" in chunk or chunk.get("object") == "error":
                record.error = "stream error " + _error_detail(chunk)
                return None
            usage = chunk.get("usage") or usage
            if _content(chunk):
                now = clock()
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itls.append(now - last)
                last = now
    return usage


def _headers(spec: LoadSpec, *, json_body: bool = False) -> dict[str, str]:
    headers = {"Content-Type": "application/json"} if json_body else {}
    if spec.api_key:
        headers["Authorization"] = f"Bearer {spec.api_key}"
    return headers


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return str(c.get("text") or (c.get("delta") or {}).get("content") or "")


def _error_detail(body: Any) -> str:
    """The OpenAI error body's code or type (``{"error": {...}}``, or vLLM's flat ``{"object": "error"}``)."""
    if not isinstance(body, dict):
        return ""
    nested = body.get("error")
    err = nested if isinstance(nested, dict) else body
    return str(err.get("code") or err.get("type") or "")


def _http_error(status: int, raw: bytes) -> str:
    try:
        detail = _error_detail(json.loads(raw))
    except ValueError:
        detail = ""
    return f"HTTP {status} {detail}".strip()


async def discover_model(session: aiohttp.ClientSession, spec: LoadSpec) -> str:
    timeout = aiohttp.ClientTimeout(total=30)
    async with session.get(spec.base_url + "/v1/models", headers=_headers(spec), timeout=timeout) as resp:
        resp.raise_for_status()
        return str((await resp.json(content_type=None))["data"][0]["id"])


def new_session(timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A session with an unbounded keep-alive pool (the loop bounds concurrency, not the pool)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def run_load(
    spec: LoadSpec,
    *,
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    progress: bool = False,
) -> LoadResult:
    """Run the whole load; every request is recorded, failures included."""
    rng = random.Random(spec.seed)
    planned = plan_requests(spec, rng)
    offsets = arrival_offsets(len(planned), spec.rate, rng)
    own = session is None
    http = session or new_session(spec.timeout_s)
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
            await http.close()
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
