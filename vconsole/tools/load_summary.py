"""What a load run measured: one record per request sent, the run's live counters, and the
summary `vconsole load` prints (JSON or text).

Every request sent ends as exactly one of: completed (finish reason ``length`` or ``stop``),
aborted by the load's own stop (Ctrl-C, the end of a soak), or failed — counted by kind
(`error_kind`). The summary's figures add up: ``requests == completed + failed + aborted``
once the run ends. `vconsole.tools.loadgen` fills these in; the HTTP load client and the
benchmarks read them. ``cached_tokens`` counts the completed requests' prompt tokens that the
engine's prefix cache served (from each final output); it is None when the client cannot see
them (over HTTP: an OpenAI usage block does not carry them, `vconsole serve`'s included).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vconsole.engine.client.client import ENGINE_UNREACHABLE
from vconsole.tools.http_load import kind_of

COMPLETED = ("length", "stop")


@dataclass
class RequestRecord:
    priority: int
    prompt_len: int
    sent: float = 0.0
    first_token: float | None = None
    last_token: float = 0.0
    num_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int | None = None  # prompt tokens from the prefix cache (None: not seen)
    ended: bool = False               # its task is over (with or without a final output)
    stopped: bool = False             # aborted because the load was told to stop


def error_kind(rec: RequestRecord) -> str | None:
    """None for a request that completed or was stopped on purpose, else why it failed, as a
    short kind the summary counts: ``engine_unreachable``, ``timeout``, ``abort`` (an abort
    the load did not ask for), ``no_final_output``, an HTTP kind
    (`vconsole.tools.http_load.ERROR_KINDS`), or ``engine_error`` (the engine refused it)."""
    if rec.stopped or (rec.finish_reason in COMPLETED and rec.error is None):
        return None
    if rec.finish_reason is None:
        return "no_final_output"
    if rec.finish_reason in ("abort", "timeout"):
        return rec.finish_reason
    if (rec.error or "").startswith(ENGINE_UNREACHABLE):
        return "engine_unreachable"
    return kind_of(rec.error) or "engine_error"


class LoadRun:
    """Live counters and per-request records of one run (read by the progress display)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.finished_at: float | None = None
        self.records: dict[str, RequestRecord] = {}   # every request sent, in order
        self.planned: int | None = None        # the spec's count (None: until stopped)
        self.sent = 0
        self.done = 0
        self.tokens = 0
        self.engine_lost: str | None = None   # why the engine stopped answering, if it did
        self.stopping = False                  # told to stop: its own aborts are not failures
        self.late_s = 0.0                      # a timed run: the latest a send was (s)

    @property
    def in_flight(self) -> int:
        return self.sent - self.done

    def progress(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started)
        return {"sent": self.sent, "done": self.done, "in_flight": self.in_flight,
                "tokens": self.tokens, "elapsed_s": elapsed, "tok_per_s": self.tokens / elapsed}

    def summary(self) -> dict[str, Any]:
        """The run's figures; ``errors`` maps each failure kind to its count (empty when none
        failed) and ``error_examples`` each kind to its first message."""
        end = self.finished_at or time.monotonic()
        duration = max(1e-9, end - self.started)
        recs = list(self.records.values())
        reasons = Counter(r.finish_reason for r in recs if r.finish_reason)
        errors: Counter[str] = Counter()
        examples: dict[str, str] = {}
        completed = aborted = in_flight = 0
        for r in recs:
            kind = error_kind(r) if r.ended else None
            if not r.ended:
                in_flight += 1
            elif r.stopped:
                aborted += 1
            elif kind is None:
                completed += 1
            else:
                errors[kind] += 1
                examples.setdefault(kind, _example(kind, r))
        ttft = [r.first_token - r.sent for r in recs if r.first_token is not None]
        itl = [g for r in recs for g in r.itl]
        done = [r for r in recs if r.ended and not r.stopped and error_kind(r) is None]
        cached = None if any(r.cached_tokens is None for r in done) \
            else sum(r.cached_tokens or 0 for r in done)
        return {
            "requests": len(recs), "planned": self.planned, "completed": completed,
            "failed": sum(errors.values()), "aborted": aborted, "in_flight": in_flight,
            "errors": dict(errors), "error_examples": examples, "finish_reasons": dict(reasons),
            "ttft_s": _percentiles(ttft), "itl_s": _percentiles(itl),
            "output_tokens": self.tokens, "prompt_tokens": sum(r.prompt_len for r in done),
            "cached_tokens": cached, "duration_s": duration,
            "tok_per_s": self.tokens / duration, "req_per_s": completed / duration,
            "engine_lost": self.engine_lost,
        }


def _example(kind: str, rec: RequestRecord) -> str:
    """A failure's message without the kind it starts with (the summary names the kind)."""
    text = rec.error or f"finish_reason {rec.finish_reason}"
    return text.removeprefix(f"{kind}: ")


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
            "mean": float(arr.mean())}


def format_summary(s: dict[str, Any]) -> str:
    """The summary as `vconsole load` prints it: the request counts add up (sent = completed
    + failed + aborted), and each failure kind is named with its first message."""
    def ms(d: dict[str, float | None], k: str) -> str:
        v = d[k]
        return "-" if v is None else f"{v * 1000:.1f} ms"

    sent = str(s["requests"])
    if s.get("planned") is not None and s["requests"] < s["planned"]:
        sent += f" of {s['planned']}"
    parts = [f"{s['completed']} completed"]
    for key, word in (("failed", "failed"), ("aborted", "aborted on stop"),
                      ("in_flight", "in flight")):
        if s.get(key):
            parts.append(f"{s[key]} {word}")
    lines = [f"requests     {sent} ({', '.join(parts)}) in {s['duration_s']:.2f} s",
             f"throughput   {s['tok_per_s']:.1f} output tok/s, {s['req_per_s']:.2f} req/s "
             f"({s['output_tokens']} tokens)",
             f"TTFT         p50 {ms(s['ttft_s'], 'p50')}   p99 {ms(s['ttft_s'], 'p99')}",
             f"inter-token  p50 {ms(s['itl_s'], 'p50')}   p99 {ms(s['itl_s'], 'p99')}"]
    if s["errors"]:
        lines.append("errors       " + ", ".join(f"{k} {v}" for k, v in s["errors"].items()))
        examples = s.get("error_examples") or {}
        lines += [f"  {k}: {_clip(examples[k])}" for k in s["errors"] if k in examples]
    else:
        lines.append("errors       none")
    return "\n".join(lines)


def _clip(text: str, width: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."
