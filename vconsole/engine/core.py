"""EngineCore: the inner loop of the engine — schedule → execute_model → update_from_output.

`step()` reads top to bottom as its three phases and records what each cost; nothing here knows
about sockets or telemetry (`vconsole.engine.process.core_proc` wraps the core with I/O threads
and queues, and hands `last_step` and the stats snapshots to the publisher, `last_step` and
`last_finished` to the request trace).

A model execution that raises fails that step's requests only (finish reason ``error``, the
exception in ``error``) and `step()` returns normally; `consecutive_step_failures` tells the
caller when the failures no longer stop (see `_execute_model`).

Structured outputs (`vconsole.engine.structured`): a request with a spec is added to the
scheduler ``compiling`` and its grammar compiles on the compile threads; at the start of the
step after its compile finished it is queued (or finished with ``error``). Each step the core
fills the bitmask of the constrained rows that sample (`SchedulerOutput.grammar`), the runner
applies it, and the core advances their matchers before `Scheduler.update_from_output` (which
finishes a request whose grammar is complete). `set_wakeup` lets a sleeping busy loop hear
that a compile finished.

`step()` never detokenizes: a finished output's ``text`` is made by whoever reads it, with
`detokenize` — the offline path (`vconsole.engine.offline.run_batch`) for every finished
request, the engine process on its output thread, off the busy loop.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from vconsole.engine.kv.residency import BlockResidency
from vconsole.engine.latency import LatencyBatch
from vconsole.engine.request import FinishReason, Request
from vconsole.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from vconsole.engine.sched.scheduler import RowSource, Scheduler
from vconsole.engine.structured.manager import StructuredOutputs
from vconsole.engine.worker import kv_quant, nvtx, weight_format
from vconsole.engine.worker.model_runner import ModelRunner
from vconsole.engine.worker.profiler import StepProfiler
from vconsole.shared.config import ConfigUpdate, EngineConfig, apply_update
from vconsole.shared.kv_events import KVEvent
from vconsole.shared.stats import KVStats, ResidencySample, SchedulerStats, StepStats
from vconsole.wire.outputs import RequestOutput
from vconsole.wire.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    """One model, one KV block pool, one scheduler.

    Invariant: `config` is always a validated `EngineConfig`; hot changes reach the scheduler
    only through `apply_config`, which runs between two steps (the caller's loop guarantees it).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.config_version = 1
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.num_kv_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.num_kv_blocks, config.block_size,
                                   self.runner.max_model_len)
        if self.runner.kv_format.key_per_channel:   # open blocks staged in lent blocks (#48)
            self.runner.staging_of = self.scheduler.kv.lend_staging_blocks()
        # Every telemetry call of the busy loop goes through it (`vconsole.engine.telemetry_guard`).
        self.telemetry_guard = self.scheduler.telemetry
        self.num_steps = 0
        self.last_step: StepStats | None = None
        # The requests that finished in the latest step (by a stop rule, or aborted, timed out
        # or failed and reported there): the request trace's records. Replaced, never mutated.
        self.last_finished: list[Request] = []
        self.consecutive_step_failures = 0          # model executions that raised, in a row
        self.last_step_error: str | None = None     # the latest one's "Type: message"
        self.profiler: StepProfiler | None = None   # armed by start_profile; see profiling
        self.structured = StructuredOutputs(self.tokenizer, self.runner.vocab_size,
                                            self.runner.eos_token_ids)
        # On a GPU the bitmask is filled on a thread while the forward runs (llguidance drops
        # the GIL; the forward only launches kernels); on a CPU both would want the same cores.
        self.overlap_bitmask = self.runner.device.type == "cuda"
        nvtx.configure(config.nvtx, self.runner.device.type)
        self.runner.time_forward = config.collect_detailed_traces
        weights = self.runner.weights or str(self.runner.dtype).removeprefix("torch.")
        logger.info("engine core ready: model=%s device=%s dtype=%s weights=%s kv_blocks=%d x "
                    "%d tokens (kv %s, %d bytes per token)", config.model, self.runner.device,
                    self.runner.dtype, weights, self.num_kv_blocks, config.block_size,
                    self.runner.kv_cache_dtype, self.runner.kv_bytes_per_token)

    def model_info(self) -> dict[str, Any]:
        """What a client learns of the model at ``hello`` (and the ready file)."""
        return {"device": str(self.runner.device), "vocab_size": self.runner.vocab_size,
                "max_model_len": self.runner.max_model_len, "num_kv_blocks": self.num_kv_blocks,
                "model_path": self.runner.info.path,
                "kv_cache_dtype": self.runner.kv_cache_dtype,
                "kv_bytes_per_token": self.runner.kv_bytes_per_token,
                "kv_bytes_per_token_by_dtype": self.kv_bytes_per_token_by_dtype(),
                "kv_block_bytes_by_dtype": self.kv_block_bytes_by_dtype(),
                "kv_pool_bytes": self.runner.kv_pool_bytes,
                "kv_staging_bytes": self.runner.kv_staging_bytes,
                "kv_staging_blocks": 0,   # staging beside the pool: none (#48)
                "native_decode_rows": self.runner.native_decode_rows,
                "dims": self.model_dims()}

    def model_dims(self) -> dict[str, int | float | bool]:
        """The figures vLLM's MFU estimate reads (``vllm/v1/metrics/perf.py``): the model's
        shape and the bytes of an activation, a weight (int8 quantization: 1; GGUF blocks as
        stored: theirs, 0.625 for Q4_1) and a K or V
        element in the pool (its bytes per token over 2 x layers x KV heads x head dim, so a
        quantized pool's scales count)."""
        r, info = self.runner, self.runner.info
        act = r.dtype.itemsize
        elements = 2 * r.num_layers * r.num_kv_heads * r.head_dim
        return {"num_layers": r.num_layers, "hidden_size": info.hidden_size,
                "num_heads": info.num_heads, "num_kv_heads": r.num_kv_heads,
                "head_dim": r.head_dim,
                "intermediate_size": int(getattr(r.model.config, "intermediate_size",
                                                 4 * info.hidden_size)),
                "vocab_size": r.vocab_size, "activation_bytes": act,
                "weight_bytes": (weight_format.bytes_per_weight(r.model)
                                 or (1 if self.config.quantization == "int8" else act)),
                "cache_bytes": r.kv_bytes_per_token / elements, "cpu": r.device.type == "cpu"}

    def kv_bytes_per_token_by_dtype(self) -> dict[str, int]:
        """Bytes per token of every KV format this model can store (``auto``: the model's
        dtype), at this block size: the request trace's header carries them, so a what-if of
        ``kv_cache_dtype`` sizes the same pool bytes in another format."""
        r = self.runner
        return {name: fmt.bytes_per_token(r.num_layers, r.num_kv_heads, r.head_dim,
                                          r.dtype.itemsize, self.config.block_size)
                for name, fmt in self._kv_formats()}

    def kv_block_bytes_by_dtype(self) -> dict[str, list[int]]:
        """``[per token, per block]`` of every KV format: a block of B tokens takes
        ``B * per token + per block`` bytes (a per-channel format's parameters are per block),
        so a what-if sizes a pool in another format or block size exactly."""
        r = self.runner
        out = {}
        for name, fmt in self._kv_formats():
            one, two = (fmt.bytes_per_block(b, r.num_layers, r.num_kv_heads, r.head_dim,
                                            r.dtype.itemsize) for b in (1, 2))
            out[name] = [two - one, 2 * one - two]
        return out

    def _kv_formats(self) -> list[tuple[str, kv_quant.KVFormat]]:
        """The KV formats this model can store (4-bit ones pack two values a byte: an even
        head dimension)."""
        return [(name, fmt) for name, fmt in kv_quant.FORMATS.items()
                if not (fmt.bits == 4 and self.runner.head_dim % 2)]

    # --- requests -------------------------------------------------------------------------
    def make_request(self, request_id: str, *, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, sampling: SamplingParams,
                     priority: int = 0, client_id: bytes = b"") -> Request:
        """Build a Request from text or token ids. Raises ValueError with the reason.

        Only reads the tokenizer and the model's limits, so `EngineCoreProc` calls it off the
        busy loop for long prompts."""
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            ids = [int(t) for t in prompt_token_ids]  # type: ignore[union-attr]
            vocab = self.runner.vocab_size
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(f"token id {bad} outside the vocabulary (0..{vocab - 1})")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        sampling.validate()
        return Request(request_id=str(request_id), prompt_token_ids=ids, sampling=sampling,
                       priority=priority, client_id=client_id,
                       eos_token_id=self.runner.eos_token_id,
                       eos_token_ids=self.runner.eos_token_ids)

    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue a request. Returns None when accepted, or its final error output when it can
        never run (the engine keeps serving everyone else)."""
        constrained = req.sampling.structured is not None
        try:
            self.scheduler.add_request(req, compiling=constrained)
        except ValueError as e:
            req.finish_reason = FinishReason.ERROR
            return RequestOutput(request_id=req.request_id, finished=True,
                                 finish_reason=FinishReason.ERROR.value, error=str(e), text="",
                                 num_prompt_tokens=req.num_prompt_tokens)
        if constrained:
            self.structured.start(req)   # compiles off the loop; held until then
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests()

    def has_ready_requests(self) -> bool:
        """Whether a step has anything to do now: False when every unfinished request waits
        for its grammar to compile (the engine process then sleeps until `set_wakeup`'s
        callback or an input wakes it)."""
        return self.scheduler.has_ready_requests() or self.structured.has_ready()

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called, from a compile thread, whenever a grammar compile finishes."""
        self.structured.wake = wake

    def _take_compiled(self) -> None:
        """Queue the requests whose grammar is ready; finish those whose grammar failed."""
        sched = self.scheduler
        for req, error in self.structured.take_ready():
            if error is not None:
                sched.finish_requests([req.request_id], FinishReason.ERROR, error=error)
            elif not sched.grammar_ready(req.request_id):
                self.structured.forget([req.request_id])   # aborted or expired meanwhile

    # --- the loop -------------------------------------------------------------------------
    def step(self) -> tuple[dict[bytes, list[RequestOutput]], bool]:
        """One engine iteration. Returns outputs per client and whether any token ran."""
        if not self.scheduler.has_requests():
            return {}, False
        profiler = self.profiler if self.profiler is not None and not self.profiler.done else None
        if profiler is not None:
            profiler.begin_step(self.num_steps)
        nvtx.push("step")
        try:
            return self._step(profiler)
        finally:
            nvtx.pop()

    def _step(self, profiler: StepProfiler | None) -> tuple[dict[bytes, list[RequestOutput]],
                                                             bool]:
        t0 = time.monotonic_ns()
        structured = self.structured
        if structured.has_ready():
            self._take_compiled()
        nvtx.push("schedule")
        try:
            scheduler_output = self.scheduler.schedule()
        finally:
            nvtx.pop()
        t1 = t_scheduled = time.monotonic_ns()
        structured_ns = 0           # an unconstrained batch: none, not even a timer
        if structured.active:       # constrained requests exist: their rows' bitmask
            scheduler_output.grammar = structured.fill(scheduler_output,
                                                       overlap=self.overlap_bitmask)
            t1b = time.monotonic_ns()
            structured_ns, t1 = t1b - t1, t1b
        if scheduler_output.has_work():
            nvtx.push("execute")
            try:
                model_output = self._execute_model(scheduler_output)
            finally:
                nvtx.pop()
        else:
            model_output = ModelRunnerOutput()
        t2 = time.monotonic_ns()
        execute_ns = t2 - t1 - model_output.structured_ns   # the mask's application: ours
        if scheduler_output.grammar is not None:
            structured.advance(model_output)
            t2b = time.monotonic_ns()
            structured_ns += t2b - t2 + model_output.structured_ns
            t2 = t2b
        if self.runner.time_forward:    # before the update, so a request finishing now counts it
            self._add_step_times(scheduler_output, t_scheduled - t0, execute_ns)
        nvtx.push("update")
        try:
            results = self.scheduler.update_from_output(scheduler_output, model_output)
        finally:
            nvtx.pop()
        outputs: dict[bytes, list[RequestOutput]] = defaultdict(list)
        finished: list[Request] = []
        for req, out in results:
            if out.finished:
                finished.append(req)
                if out.timings is not None:     # ran in the scheduler: the config it ran under
                    out.config_version = self.config_version
            outputs[req.client_id].append(out)
        if finished and (structured.active or structured.num_compiling):
            structured.forget(r.request_id for r in finished)
        t3 = time.monotonic_ns()

        self.num_steps += 1
        sched, so = self.scheduler, scheduler_output
        self.last_finished = finished
        self.last_step = StepStats(
            schedule_ns=t_scheduled - t0, execute_ns=execute_ns, update_ns=t3 - t2,
            total_ns=t3 - t0,
            num_prefill_tokens=so.num_prefill_tokens, num_decode_tokens=so.num_decode_tokens,
            num_reqs=so.num_scheduled_reqs, num_preempted=len(so.preempted_req_ids),
            num_finished=len(finished), start_ns=t0, num_context_tokens=so.num_context_tokens,
            prefill_attention=so.prefill_attention, num_new_reqs=len(so.scheduled_new_reqs),
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            kv_used_blocks=sched.kv.pool.num_used_blocks,
            structured_ns=structured_ns, num_prefill_reqs=so.num_prefill_reqs,
            prefill_context_tokens=so.prefill_context_tokens,
            native=so.total_num_scheduled_tokens > 0 and self.runner.last_step_native)
        if profiler is not None:
            profiler.end_step(self.last_step, self.num_steps)
        return dict(outputs), scheduler_output.total_num_scheduled_tokens > 0

    def _add_step_times(self, so: SchedulerOutput, schedule_ns: int, execute_ns: int) -> None:
        """``collect_detailed_traces``: the step's schedule, forward and execute time added to
        each request it ran (vLLM's per-request scheduler / model forward / execute times)."""
        forward_ns, self.runner.last_forward_ns = self.runner.last_forward_ns, 0
        get = self.scheduler.get_request
        for rid in so.num_scheduled_tokens:
            req = get(rid)
            if req is not None:
                req.scheduler_ns += schedule_ns
                req.forward_ns += forward_ns
                req.execute_ns += execute_ns

    def dummy_step(self) -> None:
        """A data-parallel rank's step with nothing to do: one minimal forward that touches no
        request and no KV block (`ModelRunner.execute_dummy_batch`), so the rank keeps pace
        with busy ranks. Not counted in ``num_steps``, no `StepStats`; the caller counts it.
        A failure counts in `consecutive_step_failures` like a failed model execution."""
        try:
            self.runner.execute_dummy_batch()
        except Exception as e:
            self.consecutive_step_failures += 1
            self.last_step_error = f"{type(e).__name__}: {e}"
            logger.exception("dummy step failed (%d in a row)", self.consecutive_step_failures)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model; if it raises, fail this step's requests and keep serving the rest.

        The requests the step scheduled finish with ``error`` (the exception's type and
        message) and nothing of the step is kept (no token, no prefix-cache entry); waiting
        requests and running ones outside the step are untouched. `consecutive_step_failures`
        counts failed executions in a row (a success resets it): the process wrapper gives up
        at ``max_consecutive_step_failures``, since a device that fails every step (a lost
        CUDA context) never recovers in this process."""
        try:
            out = self.runner.execute_model(so)
        except Exception as e:
            self.consecutive_step_failures += 1
            self.last_step_error = f"{type(e).__name__}: {e}"
            logger.exception("model execution failed (%d in a row): failing the step's %d "
                             "request(s)", self.consecutive_step_failures, so.num_scheduled_reqs)
            self.scheduler.fail_step(so, self.last_step_error)
            return ModelRunnerOutput()
        self.consecutive_step_failures = 0
        return out

    def close(self) -> None:
        """Stop the core's own threads (the grammar compiler's; queued compiles are dropped).
        The process wrapper calls it on shutdown; a core used in-process may too."""
        self.structured.close()

    def detokenize(self, token_ids: list[int]) -> str:
        """A request's text (special tokens skipped). Only reads the tokenizer, so the engine
        process calls it off the busy loop."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # --- config and figures ---------------------------------------------------------------
    def apply_config(self, values: dict) -> ConfigUpdate:
        """Validate and apply a change as a whole; call only between two steps."""
        update = apply_update(self.config, values)
        if update.applied:
            self.config = update.config
            self.config_version += 1
            self.scheduler.update_config(self.config)
            nvtx.configure(self.config.nvtx, self.runner.device.type)
            self.runner.time_forward = self.config.collect_detailed_traces
        return update

    def scheduler_stats(self, max_rows: int, rows: RowSource | None = None) -> SchedulerStats:
        """``rows``: what makes the request rows (`Scheduler.stats`)."""
        stats = self.scheduler.stats(max_rows, rows)
        c = self.structured.compiler
        stats.structured_compiles_total = c.num_compiles
        stats.structured_compile_cache_hits_total = c.num_cache_hits
        stats.structured_compile_errors_total = c.num_errors
        stats.structured_compile_seconds_total = c.compile_seconds
        return stats

    def token_lists(self, request_ids: Iterable[str]) -> list[tuple[str, list[int], list[int]]]:
        """Telemetry's request text (``publish_request_text``): per live request, its prompt
        and output token id lists themselves (no copy: O(1) a request on the busy loop; the
        engine only ever appends to them, and the publisher thread reads a slice, atomic
        under the GIL); ids no longer known are skipped."""
        get = self.scheduler.get_request
        out = []
        for rid in request_ids:
            req = get(rid)
            if req is not None:
                out.append((rid, req.prompt_token_ids, req.output_token_ids))
        return out

    def latency_batch(self) -> LatencyBatch:
        return self.scheduler.latency_batch()

    def kv_stats(self) -> KVStats:
        return self.scheduler.kv_stats()

    def enable_kv_events(self) -> None:
        """Record what enters and leaves the prefix cache from now on (the engine process
        does, once its KV event publisher runs; nothing else drains them)."""
        self.scheduler.kv.enable_events()

    def take_kv_events(self) -> list[KVEvent]:
        """What entered and left the prefix cache since the last call (empty when KV events
        are off)."""
        return self.scheduler.kv.take_events()

    def enable_kv_residency(self, sample_rate: float) -> None:
        """Sample KV block lifetimes from now on (`vconsole.engine.kv.residency`)."""
        pool = self.scheduler.kv.pool
        if pool.residency is None:
            pool.residency = BlockResidency(sample_rate, num_blocks=pool.num_blocks)

    def take_kv_residency(self) -> list[ResidencySample]:
        """The sampled block evictions since the last call (empty when not sampling)."""
        residency = self.scheduler.kv.pool.residency
        return residency.take() if residency is not None else []

    # --- profiling ------------------------------------------------------------------------
    def start_profile(self, num_steps: int,
                      on_done: Callable[[], None] | None = None) -> StepProfiler:
        """Profile the next ``num_steps`` steps that run (`vconsole.engine.worker.profiler`):
        `step` drives it, outside its phase timers; ``on_done`` is called once it is over.
        Call only between two steps. Raises ValueError while another profile runs."""
        if self.profiler is not None and not self.profiler.done:
            raise ValueError(f"a profile is already running ({self.profiler.steps_done}/"
                             f"{self.profiler.num_steps} steps done)")
        self.profiler = StepProfiler(self.runner, num_steps, on_done)
        return self.profiler
