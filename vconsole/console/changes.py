"""Config changes from the console: client-side validation, risk, and the record of each answer.

The console validates a value with `vconsole.shared.config.coerce_value` before sending (a typo is caught
without a round trip), but the engine validates again and its reply is the truth: a
`ChangeRecord` keeps exactly what the engine said (applied / rejected with its reason / restart
required / no answer). `consequence` names changes that can hurt the running load, so the UI can
ask for confirmation with the consequence spelled out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from vconsole.shared.config import coerce_value, format_value

PENDING, APPLIED, UNCHANGED, REJECTED, RESTART, TIMEOUT, ERROR, INVALID = (
    "pending", "applied", "unchanged", "rejected", "restart required", "no answer", "error",
    "invalid")

_ids = itertools.count(1)


def validate(key: str, text: str) -> tuple[Any, str | None]:
    """(value, None) when ``text`` is a valid value for ``key``, else (None, reason)."""
    try:
        return coerce_value(key, text), None
    except ValueError as e:
        return None, str(e)


show_value = format_value


@dataclass
class ChangeRecord:
    """One attempted change and the engine's answer to it."""

    key: str
    old: Any
    new: Any
    status: str = PENDING
    reason: str = ""
    version: int | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # A data-parallel front end acknowledges per rank: rank -> applied there (empty otherwise).
    ranks: dict[str, bool] = field(default_factory=dict)
    # False when the console's own check stopped the value (invalid, or already in force): the
    # engine never saw it, so its summary must not read as the engine's answer.
    sent: bool = True

    @property
    def done(self) -> bool:
        return self.status != PENDING

    @property
    def ok(self) -> bool:
        return self.status in (APPLIED, UNCHANGED)

    def summary(self) -> str:
        """What the console shows next to the key: ``not sent: …`` for a value the console's
        own check stopped, else the engine's answer."""
        if not self.sent:
            what = self.reason or self.status
            return f"not sent: {self.status}: {what}" if self.status == INVALID else \
                f"not sent: {what}"
        if self.status == PENDING:
            return "sending…"
        acks = ""
        if self.ranks:
            acks = f" · {sum(self.ranks.values())}/{len(self.ranks)} ranks acked"
        if self.status in (APPLIED, UNCHANGED):
            v = f" (v{self.version})" if self.version is not None else ""
            return f"{self.status}{v}{acks}"
        return (f"{self.status}: {self.reason}" if self.reason else self.status) + acks

    def take_reply(self, reply: dict[str, Any]) -> None:
        """Fold in a ``set_config`` reply for this one key."""
        self.version = reply.get("version")
        acks = reply.get("ranks")
        if isinstance(acks, dict):
            self.ranks = {str(r): isinstance(a, dict) and bool(a.get("ok"))
                          for r, a in acks.items()}
        rejected = reply.get("rejected") or {}
        restart = reply.get("restart_required") or []
        if reply.get("error"):
            self.status, self.reason = ERROR, str(reply["error"])
        elif self.key in rejected:
            self.status, self.reason = REJECTED, str(rejected[self.key])
        elif rejected:  # all-or-nothing: another key sank the update
            self.status = REJECTED
            self.reason = "; ".join(f"{k}: {v}" for k, v in rejected.items())
        elif self.key in restart:
            self.status, self.reason = RESTART, "not applied; restart the engine with it"
        elif self.key in (reply.get("applied") or {}):
            self.status = APPLIED
        elif reply.get("ok"):
            self.status = UNCHANGED
        else:
            self.status, self.reason = ERROR, "engine refused the change without a reason"


def consequence(key: str, old: Any, new: Any, *, num_running: int | None = None,
                num_cached: int | None = None, hot: bool = True) -> str | None:
    """A sentence saying what a risky change will do to the running engine, or None when the
    change is routine. Restart-only keys are never risky here: the engine will not apply them."""
    if not hot or old == new:
        return None
    if key == "max_num_seqs" and isinstance(old, int) and isinstance(new, int):
        if num_running is not None and new < num_running:
            # The scheduler's rule (`vconsole.engine.sched.scheduler`): admissions stop, the
            # running requests drain, none is preempted.
            return (f"Cuts max_num_seqs from {old} to {new}: no waiting request is admitted "
                    f"until the {num_running} running ones drain to {new}; none is preempted, "
                    f"they finish as they would have.")
        if new <= old / 2:
            return (f"Cuts max_num_seqs from {old} to {new} ({(old - new) / old:.0%} fewer "
                    f"concurrent requests): throughput drops and the waiting queue grows.")
    if key == "max_num_batched_tokens" and isinstance(old, int) and isinstance(new, int) \
            and new <= old / 2:
        return (f"Shrinks the per-step token budget from {old} to {new}: long prompts take "
                f"about {old / max(new, 1):.0f}x more steps to prefill, so time to first token "
                f"rises.")
    if key == "enable_prefix_caching" and old is True and new is False:
        cached = f" ({num_cached} cached blocks)" if num_cached else ""
        return (f"Turns prefix caching off: cached prefixes{cached} are no longer reused, so "
                f"every prompt is computed in full.")
    if key == "max_holding_seconds" and new is not None and (old is None or new < old):
        return (f"Requests that wait longer than {show_value(new)} s unscheduled will be "
                f"finished with 'timeout' — including ones already waiting that long.")
    if key == "publish_request_text" and new is True:
        return ("Publishes every running and queued request's prompt head and output tail "
                "(what users typed, and the answers) on the telemetry socket, readable by "
                "anyone who can subscribe to it (loopback or CURVE only: the engine refuses "
                "otherwise).")
    if key == "telemetry_max_requests" and isinstance(new, int) and new == 0:
        return "Stops sending request rows: the Requests screen will be empty."
    if key == "heartbeat_interval_s" and isinstance(old, int | float) and \
            isinstance(new, int | float) and new >= 4 * old:
        return (f"Heartbeats every {new:g} s: a dead engine is noticed only after "
                f"{3 * new:g} s.")
    if key == "telemetry_hz" and isinstance(new, int | float) and new < 1:
        return f"Telemetry only every {1 / new:.0f} s: this console will lag behind the engine."
    return None


@dataclass
class AdviceOutcome:
    """What became of a suggestion applied from the Advice screen: one ``set_config`` carrying
    all its keys, and the engine's answer per key (``records``)."""

    advice: Any                     # vconsole.console.advisor.Advice
    records: list[ChangeRecord]

    @property
    def done(self) -> bool:
        return all(r.done for r in self.records)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.records)

    @property
    def summary(self) -> str:
        """``applied (v2)``, or the first refusal with the engine's reason."""
        if not self.done:
            return "sending…"
        if self.ok:
            return self.records[0].summary()
        bad = next(r for r in self.records if not r.ok)
        return bad.summary()
