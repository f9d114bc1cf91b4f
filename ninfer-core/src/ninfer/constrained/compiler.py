"""Compiling constraints against one vocabulary, with a cache shared by every request of a Frontend.

:class:`GrammarCompiler` is built once per Frontend (lazily, at the first constrained request: indexing a
large vocabulary takes a noticeable fraction of a second) and is thread-safe: ``submit`` calls it on the
submitting threads, never on the engine worker. The grammar text comes from the frontend's
:class:`GrammarSource` (its output format decides, e.g., what a tool call looks like); the compiler only
caches and compiles it.

Vocabulary adaptation: token ``i`` spells ``token_bytes[i]`` (the detokenizer's exact bytes, so the
grammar sees what the OutputSession will decode). Special tokens (``<|im_end|>``...) spell nothing for
the grammar: they are never allowed as text; the request's stop tokens are allowed exactly where the
grammar may end. Ids past the tokenizer (embedding padding) are never allowed.

Cache invariants: a key is (constraint, the tools it reads, whether the output starts in reasoning);
equal keys share one compiled grammar; concurrent cold compiles of one key compile once (the others
wait for it); at most ``max_concurrent`` different keys compile at the same time; compiled grammars
are kept least-recently-used within ``cache_bytes`` (xgrammar's own size estimate); a failure is not
cached (the error is raised to every waiter of that compile).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ninfer.constrained.grammars import clean_error
from ninfer.contracts import constraint_limits
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError

DEFAULT_CACHE_BYTES = 256 << 20


class GrammarSource(Protocol):
    """A frontend's grammar writer: the EBNF text (GBNF syntax, root rule ``root``) of a request's constraint.

    Invariants the cache relies on: the text depends only on ``constraint``, on ``tools`` when
    ``constraint.kind == "tools"`` and on ``thinking_open`` (the output starts inside the model's
    reasoning); a constraint it cannot express raises
    :class:`~ninfer.contracts.errors.InvalidConstraintError`.
    :func:`~ninfer.constrained.grammars.text_constraint_ebnf` writes every kind but ``tools``.
    """

    def __call__(self, constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]], *,
                 thinking_open: bool) -> str: ...


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools as canonical text (a cache key part): key order kept, it is the parameter order."""
    return json.dumps(list(tools), ensure_ascii=False, default=str)


class _InFlight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class GrammarCompiler:
    """Compiles :class:`OutputConstraint` values for one vocabulary (see the module docstring), with the
    grammar text ``source`` writes."""

    def __init__(self, token_bytes: Sequence[bytes], special_token_ids: frozenset[int], vocab_size: int,
                 eos_token_ids: Sequence[int], *, source: GrammarSource, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 max_concurrent: int = 2, threads_per_compile: int = 1) -> None:
        import xgrammar as xgr

        if vocab_size < len(token_bytes):
            raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {len(token_bytes)} tokens")
        encoded = [b"" if i in special_token_ids else b for i, b in enumerate(token_bytes)]
        self.vocab_size = vocab_size
        self._source = source
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                       stop_token_ids=list(self.eos_token_ids))
        # xgrammar's own cache is off: ours keys on the constraint (skipping the text building too).
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=threads_per_compile, cache_enabled=False)
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[tuple, _InFlight] = {}
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self.compiles = 0  # cold compiles done (for tests and statistics)

    @staticmethod
    def key(constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]], thinking_open: bool) -> tuple:
        return (constraint, tools_key(tools) if constraint.kind == "tools" else "", bool(thinking_open))

    def compile(self, constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]] = (), *,
                thinking_open: bool = False):
        """The xgrammar CompiledGrammar of ``constraint``; raises InvalidConstraintError (also for tools past
        the limits of :mod:`~ninfer.contracts.constraint_limits`, checked before the cache is consulted)."""
        key = self.key(constraint, tools, thinking_open)
        if constraint.kind == "tools":
            constraint_limits.check_source_bytes(key[1], "the tools")
            constraint_limits.check_schema_document(list(tools), "the tools")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            flight = self._inflight.get(key)
            owner = flight is None
            if owner:
                flight = self._inflight[key] = _InFlight()
        assert flight is not None
        if not owner:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.result
        try:
            with self._slots:
                compiled = self._compile(constraint, tools, thinking_open)
            flight.result = compiled
            self._store(key, compiled)
            return compiled
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._inflight[key]
            flight.done.set()

    def _compile(self, constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]], thinking_open: bool):
        import xgrammar as xgr

        ebnf = self._source(constraint, tools, thinking_open=thinking_open)
        try:
            compiled = self._compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
        except Exception as exc:
            raise InvalidConstraintError(f"the {constraint.kind} constraint does not compile: "
                                         f"{clean_error(exc)}") from exc
        self.compiles += 1
        return compiled

    def _store(self, key: tuple, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if size > self._cache_bytes:
                return  # larger than the whole budget: used by its requests, not retained
            self._cache[key] = (compiled, size)
            self._cached_bytes += size
            while self._cached_bytes > self._cache_bytes:
                _, (_, old) = self._cache.popitem(last=False)
                self._cached_bytes -= old

    @property
    def cached(self) -> int:
        with self._lock:
            return len(self._cache)


__all__ = ["DEFAULT_CACHE_BYTES", "GrammarCompiler", "GrammarSource", "tools_key"]
