"""`vconsole load`: a load generator client, and the reusable `run_load` the demo drives.

Arrivals are open-loop Poisson at ``rate`` (which may vary with time: `RateFn`), closed-loop at
``concurrency`` requests in flight, or both (Poisson, capped); with neither, everything is sent
at once. `run_timed` sends a fixed schedule instead (`TimedRequest`: each at its own time, as a
trace replay does: `vconsole.tools.trace_replay`). The workload is reproducible from ``seed``: prompt lengths, output lengths (requests
use ``ignore_eos`` so they run to their length), priorities drawn from a weighted mix, a share of
long prompts and a share of prompts that start with one shared prefix (for the prefix cache).

The prompts (``LoadSpec.prompts``) are random token ids (``tokens``, for the random-weight
models), or text (``chat``: `vconsole.tools.prompts`' questions, instructions and shared system
prompts through the model's chat template; they stop at the model's end of turn, up to their
output length), or ``auto``: text unless the engine runs one of the random-weight built-ins.

Measured per request on the client's clock: TTFT (send -> first token) and inter-token latency
(the gap between two output messages divided by the tokens the later one carried); and, where
the client sees it (the engine's socket, not HTTP), the prompt tokens the prefix cache served.

Every request sent ends as exactly one of: completed (finish reason ``length`` or ``stop``),
aborted by the load's own stop (Ctrl-C, the end of a soak), or failed — counted by kind
(`error_kind`: the engine unreachable, a timeout, an abort nobody asked for, no final output,
and over HTTP an error event, a missing ``[DONE]``, a short output, a status, a connection).
The summary's figures add up: ``requests == completed + failed + aborted`` once it ends
(`vconsole.tools.load_summary`: the records, the counters and the summary).
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vconsole.engine.client.async_client import AsyncEngineClient
from vconsole.engine.client.client import ENGINE_UNREACHABLE
from vconsole.engine.worker.tiny_model import MODEL_CONFIGS
from vconsole.tools.load_summary import LoadRun, RequestRecord
from vconsole.tools.prompts import ChatRenderer, draw_prompt, load_renderer

RateFn = Callable[[float], float]   # seconds since the start -> requests per second
ProgressFn = Callable[[dict[str, Any]], None]
PROGRESS_INTERVAL_S = 0.25
FIRST_TOKEN_ID = 3                   # skip the usual pad/bos/eos ids at the bottom
PROMPT_KINDS = ("tokens", "chat", "auto")


@dataclass
class LoadSpec:
    num: int | None = 100             # None: until stopped
    rate: float | None = None         # Poisson requests/s (a RateFn passed to run_load wins)
    concurrency: int | None = None    # most requests in flight
    prompt_len: tuple[int, int] = (16, 128)
    output_len: tuple[int, int] = (16, 64)
    priority_mix: list[tuple[int, float]] = field(default_factory=lambda: [(0, 1.0)])
    seed: int = 0
    long_prompt_share: float = 0.0
    long_prompt_len: tuple[int, int] = (256, 512)
    shared_prefix_share: float = 0.0
    shared_prefix_len: int = 32
    prompts: str = "tokens"           # PROMPT_KINDS; chat ignores prompt_len and the prefix
    # chat: the share of requests with one of the shared system prompts (a chat deployment's
    # usual shape, served from the prefix cache); the others ask a question alone
    system_prompt_share: float = 0.75


def parse_range(text: str) -> tuple[int, int]:
    """``"16:128"`` -> (16, 128); ``"32"`` -> (32, 32)."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"expected LO:HI integers, got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def parse_mix(text: str) -> list[tuple[int, float]]:
    """``"0:1,5:3"`` -> [(0, 1.0), (5, 3.0)]: priority:weight pairs."""
    mix = []
    for part in text.split(","):
        p, _, w = part.partition(":")
        try:
            mix.append((int(p), float(w or 1)))
        except ValueError:
            raise ValueError(f"expected PRIORITY:WEIGHT pairs, got {part!r}") from None
    if not mix or any(w < 0 for _, w in mix) or sum(w for _, w in mix) <= 0:
        raise ValueError(f"weights must be >= 0 and not all zero: {text!r}")
    return mix


