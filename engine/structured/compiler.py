"""Grammar compilation off the step loop: a thread pool, one compile per distinct spec.

Where it sits: :class:`~kvfleet.engine.structured.StructuredOutputs` submits each constrained
request's spec here and polls the future between steps; the step loop never waits on a
compile (xgrammar compiles in C++ without the GIL, so the pool's threads run beside the model
step). Each kind of spec compiles by the function registered for it in :data:`COMPILERS`.

Cache: a spec's future is kept (successes and failures alike: both are deterministic), so a
cached schema is served at once; the least recently used are dropped beyond ``cache_size``.
A compile that outlives a request's timeout keeps running and stays cached: the request that
waited is refused, a later one with the same spec may find it done.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from kvfleet.engine.sampling_params import StructuredOutputSpec

Compile = Callable[[xgr.GrammarCompiler, str], xgr.CompiledGrammar]

ANY_OBJECT = '{"type": "object"}'


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (JSON string literals are xgrammar's literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json(c: xgr.GrammarCompiler, value: str) -> xgr.CompiledGrammar:
    # Compact separators, no free whitespace: a small model cannot ramble in blanks, and every
    # output is still the schema's JSON. strict_mode: no properties the schema does not name.
    grammar = xgr.Grammar.from_json_schema(value, any_whitespace=False, strict_mode=True)
    return c.compile_grammar(valid_json_strings(str(grammar)))


def _json_object(c: xgr.GrammarCompiler, value: str) -> xgr.CompiledGrammar:
    grammar = xgr.Grammar.from_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
    return c.compile_grammar(valid_json_strings(str(grammar)))


NOT_IN_JSON_STRINGS = "\\0-\\x1f\\ud800-\\udfff"  # raw control characters, UTF-8-encoded surrogates


def valid_json_strings(ebnf: str) -> str:
    """The EBNF with raw control characters and encoded surrogates left out of every negated class.

    In a JSON grammar a negated class is a string's characters, where JSON forbids the first and
    UTF-8 the second; xgrammar 0.2.9's length-bounded string rule (``maxLength``) allows both, and
    its matcher takes a surrogate's three bytes as a character (a small model does sample them).
    """
    # Invariant: only a "[^" that opens a character class changes, never one inside a "..." literal.
    out, i, n = [], 0, len(ebnf)
    in_literal = in_class = False
    while i < n:
        ch = ebnf[i]
        out.append(ch)
        if ch == "\\" and (in_literal or in_class) and i + 1 < n:
            out.append(ebnf[i + 1])
            i += 2
            continue
        if in_literal:
            in_literal = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            in_literal = True
        elif ch == "[":
            in_class = True
            if ebnf.startswith("^", i + 1):
                out.append("^" + NOT_IN_JSON_STRINGS)
                i += 1
        i += 1
    return "".join(out)


def _choice(c: xgr.GrammarCompiler, value: str) -> xgr.CompiledGrammar:
    return c.compile_grammar(choice_grammar(json.loads(value)))


COMPILERS: dict[str, Compile] = {
    "json": _json,
    "json_object": _json_object,
    "regex": lambda c, value: c.compile_regex(value),
    "choice": _choice,
    "grammar": lambda c, value: c.compile_grammar(value),
}


class GrammarCompilerService:
    """Compiles specs on ``workers`` threads; :meth:`submit` answers a cached spec's future at once."""

    def __init__(self, info: xgr.TokenizerInfo, *, workers: int = 2, cache_size: int = 256) -> None:
        self._compiler = xgr.GrammarCompiler(info, max_threads=workers, cache_enabled=False)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvfleet-grammar")
        self._cache: OrderedDict[StructuredOutputSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # compiles started (a cache hit starts none)

    def submit(self, spec: StructuredOutputSpec) -> Future[xgr.CompiledGrammar]:
        found = self._cache.get(spec)
        if found is not None:
            self._cache.move_to_end(spec)
            return found
        future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        with self._lock:
            self.num_compiled += 1
        return COMPILERS[spec.kind](self._compiler, spec.value)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
