"""What crosses the link between the API process and the engine core: commands, verdicts, batches.

Where it sits: between ``engine/client/core_client.py`` (the API side: :class:`~kvfleet.engine.client.core_client.ThreadCore`,
:class:`~kvfleet.engine.client.core_client.ProcessCore`) and ``engine/core/loop.py`` (the core side:
:class:`~kvfleet.engine.core.loop.CoreLoop`, :func:`~kvfleet.engine.core.loop.core_main`). The API side
sends :class:`AddCmd`, :class:`AbortCmd`, :class:`LoraCmd`, :class:`EmbedCmd` and :class:`ShutdownCmd`;
the core answers with one :class:`StepBatch` per loop iteration (verdicts on new requests, the step's
:class:`~kvfleet.engine.outputs.ReqDelta` values, the :class:`Embedded` answers, a snapshot of
``Engine.stats()``). A core
process greets with :class:`Hello` (or :class:`StartFailed`), and its batches travel as plain
tuples (:func:`to_wire`, :func:`from_wire`). Both sides import this module; it imports neither.
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvfleet.engine.outputs import EngineStats, ReqDelta, SeqDelta
from kvfleet.engine.sampling_params import SamplingParams


# ---- API side → core
class AddCmd(NamedTuple):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    lora: str | None = None  # the LoRA adapter's name; None: the base model


class LoraCmd(NamedTuple):
    """Load (``path`` set) or unload (``path`` None) an adapter; answered by a Verdict for ``op_id``."""

    op_id: str
    name: str
    path: str | None


class AbortCmd(NamedTuple):
    request_id: str


class EmbedCmd(NamedTuple):
    """Embed these prompts (``--runner pooling``): answered by one :class:`Embedded` for ``request_id``."""

    request_id: str
    prompts: list[list[int]]
    dimensions: int | None = None


class ShutdownCmd(NamedTuple):
    reason: str = "the engine is shutting down"


Command = AddCmd | AbortCmd | LoraCmd | EmbedCmd | ShutdownCmd


# ---- core → API side
class Verdict(NamedTuple):
    """The engine's answer to one AddCmd: accepted (reason None) or its RequestError's reason and field."""

    request_id: str
    reason: str | None = None
    field: str | None = None
    status: int = 400  # the HTTP status of a refusal (LoraError's: 404 unknown adapter, 409 in use)
    code: str | None = None


class Embedded(NamedTuple):
    """The core's answer to one EmbedCmd: a float32 vector's bytes per prompt, or a refusal naming the field."""

    request_id: str
    vectors: list[bytes]
    num_prompt_tokens: int
    reason: str | None = None
    field: str | None = None


class StepBatch(NamedTuple):
    """One loop iteration's news. ``step_started`` is None when no step ran (verdicts, aborts only)."""

    now: float  # time.monotonic() of the core when the batch was made (shared clock on one host)
    step_started: float | None
    verdicts: list[Verdict]
    deltas: list[ReqDelta]
    stats: EngineStats | None  # None only in the batch that reports a core that died before greeting
    error: str | None = None  # set once: the core is dead, every stream fails with this
    embedded: list[Embedded] = []  # noqa: RUF012 (a NamedTuple's default, never mutated)


class Hello(NamedTuple):
    """A core process is up: what the API process needs to serve it."""

    model_name: str
    max_model_len: int
    stats: EngineStats


class StartFailed(NamedTuple):
    message: str  # the factory's ValueError / OSError, on one line


# ---- the wire: a StepBatch as plain tuples
# Pickling a NamedTuple calls back into Python once per object (its __getnewargs__); plain
# tuples pickle in C. For a 32-sequence decode step that is 113 -> 39 us in the core, where
# every microsecond is one the model step does not get (timeit, 32 one-token deltas).
WireBatch = tuple[Any, ...]


def to_wire(b: StepBatch) -> WireBatch:
    deltas = [(d[0], d[1], d[2], d[3], [tuple(s) for s in d[4]]) for d in b.deltas]
    embedded = [tuple(e) for e in b.embedded]
    return (b.now, b.step_started, [tuple(v) for v in b.verdicts], deltas, b.stats, b.error, embedded)


def from_wire(w: WireBatch) -> StepBatch:
    now, started, verdicts, deltas, stats, error, embedded = w
    return StepBatch(
        now,
        started,
        [Verdict(*v) for v in verdicts],
        [ReqDelta(r, f, p, c, [SeqDelta(*s) for s in seqs]) for r, f, p, c, seqs in deltas],
        stats,
        error,
        [Embedded(*e) for e in embedded],
    )
