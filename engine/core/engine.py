"""The engine loop: requests in, one scheduled and executed step at a time, request outputs out.

Where it sits: the server and ``LLM.generate`` call :meth:`Engine.add_request` and
:meth:`Engine.step`; each step is ``Scheduler.schedule()`` → ``Runner.execute(plan)`` →
``Scheduler.update()`` → output processing (detokenise, stop checks) → one
:class:`ReqDelta` per request that changed (what the step added, never the whole output). Torch
stays out of this module (the simulated engine runs it without torch); the runner is built lazily.

Context limit: a prompt longer than ``max_model_len`` (or than the whole KV cache) is
rejected; ``prompt + max_tokens`` beyond the limit is not: the sequence finishes with
``"length"`` when it reaches the limit, as vLLM's offline ``LLM`` does.

n > 1: the request's first sequence computes the prompt; once its prompt KV is in the
cache the other n - 1 sequences fork from it, sharing its full prompt blocks by
reference count (``KVCacheManager.fork``) and recomputing only the last partial block.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.async_scheduling import AsyncSteps
from kvfleet.engine.core.messages import AddCmd
from kvfleet.engine.core.output_processor import DetokenizerFactory, RequestState, SeqOutputState
from kvfleet.engine.core.step_profile import profile_at_start
from kvfleet.engine.kv.block_hash import cache_namespace
from kvfleet.engine.kv.kv_cache_manager import KVCacheManager, cdiv
from kvfleet.engine.loader.sources import served_name
from kvfleet.engine.lora.config import LoraError, unknown_adapter
from kvfleet.engine.lora.stats import LoraUsage
from kvfleet.engine.outputs import EngineStats, ReqDelta
from kvfleet.engine.runner.base import Runner
from kvfleet.engine.sampling_params import RequestError, RequestOutputKind, SamplingParams
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sched.scheduler import Sampled, Scheduler
from kvfleet.engine.sched.step_cost import StepShape
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN, Sequence
from kvfleet.engine.tokenizer.base import Tokenizer
from kvfleet.engine.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # the real modules import xgrammar and torch: only an engine with a model builds them
    from kvfleet.engine.lora.manager import LoraManager
    from kvfleet.engine.structured import StructuredOutputs

__all__ = ["Engine", "EngineStats", "RequestError"]  # the last two live where the API process imports them


GRAMMAR_WAIT_S = 0.02  # an idle step waits this long at most for a compile to finish


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        detokenizer_factory: DetokenizerFactory | None = None,
    ) -> None:
        self.config = config
        self.model_name = config.served_model_name or served_name(config.model)
        model_max_len: int | None = None
        vocab_size: int | None = None  # the logits' width, known with a model
        eos_ids: frozenset[int] = frozenset()
        prefix_caching = config.enable_prefix_caching
        kv_window: int | None = None  # with a model whose every layer slides: blocks out of it are freed
        group_windows: tuple[int | None, ...] | None = None  # per KV cache group (engine/kv/groups.py)
        if runner is None and tokenizer is None:
            from kvfleet.engine.runner.model_runner import build_runner

            runner, tokenizer, info = build_runner(config)
            self.model_name = config.served_model_name or info.name
            model_max_len, eos_ids = info.max_model_len, frozenset(info.eos_token_ids)
            prefix_caching = prefix_caching and info.prefix_caching_exact
            vocab_size = info.vocab_size
            kv_window, group_windows = info.kv_window, info.kv_group_windows
        if runner is None or tokenizer is None:
            raise ValueError(
                "Engine: pass both runner and tokenizer, or neither (then both are built from config)"
            )
        self.runner, self.tokenizer = runner, tokenizer
        self.eos_token_ids = eos_ids | frozenset(tokenizer.eos_token_ids)
        # Structured outputs (engine/structured): with a model only; the runner masks its logits.
        self.structured: StructuredOutputs | None = (
            None if vocab_size is None else self._structured_outputs(vocab_size)
        )
        self._awaiting_grammar: dict[str, list[Sequence]] = {}  # request id → its sequences, unscheduled
        self._late_verdicts: list[tuple[str, RequestError | None]] = []
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else None
        self.kv = KVCacheManager(
            runner.num_kv_blocks, config.block_size, prefix_caching, kv_window, group_windows, chunk
        )
        self.max_model_len = config.max_model_len or model_max_len or self.kv.max_tokens_per_seq()
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_loras=config.max_loras if config.lora_enabled else None,
            target_step_s=None if config.target_step_ms is None else config.target_step_ms / 1e3,
            decode_factor=config.stall_free_factor if config.plans_stall_free else None,
        )
        self.lora: LoraManager | None = getattr(runner, "lora", None) if config.lora_enabled else None
        self._lora_usage = LoraUsage()
        for name, path in config.lora_modules.items():
            self.load_lora(name, path)
        self._detokenizer_factory = detokenizer_factory
        self._requests: dict[str, RequestState] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_finished = 0
        self._num_steps_run = 0  # steps that ran a plan, while a step time target is set
        self._host_token_requests = 0  # unfinished requests whose sampling reads earlier tokens on the host
        self._async = AsyncSteps.for_engine(self) if config.async_scheduling else None
        self.on_step_end: Callable[[], None] | None = None  # engine/kv_events: publishes the step's events
        if vocab_size is not None and config.plans_stall_free and config.profile_step_cost:
            profile_at_start(self.runner, self.kv, self.scheduler, self.max_model_len, vocab_size)

    def _structured_outputs(self, vocab_size: int) -> StructuredOutputs:
        """The grammar machinery, handed to the runner too (it masks the logits of constrained rows)."""
        from kvfleet.engine.structured import StructuredOutputs

        structured = StructuredOutputs(
            self.tokenizer,
            vocab_size,
            self.eos_token_ids,
            compile_timeout_s=self.config.structured_outputs_compile_timeout,
            max_rows=self.config.max_num_seqs,
        )
        self.runner.structured = structured  # type: ignore[attr-defined]
        return structured

    # ---- requests in
    def add(self, cmd: AddCmd) -> list[int]:
        """:meth:`add_request` of a command from the API side (``engine/core/messages.py``)."""
        return self.add_request(
            cmd.request_id,
            cmd.prompt,
            cmd.params,
            priority=cmd.priority,
            arrival_time=cmd.arrival_time,
            lora=cmd.lora,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> list[int]:
        """Queue a request (under the LoRA adapter ``lora``, None: the base model); its prompt's token
        ids. :class:`RequestError` (naming the field) before anything is allocated."""
        if lora is not None and (self.lora is None or lora not in self.lora.paths):
            raise unknown_adapter(lora, "model")
        if request_id in self._requests:
            raise RequestError("request_id", f"{request_id!r} is already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise RequestError("params", f"must be a SamplingParams, got {type(params).__name__}")
        if params.structured is not None and self.structured is None:
            raise RequestError(
                params.structured.param, "structured outputs need a model (this engine has none)"
            )
        prompt_ids = self._prompt_token_ids(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        namespace = cache_namespace(cache_salt=params.cache_salt, adapter=lora)  # every fork shares it
        seqs = [
            Sequence(
                request_id,
                prompt_ids,
                params,
                index=i,
                arrival_time=arrival,
                priority=priority,
                cache_namespace=namespace,
                lora_name=lora,
            )
            for i in range(params.n)
        ]
        if lora is not None:
            self._lora_usage.requests[lora] += 1
        per_step = params.output_kind is RequestOutputKind.PER_STEP
        lazy = not per_step and not params.stop  # nobody reads the text before the end
        states = [SeqOutputState(seq, self._make_detokenizer(params), lazy_text=lazy) for seq in seqs]
        host = params.penalised or params.logprobs is not None or params.structured is not None
        self._requests[request_id] = RequestState(request_id, prompt_ids, states, per_step, host)
        self._host_token_requests += host
        if params.structured is not None and self.structured is not None:
            self.structured.submit(request_id, params.structured)  # scheduled once compiled
            self._awaiting_grammar[request_id] = seqs
        else:
            self.scheduler.add(seqs[0], forks=seqs[1:])
        return prompt_ids

    # ---- requests whose grammar compiles (engine/structured): their verdict waits for it
    def verdict_deferred(self, request_id: str) -> bool:
        """Whether the request just added is accepted or refused only once its grammar compiled."""
        return request_id in self._awaiting_grammar

    def take_verdicts(self) -> list[tuple[str, RequestError | None]]:
        """The deferred verdicts reached since the last call: (request id, None or its refusal)."""
        verdicts, self._late_verdicts = self._late_verdicts, []
        return verdicts

    def _admit_compiled(self) -> None:
        assert self.structured is not None
        for request_id, grammar, error in self.structured.settled():
            seqs = self._awaiting_grammar.pop(request_id)
            self._late_verdicts.append((request_id, error))
            if grammar is None:
                self._host_token_requests -= self._requests.pop(request_id).reads_host_tokens
                continue
            for seq in seqs:
                self.structured.start(seq.seq_id, grammar)
            self.scheduler.add(seqs[0], forks=seqs[1:])

    def _make_detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        if self._detokenizer_factory is not None:
            return self._detokenizer_factory(self.tokenizer)
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("prompt", "must not be empty")
        vocab = self.tokenizer.vocab_size
        for pos, tok in enumerate(ids):
            if not isinstance(tok, int) or not 0 <= tok < vocab:
                raise RequestError(
                    "prompt", f"token id {tok!r} at position {pos} is outside the vocabulary [0, {vocab})"
                )
        if len(ids) > self.max_model_len:
            raise RequestError(
                "prompt", f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        if len(ids) > self.kv.max_tokens_per_seq():
            raise RequestError(
                "prompt",
                f"the prompt has {len(ids)} tokens and needs {cdiv(len(ids), self.kv.block_size)} KV blocks; "
                f"the KV cache holds {self.kv.num_blocks} blocks of {self.kv.block_size} tokens",
            )
        return ids

    def abort(self, request_id: str) -> ReqDelta | None:
        """Abort a request and free its blocks; its last delta (finish_reason "abort"), or None if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._forget(request_id)
        if self._awaiting_grammar.pop(request_id, None) is not None:
            assert self.structured is not None
            self.structured.cancel(request_id)
            self._late_verdicts.append(
                (request_id, RequestError(None, "aborted before its grammar compiled"))
            )
        if self.structured is not None:
            self.structured.release(s.seq.seq_id for s in request.states)
        self.scheduler.abort(request_id)
        for state in request.states:
            outputs = state.seq.output_token_ids
            if outputs and outputs[-1] == PLACEHOLDER_TOKEN:  # async scheduling: never read, never emitted
                outputs.pop()
            state.abort()
        return request.delta()

    # ---- the loop
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[ReqDelta]:
        """Schedule, execute and process one step; one delta per request that changed.

        A FINAL_ONLY request appears only in the step that finishes it: its one delta holds
        the whole completion. With async scheduling the deltas are those of the step launched by
        the previous call (``engine/core/async_scheduling.py``).
        """
        if self._awaiting_grammar:
            self._admit_compiled()
        deltas = self._async.step() if self._async is not None else self.sync_step()
        if self.on_step_end is not None:
            self.on_step_end()
        return deltas

    def sync_step(self) -> list[ReqDelta]:
        """One step, its tokens read before it returns."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.idle()
            return []
        samples = self.runner.execute(plan)
        outputs = self.process(self.scheduler.update(plan, samples))
        self.observe(plan, started)
        return outputs

    def idle(self) -> None:
        """Nothing to run: wait briefly for a grammar compile, if one is under way."""
        if self._awaiting_grammar:
            assert self.structured is not None
            self.structured.wait(GRAMMAR_WAIT_S)

    def process(self, sampled: list[Sampled]) -> list[ReqDelta]:
        """Stop checks, detokenisation and the deltas of the sequences that sampled a token."""
        changed: dict[str, RequestState] = {}
        max_len = min(self.max_model_len, self.kv.max_tokens_per_seq())
        requests, eos_ids, grammar = self._requests, self.eos_token_ids, self.structured
        self._generation_tokens += len(sampled)
        for seq, result in sampled:
            request = requests[seq.request_id]
            if seq.lora_name is not None:
                self._count_lora_tokens(seq)
            if seq.index == 0 and len(seq.output_token_ids) == 1:
                self._prompt_tokens += len(seq.prompt_token_ids)
            status = request.states[seq.index].on_token(result, eos_ids, max_len)
            if grammar is not None and seq.params.structured is not None:
                if status is None and grammar.accept(seq.seq_id, result.token_id):
                    status = request.states[seq.index].stop()  # the grammar ended (on a stop token)
                if status is not None:
                    grammar.release((seq.seq_id,))
            if status is not None:
                self.scheduler.finish(seq, status)
                changed[seq.request_id] = request
            elif request.per_step:
                changed[seq.request_id] = request
        outputs = [r.delta() for r in changed.values() if r.per_step or r.finished]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id)
        self._num_finished += 1
        if request.reads_host_tokens:
            self._host_token_requests -= 1

    @property
    def reads_host_tokens(self) -> bool:
        """Whether a request whose sampling needs the previous token on the host is unfinished."""
        return self._host_token_requests > 0

    def observe(self, plan: SchedulerPlan, started: float) -> None:
        """Feed the stall-free cost model the step's seconds: the runner's clock if it keeps one (the simulator's),
        else the whole step's wall time (what a stream waits); not the first step (the runner's lazy set-up)."""
        if not self.scheduler.stall_free:
            return
        wall_s, clock = time.perf_counter() - started, getattr(self.runner, "last_step_seconds", None)
        self._num_steps_run += 1
        if self._num_steps_run > 1:
            seconds = wall_s if clock is None else float(clock)
            self.scheduler.step_cost.observe(StepShape.of(plan.scheduled), seconds)

    # ---- LoRA adapters (engine/lora)
    def load_lora(self, name: str, path: str) -> None:
        """Register an adapter (checked now; on the device when a request asks for it)."""
        if self.lora is None:
            raise LoraError(
                "lora_name",
                "LoRA is not enabled on this engine; start it with --enable-lora or --lora-modules",
            )
        self.lora.register(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter; refused while a request runs or waits under it."""
        if self.lora is None or name not in self.lora.paths:
            raise unknown_adapter(name)
        users = [r.request_id for r in self._requests.values() if r.states[0].seq.lora_name == name]
        if users:
            raise LoraError(
                "lora_name",
                f"adapter {name!r} is in use by {len(users)} unfinished request(s)",
                409,
                "lora_in_use",
            )
        self.lora.unregister(name)

    def _count_lora_tokens(self, seq: Sequence) -> None:
        assert seq.lora_name is not None
        self._lora_usage.generation_tokens[seq.lora_name] += 1
        if seq.index == 0 and len(seq.output_token_ids) == 1:
            self._lora_usage.prompt_tokens[seq.lora_name] += len(seq.prompt_token_ids)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._awaiting_grammar),
            kv_cache_usage=self.kv.usage(),
            num_kv_blocks=self.kv.num_blocks,
            max_num_seqs=self.scheduler.max_num_seqs,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_requests_finished=self._num_finished,
            lora=None
            if self.lora is None
            else self._lora_usage.snapshot(
                self.lora,
                (s.lora_name for s in self.scheduler.running),
                (s.lora_name for s in self.scheduler.waiting),
            ),
        )