class Workload:
    """Draws the requests of a spec, reproducibly: token ids, or with a ``chat`` renderer text
    prompts (one of the shared system prompts for ``system_prompt_share`` of them, a passage to
    work on where it draws a long prompt), which end at the model's end of turn (no
    ``ignore_eos``)."""

    def __init__(self, spec: LoadSpec, vocab_size: int, max_model_len: int,
                 chat: ChatRenderer | None = None) -> None:
        self.spec = spec
        self.chat = chat
        self.ignore_eos = chat is None
        self.rng = random.Random(spec.seed)
        self.lo = min(FIRST_TOKEN_ID, vocab_size - 1)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prefix = self._ids(spec.shared_prefix_len)
        self.priorities = [p for p, _ in spec.priority_mix]
        self.weights = [w for _, w in spec.priority_mix]

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.vocab_size) for _ in range(n)]

    def next(self) -> tuple[list[int], int, int]:
        """(prompt token ids, max_tokens, priority)."""
        s, rng = self.spec, self.rng
        long = rng.random() < s.long_prompt_share
        n = rng.randint(*(s.long_prompt_len if long else s.prompt_len))
        out = rng.randint(*s.output_len)
        out = max(1, min(out, self.max_model_len - 1))
        n = max(1, min(n, self.max_model_len - out))
        shared = rng.random() < (s.shared_prefix_share if self.chat is None
                                 else s.system_prompt_share)
        if self.chat is not None:
            ids = self.chat.ids(draw_prompt(rng, long=long, shared_system=shared))
            ids = ids[-max(1, self.max_model_len - out):]
        elif shared and n > len(self.prefix):
            ids = self.prefix + self._ids(n - len(self.prefix))
        else:
            ids = self._ids(n)
        priority = rng.choices(self.priorities, self.weights)[0]
        return ids, out, priority


async def chat_renderer(spec: LoadSpec, engine_info: dict[str, Any]) -> ChatRenderer | None:
    """The renderer ``spec.prompts`` asks for against this engine, None for token ids."""
    if spec.prompts not in PROMPT_KINDS:
        raise ValueError(f"prompts must be one of {', '.join(PROMPT_KINDS)}; "
                         f"got {spec.prompts!r}")
    if spec.prompts == "tokens" or (spec.prompts == "auto"
                                    and engine_info.get("model") in MODEL_CONFIGS):
        return None
    path = engine_info.get("model_path")
    if not path:
        raise ValueError("chat prompts need the engine's model directory, and the engine did "
                         "not name one")
    return await asyncio.to_thread(load_renderer, str(path))


async def _one(client: AsyncEngineClient, run: LoadRun, ids: list[int], max_tokens: int,
               priority: int, in_flight: dict[str, None], ignore_eos: bool = True) -> None:
    rec = RequestRecord(priority, len(ids), sent=time.monotonic())
    run.records[str(run.sent)] = rec      # counted from the moment it is sent, whatever follows
    run.sent += 1
    rid: str | None = None  # submit may fail: then there is nothing to forget in `finally`
    try:
        try:
            rid = await client.submit(prompt_token_ids=ids, max_tokens=max_tokens,
                                      ignore_eos=ignore_eos, priority=priority)
        except TimeoutError as e:  # the engine is gone and did not come back
            rec.finish_reason, rec.error = "error", f"{ENGINE_UNREACHABLE}: {e}"
            run.engine_lost = rec.error
            return
        except Exception as e:
            rec.finish_reason, rec.error = "error", f"not sent: {type(e).__name__}: {e}"
            raise
        in_flight[rid] = None
        async for out in client.stream(rid):
            now = time.monotonic()
            n = len(out.new_token_ids)
            if n:
                if rec.first_token is None:
                    rec.first_token = now
                else:
                    rec.itl.append((now - rec.last_token) / n)
                rec.last_token = now
                rec.num_tokens += n
                run.tokens += n
            if out.finished:
                rec.finish_reason, rec.error = out.finish_reason, out.error
                if getattr(client, "reports_cached_tokens", True):
                    rec.cached_tokens = out.num_cached_tokens
                rec.stopped = run.stopping and out.finish_reason == "abort"
                if out.error and out.error.startswith(ENGINE_UNREACHABLE):
                    run.engine_lost = out.error
    finally:
        if rid is not None:
            in_flight.pop(rid, None)
        rec.ended = True
        run.done += 1


