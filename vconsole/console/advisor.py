"""Tuning advice from the telemetry stream: rules that read what the engine publishes and say
which config change would help, with the figures that made them say so.

Pure Python over decoded messages (`Advisor.observe`), no sockets and no clock: time is the
envelope's ``ts``, so the console gets the same advice from a live engine and from a replayed
recording, and tests drive it with a generated stream.

A rule fires only on *sustained* evidence: its condition must hold in at least ``quorum`` (80 %)
of the snapshots of the last ``window_s`` (10 s) of the stream, over at least ``min_samples`` (5)
snapshots spanning at least half the window, so one noisy sample never produces advice. Trends
(a growing queue, a climbing TTFT) compare the start and the end of the same window. When a key
the rules tune changes (a ``config`` message, or `set_config` from a console that just applied
a change), the evidence gathered under the old value is dropped: advice about the new setting
needs fresh evidence.

A suggestion is always a value the engine would accept now: it differs from the value in force
and passes `vconsole.shared.config.apply_update` against the config in force (restart-only keys
are then answered ``restart_required``, which is what ``hot=False`` says). Rules (``rule`` names):

- ``sched_share`` -- the scheduler's share of step time above ``alert_sched_share_warning``:
  policy ``hybrid``, and a lower ``max_num_seqs`` when the cap is what sets the batch size (the
  write-up's case: 40 % scheduler time fixed with a hybrid policy and less concurrency). Hot.
- ``fragmentation`` -- KV fragmentation above ``fragmentation_threshold``: half the
  ``block_size`` (a half-filled last block wastes half as many slots). Restart-only.
- ``kv_pressure`` -- the waiting queue grows while the KV pool is full and requests are
  preempted: a lower ``max_num_seqs`` (hot), or more ``num_kv_blocks`` (restart-only).
- ``ttft`` -- TTFT p99 climbing while decodes fill the steps: a larger ``max_num_batched_tokens``
  when the step's token budget is what runs out (hot), and a ``hybrid`` policy under ``fcfs``
  when requests of several priorities wait (hot).
- ``seats`` -- requests wait while every seat is taken (running at ``max_num_seqs``) and the KV
  pool has room for more (no preemptions, the scheduler's share of step time under its
  warning): a higher ``max_num_seqs``, as many more requests as the pool's usage per running
  request says fit below ``KV_FULL`` (at most twice the cap). Hot.
- ``step_time`` -- the median step above ``alert_step_time_warning_s`` with prefill chunks
  filling the steps: a smaller ``max_num_batched_tokens`` (never below ``max_num_seqs``), so
  long prompts are cut into shorter steps and running requests are not held up. Hot.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vconsole.console.advice_window import (
    MIN_SAMPLES,
    QUORUM,
    WINDOW_S,
    EvidenceWindow,
    _Held,
)
from vconsole.shared.config import (
    FIELDS,
    apply_update,
    coerce_value,
    describe_config,
    format_value,
)

KV_FULL = 0.85                # block usage at which the pool counts as full
MIN_PREEMPTIONS = 2           # preemptions within the window that count as "rising"
TTFT_RISE = 1.2               # TTFT p99 at the end of the window >= 1.2 x its start,
TTFT_RISE_S = 0.5             # ... or 0.5 s more than at its start
TTFT_FLOOR_S = 0.1            # ... and at least this long (a few ms more is not a problem)
DECODE_SHARE = 0.8            # decode tokens / step tokens for "decode dominates"
PREFILL_SHARE = 0.5           # prefill tokens / step tokens for "prefill fills the steps"
BUDGET_BOUND = 0.8            # tokens per step / max_num_batched_tokens: the budget runs out
CONCURRENCY_CUT = 0.75        # a lower max_num_seqs: 3/4 of what actually runs
CAP_BINDING = 0.9             # running >= 0.9 x max_num_seqs: the cap sets the batch size
SEATS_GROWTH = 2              # a higher max_num_seqs: at most twice the cap at a time

HOT: dict[str, bool] = {row["key"]: bool(row["hot"]) for row in describe_config()}

show = format_value


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _secs(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


@dataclass(frozen=True)
class Advice:
    """One suggestion: which rule, the figures behind it, the change and whether it is hot.

    ``change`` maps config keys to suggested values; ``current`` the values in force when it was
    made. ``hot``: every key is applied live; False: restart-only (the engine answers
    ``restart_required`` and changes nothing)."""

    rule: str
    title: str
    evidence: dict[str, Any]
    change: dict[str, Any]
    hot: bool
    message: str
    current: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        """Stable while the same rule suggests the same keys (one rule may suggest two)."""
        return f"{self.rule}:{','.join(sorted(self.change))}"

    def change_text(self) -> str:
        """``policy fcfs → hybrid, max_num_seqs 64 → 48``."""
        return ", ".join(f"{k} {show(self.current.get(k))} → {show(v)}"
                         for k, v in self.change.items())

    def restart_command(self) -> str:
        return "vconsole engine " + " ".join(f"--set {k}={show(v)}" for k, v in self.change.items())


class Advisor(EvidenceWindow):
    """Feed every telemetry message to `observe`; `current` says what the recent window calls
    for. Not thread-safe (the console calls it under its state lock)."""

    def __init__(self, *, window_s: float = WINDOW_S, quorum: float = QUORUM,
                 min_samples: int = MIN_SAMPLES) -> None:
        super().__init__(window_s=window_s, quorum=quorum, min_samples=min_samples)
        self._cached: tuple[int, list[Advice]] | None = None

    def _advice(self, rule: str, title: str, evidence: dict[str, Any], change: dict[str, Any],
                message: Callable[[dict[str, Any], dict[str, Any]], str]) -> Advice | None:
        """Keep the keys whose value is valid and not already in force; None when none is
        left, or when the engine would not take the change as a whole."""
        current = {k: self._value(k) for k in change}
        keep: dict[str, Any] = {}
        for key, value in change.items():
            try:
                value = coerce_value(key, value)
            except ValueError:
                continue
            if current[key] is not None and value != current[key]:
                keep[key] = value
        if not keep:
            return None
        hot = all(HOT[k] for k in keep)
        if not hot and any(HOT[k] for k in keep):
            raise ValueError(f"{rule}: one advice mixes hot and restart-only keys")
        base = self._base_config()
        if base is not None:
            update = apply_update(base, keep)
            if update.rejected:
                return None
            if hot and set(update.applied) != set(keep):
                return None
            if not hot and update.restart_required != sorted(keep):
                return None
        now = {k: current[k] for k in keep}
        return Advice(rule, title, evidence, keep, hot, message(keep, now), now)

    # --- output -------------------------------------------------------------------------------

    def current(self) -> list[Advice]:
        """The advice the last ``window_s`` of the stream calls for (cached until new input)."""
        if self._cached is not None and self._cached[0] == self._version:
            return list(self._cached[1])
        out: list[Advice] = []
        for rule in (self._sched_share, self._fragmentation, self._kv_pressure, self._ttft,
                     self._seats, self._step_time):
            out.extend(a for a in rule() if a is not None)
        self._cached = (self._version, out)
        return list(out)

    def _common(self, held: _Held, **figures: Any) -> dict[str, Any]:
        return {**figures, "held_in": held.hits, "snapshots": held.samples,
                "window_s": self.window_s}

    # --- the rules ------------------------------------------------------------------------------

    def _lower_concurrency(self, running: float) -> int | None:
        cur = self._value("max_num_seqs")
        if not isinstance(cur, int) or cur <= 1:
            return None
        return max(1, min(cur - 1, round(min(cur, running) * CONCURRENCY_CUT)))

    def _sched_share(self) -> Iterable[Advice | None]:
        thr = self._threshold("alert_sched_share_warning")
        held = self._held("step", lambda s: s["sched_share"] > thr)
        if held is None:
            return
        steps = self._window("step")
        share = statistics.fmean(s["sched_share"] for s in steps)
        running = max((s["running"] for s in self._window("sched")), default=0.0) or \
            max((s["num_reqs_max"] for s in steps), default=0.0)
        change: dict[str, Any] = {"policy": "hybrid"}
        cap = self._value("max_num_seqs")
        if isinstance(cap, int) and running >= CAP_BINDING * cap:
            target = self._lower_concurrency(cap)
            if target is not None:
                change["max_num_seqs"] = target
        evidence = self._common(held, sched_share=round(share, 3), threshold=thr,
                                running_peak=int(running))

        def message(keep: dict[str, Any], cur: dict[str, Any]) -> str:
            parts = []
            if "policy" in keep:
                parts.append(f"policy {cur['policy']} → hybrid (priority with aging: static "
                             f"queue keys, urgent arrivals stop reshuffling and preempting "
                             f"the batch)")
            if "max_num_seqs" in keep:
                parts.append(f"max_num_seqs {cur['max_num_seqs']} → {keep['max_num_seqs']} "
                             f"(the cap was reached: {int(running)} ran at once; fewer "
                             f"running requests to walk every step)")
            return (f"The scheduler took {_pct(share)} of step time (warning at {_pct(thr)}) "
                    f"in {held.hits} of {held.samples} step windows. Suggest "
                    + "; ".join(parts) + ".")
        yield self._advice("sched_share", "Scheduler overhead", evidence, change, message)

    def _fragmentation(self) -> Iterable[Advice | None]:
        thr = self._threshold("fragmentation_threshold")
        held = self._held("kv", lambda s: s["num_used"] > 0 and s["fragmentation"] > thr)
        if held is None:
            return
        bs = self._value("block_size")
        if not isinstance(bs, int) or bs <= 1:
            return
        frag = statistics.fmean(s["fragmentation"] for s in self._window("kv"))
        evidence = self._common(held, fragmentation=round(frag, 3), threshold=thr,
                                block_size=bs)

        def message(keep: dict[str, Any], cur: dict[str, Any]) -> str:
            return (f"{_pct(frag)} of the slots in allocated KV blocks held no token "
                    f"(threshold {_pct(thr)}) in {held.hits} of {held.samples} snapshots: the "
                    f"last block of each request is mostly empty. block_size {bs} → "
                    f"{keep['block_size']} halves that waste. Restart-only: restart the engine "
                    f"with --set block_size={keep['block_size']}.")
        yield self._advice("fragmentation", "KV fragmentation", evidence,
                           {"block_size": bs // 2}, message)

    def _kv_pressure(self) -> Iterable[Advice | None]:
        full = self._held("kv", lambda s: s["usage"] >= KV_FULL)
        queued = self._held("sched", lambda s: s["waiting"] > 0)
        if full is None or queued is None:
            return
        sched = self._window("sched")
        third = max(1, len(sched) // 3)
        early = statistics.fmean(s["waiting"] for s in sched[:third])
        late = statistics.fmean(s["waiting"] for s in sched[-third:])
        preemptions = sched[-1]["preemptions_total"] - sched[0]["preemptions_total"]
        if not (late > early and sched[-1]["waiting"] > sched[0]["waiting"]) or \
                preemptions < MIN_PREEMPTIONS:
            return
        usage = statistics.fmean(s["usage"] for s in self._window("kv"))
        running = statistics.fmean(s["running"] for s in sched)
        blocks = self._value("num_kv_blocks")
        evidence = self._common(full, kv_usage=round(usage, 3), waiting_start=int(early),
                                waiting_end=int(late), preemptions=int(preemptions),
                                running_mean=round(running, 1))
        why = (f"The KV pool was {_pct(usage)} used (full from {_pct(KV_FULL)}) in {full.hits} "
               f"of {full.samples} snapshots while the waiting queue grew from {early:.0f} to "
               f"{late:.0f} and {preemptions:.0f} requests were preempted")
        target = self._lower_concurrency(running)
        if target is not None:
            yield self._advice(
                "kv_pressure", "KV pool full: less concurrency", evidence,
                {"max_num_seqs": target},
                lambda keep, cur: (f"{why}. max_num_seqs {cur['max_num_seqs']} → "
                                   f"{keep['max_num_seqs']} runs fewer requests whose blocks "
                                   f"fit, instead of preempting and recomputing them."))
        if isinstance(blocks, int):
            more = min(int(FIELDS["num_kv_blocks"].metadata["max"]), round(blocks * 1.5))
            yield self._advice(
                "kv_pressure", "KV pool full: more blocks", evidence, {"num_kv_blocks": more},
                lambda keep, cur: (f"{why}. num_kv_blocks {blocks} → {keep['num_kv_blocks']} "
                                   f"gives them room, if memory allows. Restart-only: restart "
                                   f"the engine with --set num_kv_blocks="
                                   f"{keep['num_kv_blocks']}."))

    def _ttft(self) -> Iterable[Advice | None]:
        if not self._enough("latency"):
            return
        lat = [s for s in self._window("latency") if s["ttft_p99"] is not None]
        if len(lat) < self.min_samples:
            return
        p99 = [s["ttft_p99"] for s in lat]
        half = len(p99) // 2
        climbing = ((p99[-1] >= TTFT_RISE * p99[0] or p99[-1] - p99[0] >= TTFT_RISE_S)
                    and p99[-1] >= TTFT_FLOOR_S
                    and statistics.median(p99[half:]) > statistics.median(p99[:half]))
        if not climbing:
            return
        decode = self._held("step", lambda s: s["tokens"] > 0
                            and s["decode"] >= DECODE_SHARE * s["tokens"])
        if decode is None:
            return
        steps = self._window("step")
        tokens = sum(s["tokens"] for s in steps)
        share = sum(s["decode"] for s in steps) / tokens if tokens else 0.0
        n_steps = sum(s["steps"] for s in steps)
        per_step = tokens / n_steps if n_steps else 0.0
        budget = self._value("max_num_batched_tokens")
        evidence = self._common(decode, ttft_p99_start=round(p99[0], 3),
                                ttft_p99_end=round(p99[-1], 3), decode_share=round(share, 3),
                                tokens_per_step=round(per_step, 1), token_budget=budget)
        why = (f"TTFT p99 climbed from {_secs(p99[0])} to {_secs(p99[-1])} while decodes were "
               f"{_pct(share)} of the step tokens ({decode.hits} of {decode.samples} windows)")
        if isinstance(budget, int) and per_step >= BUDGET_BOUND * budget:
            more = min(int(FIELDS["max_num_batched_tokens"].metadata["max"]), budget * 2)
            yield self._advice(
                "ttft", "TTFT climbing: bigger step budget", evidence,
                {"max_num_batched_tokens": more},
                lambda keep, cur: (f"{why}, and the steps used {per_step:.0f} of their "
                                   f"{budget}-token budget: waiting prompts get no room. "
                                   f"max_num_batched_tokens {budget} → "
                                   f"{keep['max_num_batched_tokens']} lets prefills in beside "
                                   f"the decodes."))
        classes = max((s["classes"] for s in lat), default=0)
        if self._value("policy") == "fcfs" and classes > 1:
            yield self._advice(
                "ttft", "TTFT climbing: serve urgent requests first", evidence,
                {"policy": "hybrid"},
                lambda keep, cur: (f"{why}, with requests of {classes} priorities waiting in "
                                   f"arrival order. policy fcfs → hybrid admits urgent ones "
                                   f"first, and aging still lets the others through."))

    def _seats(self) -> Iterable[Advice | None]:
        """Requests queue because every seat is taken, not because the pool is full: raise
        ``max_num_seqs`` to what the pool's usage per running request says still fits."""
        cap = self._value("max_num_seqs")
        if not isinstance(cap, int) or cap < 1:
            return
        full_seats = self._held("sched", lambda s: s["waiting"] > 0
                                and s["running"] >= CAP_BINDING * cap)
        room = self._held("kv", lambda s: s["usage"] < KV_FULL)
        if full_seats is None or room is None:
            return
        sched = self._window("sched")
        preemptions = sched[-1]["preemptions_total"] - sched[0]["preemptions_total"]
        steps = [s for s in self._window("step") if s["steps"] > 0]
        share = statistics.fmean(s["sched_share"] for s in steps) if steps else 0.0
        if preemptions >= MIN_PREEMPTIONS or share > self._threshold("alert_sched_share_warning"):
            return                          # the pool or the scheduler is the limit, not seats
        usage = statistics.fmean(s["usage"] for s in self._window("kv"))
        running = statistics.fmean(s["running"] for s in sched)
        per_request = usage / running if running > 0 else 0.0
        fits = int(KV_FULL / per_request) if per_request > 0 else SEATS_GROWTH * cap
        target = min(SEATS_GROWTH * cap, fits, int(FIELDS["max_num_seqs"].metadata["max"]))
        if target <= cap:
            return
        waiting = [s["waiting"] for s in sched]
        lat = [s["ttft_p99"] for s in self._window("latency") if s["ttft_p99"] is not None]
        ttft = lat[-1] if lat else None
        evidence = self._common(full_seats, max_num_seqs=cap, running_mean=round(running, 1),
                                waiting_min=int(min(waiting)), waiting_max=int(max(waiting)),
                                kv_usage=round(usage, 3), preemptions=int(preemptions),
                                ttft_p99=round(ttft, 3) if ttft is not None else None)
        ttft_text = f"; TTFT p99 {_secs(ttft)}" if ttft is not None else ""

        def message(keep: dict[str, Any], cur: dict[str, Any]) -> str:
            return (f"Every seat was taken ({running:.1f} running of max_num_seqs {cap}) while "
                    f"{min(waiting):.0f}–{max(waiting):.0f} requests waited, in "
                    f"{full_seats.hits} of {full_seats.samples} snapshots, and the KV pool was "
                    f"only {_pct(usage)} used with {preemptions:.0f} "
                    f"preemption{'' if preemptions == 1 else 's'}{ttft_text}. "
                    f"The queue waits for seats, not memory: max_num_seqs {cur['max_num_seqs']} "
                    f"→ {keep['max_num_seqs']} admits more of it (at {_pct(per_request)} of the "
                    f"pool per running request, {keep['max_num_seqs']} stay under "
                    f"{_pct(KV_FULL)}).")
        yield self._advice("seats", "Queue waits for seats: more concurrency", evidence,
                           {"max_num_seqs": target}, message)

    def _step_time(self) -> Iterable[Advice | None]:
        thr = self._threshold("alert_step_time_warning_s")
        held = self._held("step", lambda s: s["steps"] > 0 and s["p50"] >= thr)
        if held is None:
            return
        steps = self._window("step")
        tokens = sum(s["tokens"] for s in steps)
        share = sum(s["prefill"] for s in steps) / tokens if tokens else 0.0
        budget, seqs = self._value("max_num_batched_tokens"), self._value("max_num_seqs")
        if share < PREFILL_SHARE or not isinstance(budget, int) or not isinstance(seqs, int):
            return
        target = max(budget // 2, seqs)
        if target >= budget:
            return
        p50 = statistics.median(s["p50"] for s in steps if s["steps"] > 0)
        evidence = self._common(held, step_time_p50_s=round(p50, 4), threshold_s=thr,
                                prefill_share=round(share, 3), token_budget=budget)
        yield self._advice(
            "step_time", "Long steps: smaller prefill chunks", evidence,
            {"max_num_batched_tokens": target},
            lambda keep, cur: (f"The median step took {_secs(p50)} (warning at {_secs(thr)}) in "
                               f"{held.hits} of {held.samples} windows, {_pct(share)} of its "
                               f"tokens prefill. max_num_batched_tokens {budget} → "
                               f"{keep['max_num_batched_tokens']} cuts long prompts into "
                               f"shorter steps, so running requests are not held up (their "
                               f"first token comes a little later)."))
