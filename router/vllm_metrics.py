"""vLLM's Prometheus ``/metrics`` read as the router's :class:`~kvfleet.protocol.EngineLoad` (docs/architecture.md §6).

Pure text → model, no I/O: :mod:`kvfleet.router.engine_kinds` fetches the page and the
``vllm`` reader calls :func:`vllm_load`. Only the series the router needs are parsed:

* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges; summed over the
  ``engine`` label of a data-parallel server), their ``model_name`` label the served model;
* ``vllm:kv_cache_usage_perc`` (a fraction, despite the name), or before vLLM 0.11
  ``vllm:gpu_cache_usage_perc``; averaged over engines;
* ``vllm:cache_config_info`` (labels ``block_size``, ``num_gpu_blocks``);
* ``vllm:prefix_cache_hits_total`` / ``..._queries_total``, or the older
  ``vllm:gpu_prefix_cache_hits_total`` / ``..._queries_total`` (cumulative: the hit rate is
  since the engine started);
* ``vllm:lora_requests_info`` (labels ``max_lora``, ``running_lora_adapters``,
  ``waiting_lora_adapters``; the sample with the latest value, a timestamp, is the current one);
* ``vllm:engine_sleep_state{sleep_state="awake"}`` (0: asleep, not ready).

What vLLM does not export, and what stands in (the table in docs/architecture.md §6):
``max_num_seqs`` (:data:`VLLM_DEFAULT_MAX_NUM_SEQS`), ``draining`` (never: a vLLM server
that stops closes its socket), the adapters *resident* on the device (those running or
waiting stand in).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from kvfleet.protocol import DEFAULT_BLOCK_SIZE, EngineLoad, LoraLoad

# vLLM's own default for its OpenAI server (EngineArgs: max_num_seqs for UsageContext.OPENAI_API_SERVER)
VLLM_DEFAULT_MAX_NUM_SEQS = 256

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newest first
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
CACHE_INFO = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"
SLEEP = "vllm:engine_sleep_state"
WANTED = frozenset({RUNNING, WAITING, CACHE_INFO, LORA_INFO, SLEEP, *KV_USAGE, *PREFIX_HITS, *PREFIX_QUERIES})

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def samples(text: str, wanted: frozenset[str] = WANTED) -> dict[str, list[Sample]]:
    """The samples of the ``wanted`` series in a Prometheus text page, by name (others skipped unparsed)."""
    found: dict[str, list[Sample]] = defaultdict(list)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in wanted:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        try:
            found[m.group(1)].append(Sample(m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return found


def _first(found: dict[str, list[Sample]], names: tuple[str, ...]) -> list[Sample]:
    return next((found[n] for n in names if found.get(n)), [])


def _adapters(value: str) -> list[str]:
    return [a for a in value.split(",") if a]


def lora_load(found: dict[str, list[Sample]]) -> LoraLoad | None:
    """The latest ``vllm:lora_requests_info`` sample (its value is when it was set), or None without LoRA."""
    info = max(found.get(LORA_INFO, []), key=lambda s: s.value, default=None)
    if info is None:
        return None
    running = _adapters(info.labels.get("running_lora_adapters", ""))
    waiting = _adapters(info.labels.get("waiting_lora_adapters", ""))
    resident = list(dict.fromkeys(running + waiting))  # vLLM does not say which are on the device
    max_loras = max(1, int(float(info.labels.get("max_lora") or 1)))
    return LoraLoad(max_loras=max_loras, resident=resident, running=running, waiting=waiting)


def _cache_shape(found: dict[str, list[Sample]]) -> tuple[int, int]:
    """Block size and KV blocks (summed over the engines of a data-parallel server)."""
    infos = found.get(CACHE_INFO, [])
    block_size, blocks = DEFAULT_BLOCK_SIZE, 0
    for info in infos:
        size, count = info.labels.get("block_size", ""), info.labels.get("num_gpu_blocks", "")
        block_size = int(size) if size.isdigit() else block_size
        blocks += int(count) if count.isdigit() else 0
    return block_size, blocks


def _awake(found: dict[str, list[Sample]]) -> bool:
    awake = [s.value for s in found.get(SLEEP, []) if s.labels.get("sleep_state") == "awake"]
    return not awake or min(awake) > 0


def vllm_load(text: str, max_num_seqs: int = VLLM_DEFAULT_MAX_NUM_SEQS) -> EngineLoad:
    """An :class:`EngineLoad` from a vLLM ``/metrics`` page; ValueError if it is not one (no running gauge)."""
    found = samples(text)
    running = found.get(RUNNING, [])
    if not running:
        raise ValueError(f"no {RUNNING} series: not a vLLM /metrics page")
    kv = [s.value for s in _first(found, KV_USAGE)]
    hits = sum(s.value for s in _first(found, PREFIX_HITS))
    queries = sum(s.value for s in _first(found, PREFIX_QUERIES))
    block_size, blocks = _cache_shape(found)
    return EngineLoad(
        model=running[0].labels.get("model_name", ""),
        kv_cache_usage=min(1.0, max(0.0, sum(kv) / len(kv))) if kv else 0.0,
        num_running=round(sum(s.value for s in running)),
        num_waiting=round(sum(s.value for s in found.get(WAITING, []))),
        max_num_seqs=max_num_seqs,
        ready=_awake(found),
        block_size=block_size,
        num_kv_blocks=blocks,
        prefix_cache_hit_rate=min(1.0, hits / queries) if queries else 0.0,
        lora=lora_load(found),
    )