async def run_load(client: AsyncEngineClient, spec: LoadSpec, *, rate_fn: RateFn | None = None,
                   stop: threading.Event | None = None, on_progress: ProgressFn | None = None,
                   run: LoadRun | None = None, abort_wait_s: float = 2.0) -> LoadRun:
    """Send ``spec``'s requests through a connected client; return when all have finished or
    ``stop`` is set (requests still in flight are then aborted and their final outputs
    awaited for up to ``abort_wait_s``). ``run`` may be passed to watch the counters from
    another thread."""
    info = client.engine_info
    workload = Workload(spec, int(info.get("vocab_size") or 256),
                        int(info.get("max_model_len") or 2048),
                        chat=await chat_renderer(spec, info))
    if rate_fn is None and spec.rate is not None:
        rate_fn = _constant(spec.rate)
    run = run or LoadRun()
    run.planned = spec.num
    rng = random.Random(spec.seed + 1)
    cap = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    in_flight: dict[str, None] = {}
    tasks: set[asyncio.Task[None]] = set()
    stop = stop or threading.Event()

    async def start_one() -> bool:
        ids, max_tokens, priority = workload.next()
        while cap is not None:
            if stop.is_set():
                return False
            try:
                await asyncio.wait_for(cap.acquire(), 0.1)
                break
            except TimeoutError:
                continue
        if stop.is_set() or run.engine_lost is not None:    # while it waited for a seat
            if cap is not None:
                cap.release()
            return False
        task = asyncio.create_task(_one(client, run, ids, max_tokens, priority, in_flight,
                                        workload.ignore_eos))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if cap is not None:
            task.add_done_callback(lambda _: cap.release())
        return True

    tick = asyncio.create_task(_ticker(run, on_progress))
    try:
        i = 0
        while (spec.num is None or i < spec.num) and not stop.is_set() \
                and run.engine_lost is None:
            if rate_fn is not None:
                await _sleep_until_next(rate_fn, run.started, rng, stop)
                if stop.is_set():
                    break
            if not await start_one():
                break
            i += 1
        await _wait_or_abort(client, run, tasks, in_flight, stop, abort_wait_s)
    finally:
        tick.cancel()
        run.finished_at = time.monotonic()
        if on_progress:
            on_progress(run.progress())
    return run


