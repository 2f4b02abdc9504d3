"""Grammars compiled off the busy loop, once per spec.

`GrammarCompiler` owns a small thread pool (the engine core's compile threads): `submit`
returns at once with a future of the spec's `CompiledGrammar`; the same spec submitted again
gets the same future (an LRU cache of `CACHE_SIZE` specs, failures included: a spec that did
not compile fails again at once). A compiled grammar is a *prototype* matcher, never advanced:
each request gets its own ``deep_copy`` (microseconds), as vLLM's guidance backend makes one
matcher per request.

llguidance drops the GIL while it builds a matcher (its docs: 100-1000 ms for extremely
complex grammars), so the busy loop keeps stepping meanwhile. Its tokenizer (the model's, with
the model's vocabulary size and EOS ids) is built once, on the same pool, started when the
compiler is made.

Thread safety: `submit` runs on the busy loop, compiles on the pool's threads; the cache and
the counters are guarded by one lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from vconsole.engine.structured.grammar import PREFIX, first_line, to_grammar
from vconsole.wire.sampling import StructuredSpec

CACHE_SIZE = 256
COMPILE_THREADS = 2


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A spec compiled against the model's tokenizer: a fresh matcher to copy, or why not."""

    matcher: LLMatcher | None
    error: str | None         # "structured output: <llguidance's message>" when it failed
    compile_s: float          # wall time of the compile (the tokenizer's wait excluded)


def build_tokenizer(hf_tokenizer: Any, vocab_size: int,
                    eos_token_ids: tuple[int, ...]) -> LLTokenizer:
    """llguidance's view of the model's tokenizer: ``n_vocab`` the wider of the model's and the
    tokenizer's vocabulary (the bitmask then covers every logit; ids the tokenizer lacks are
    never allowed), the model's EOS ids as its EOS (so EOS is allowed exactly where the
    grammar may end)."""
    from llguidance.hf import from_tokenizer

    n_vocab = max(vocab_size, len(hf_tokenizer))
    eos = [t for t in eos_token_ids if 0 <= t < n_vocab] or None
    return from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)


class GrammarCompiler:
    """See the module docstring. ``make_tokenizer`` runs once, on the pool."""

    def __init__(self, make_tokenizer: Callable[[], LLTokenizer], *,
                 threads: int = COMPILE_THREADS, cache_size: int = CACHE_SIZE) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vconsole-grammar")
        self._cache: OrderedDict[StructuredSpec, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer: Future[LLTokenizer] = self._pool.submit(make_tokenizer)
        self.num_compiles = 0         # compiles run (failed ones included)
        self.num_cache_hits = 0       # submits served by the cache
        self.num_errors = 0           # compiles that failed
        self.compile_seconds = 0.0    # wall time of the compiles, summed

    @property
    def vocab_size(self) -> int:
        """The bitmask's vocabulary (waits for the tokenizer: call off the busy loop or once
        a grammar compiled)."""
        return self._tokenizer.result().vocab_size

    def submit(self, spec: StructuredSpec) -> tuple[Future[CompiledGrammar], bool]:
        """The future of ``spec``'s compiled grammar, and whether the cache had it."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return fut, True
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut, False

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        try:
            tokenizer = self._tokenizer.result()
        except Exception as e:
            return self._count(CompiledGrammar(
                None, f"{PREFIX}this model's tokenizer cannot be used for structured output "
                      f"({type(e).__name__}: {e})", 0.0))
        t0 = time.perf_counter()
        try:
            matcher = self.build_matcher(tokenizer, to_grammar(spec))
        except ValueError as e:
            return self._count(CompiledGrammar(None, str(e), time.perf_counter() - t0))
        error = PREFIX + first_line(matcher.get_error()) if matcher.is_error() else None
        return self._count(CompiledGrammar(None if error else matcher, error,
                                           time.perf_counter() - t0))

    @staticmethod
    def build_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
        """The compile itself (drops the GIL); tests replace it with a slow one."""
        return LLMatcher(tokenizer, grammar, log_level=0)

    def _count(self, result: CompiledGrammar) -> CompiledGrammar:
        with self._lock:
            self.num_compiles += 1
            self.num_errors += result.error is not None
            self.compile_seconds += result.compile_s
        return result

    def close(self) -> None:
        """Stop the threads once what runs is done; queued compiles are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