async def _wait_or_abort(client: AsyncEngineClient, run: LoadRun,
                         tasks: set[asyncio.Task[None]], in_flight: dict[str, None],
                         stop: threading.Event, abort_wait_s: float) -> None:
    """Until every request sent has ended; or, once ``stop`` is set or the engine is lost,
    abort those in flight and await their final outputs for up to ``abort_wait_s``."""
    while tasks and not stop.is_set() and run.engine_lost is None:
        await asyncio.wait(set(tasks), timeout=0.1)
    if tasks:
        run.stopping = stop.is_set()     # an abort after the engine was lost is a failure
        await client.abort(list(in_flight))
        await asyncio.wait(set(tasks), timeout=abort_wait_s)
        for t in tasks:
            t.cancel()


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One request of a fixed schedule: sent ``at`` seconds after the run starts, run to
    exactly ``max_tokens`` (``ignore_eos``, greedy)."""

    at: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0


async def run_timed(client: AsyncEngineClient, requests: Sequence[TimedRequest], *,
                    stop: threading.Event | None = None, on_progress: ProgressFn | None = None,
                    abort_wait_s: float = 2.0) -> LoadRun:
    """Send ``requests`` (sorted by ``at``) each at its time after the start, open loop: a
    request is sent on time however many are in flight. Times are kept against the start, so
    a late send does not delay the next; ``LoadRun.late_s`` is the latest any send was (this
    client falling behind its schedule, which a replay's figures should be read with). Ends
    as `run_load` does."""
    run = LoadRun()
    run.planned = len(requests)
    in_flight: dict[str, None] = {}
    tasks: set[asyncio.Task[None]] = set()
    stop = stop or threading.Event()

    tick = asyncio.create_task(_ticker(run, on_progress))
    run.started = time.monotonic()
    try:
        for r in sorted(requests, key=lambda r: r.at):
            due = run.started + r.at
            while (left := due - time.monotonic()) > 0 and not stop.is_set() \
                    and run.engine_lost is None:
                await asyncio.sleep(min(left, 0.1))
            if stop.is_set() or run.engine_lost is not None:
                break
            run.late_s = max(run.late_s, time.monotonic() - due)
            task = asyncio.create_task(_one(client, run, r.prompt_token_ids, r.max_tokens,
                                            r.priority, in_flight))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0)        # let it send before the next one's wait
        await _wait_or_abort(client, run, tasks, in_flight, stop, abort_wait_s)
    finally:
        tick.cancel()
        run.finished_at = time.monotonic()
        if on_progress:
            on_progress(run.progress())
    return run


async def _ticker(run: LoadRun, on_progress: ProgressFn | None) -> None:
    """Tell ``on_progress`` the run's progress every `PROGRESS_INTERVAL_S`, until cancelled."""
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        if on_progress:
            on_progress(run.progress())


def _constant(rate: float) -> RateFn:
    return lambda _t: rate


async def _sleep_until_next(rate_fn: RateFn, t0: float, rng: random.Random,
                            stop: threading.Event) -> None:
    """Wait one exponential gap at the current rate, re-checking ``stop`` (and a zero rate)."""
    while not stop.is_set():
        rate = rate_fn(time.monotonic() - t0)
        if rate > 0 and math.isfinite(rate):
            gap = rng.expovariate(rate)
            end = time.monotonic() + gap
            while (left := end - time.monotonic()) > 0 and not stop.is_set():
                await asyncio.sleep(min(left, 0.1))
            return
        if rate > 0:   # infinite: no wait
            return
        await asyncio.sleep(0.1)


def demo_rate(base: float, period_s: float = 40.0) -> RateFn:
    """A rate that tells a story on the console: steady, a burst (3x), a quiet spell (0.1x), a
    ramp back up — repeating every ``period_s``."""
    def rate(t: float) -> float:
        phase = (t % period_s) / period_s
        if phase < 0.30:
            return base
        if phase < 0.42:
            return 3.0 * base
        if phase < 0.65:
            return 0.1 * base
        return base * (0.3 + 0.7 * (phase - 0.65) / 0.35)
    return rate


def demo_spec(seed: int = 0, prompts: str = "tokens") -> LoadSpec:
    """The demo's workload (token ids on a random model, text on a real one: ``auto``)."""
    return LoadSpec(num=None, concurrency=96, prompt_len=(16, 96), output_len=(16, 160),
                    priority_mix=[(0, 1.0), (1, 3.0), (2, 2.0)], seed=seed,
                    long_prompt_share=0.08, long_prompt_len=(200, 400),
                    shared_prefix_share=0.3, shared_prefix_len=48, prompts=prompts)


class LoadThread(threading.Thread):
    """`run_load` on its own asyncio loop in a daemon thread (the demo, screenshots).

    A failure (the engine went away, say) does not end it: ``error`` keeps the last one,
    ``on_error(message)`` is told (the demo shows it on screen), and the load starts over on a
    new connection after `RETRY_S`, until `stop`."""

    RETRY_S = 2.0

    def __init__(self, input_endpoint: str, output_endpoint: str, spec: LoadSpec, *,
                 rate_fn: RateFn | None = None, timeout_s: float = 10.0,
                 abort_wait_s: float = 2.0) -> None:
        super().__init__(name="loadgen", daemon=True)
        self.abort_wait_s = abort_wait_s
        self.endpoints = (input_endpoint, output_endpoint)
        self.spec = spec
        self.rate_fn = rate_fn
        self.timeout_s = timeout_s
        self.run_state = LoadRun()
        self.error: BaseException | None = None
        self.errors = 0
        self.on_error: Callable[[str], None] | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                asyncio.run(self._main())
            except Exception as e:  # reported by the owner; a daemon thread has no one else
                self.error = e
                self.errors += 1
                if self.on_error is not None:
                    self.on_error(f"{type(e).__name__}: {e} (retrying in {self.RETRY_S:g} s)")
                self._stop_event.wait(self.RETRY_S)
            else:
                return

    async def _main(self) -> None:
        self.run_state.engine_lost = None
        async with AsyncEngineClient(*self.endpoints, timeout_s=self.timeout_s) as client:
            self.run_state.started = time.monotonic()
            await run_load(client, self.spec, rate_fn=self.rate_fn, stop=self._stop_event,
                           run=self.run_state, abort_wait_s=self.abort_wait_s)
        if self.run_state.engine_lost and not self._stop_event.is_set():
            raise ConnectionError(self.run_state.engine_lost)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        self.join(timeout)
