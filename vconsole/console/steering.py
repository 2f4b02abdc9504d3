"""Steering: what the console may change on the engine, what it asked, and what the engine said.

The model behind every action that changes the engine, apart from Textual (the app,
`vconsole.console.app.VConsoleApp`, only asks for confirmation, runs the blocking calls in
worker threads and draws): whether the console is read-only and why, the control link and the
key it holds, the config fetch, config changes and applied advice (one send path,
`round_trip`), their records (``history``, ``replies``, ``advice_outcomes``) and the last
profile run. Screens read it as ``app.steering``.

Read-only reasons: ``--readonly``, a replay, no control endpoint, no control key (lifted when the
engine, started after the console, writes its key: `take_written_key`), or an engine that
refused the key mid-session (`key_refused`).

Threads: `fetch_config` and `round_trip` block on the control socket and run in worker threads;
the rest runs on the app's thread. Records are plain objects the worker fills in before the app
is told (``call_from_thread``), so a screen never sees one half-updated.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vconsole.console.changes import (
    ERROR,
    INVALID,
    TIMEOUT,
    UNCHANGED,
    AdviceOutcome,
    ChangeRecord,
    consequence,
    show_value,
    validate,
)
from vconsole.console.control_link import Control, ControlLink
from vconsole.console.profile_run import ProfileRun
from vconsole.console.state import ConsoleState, EngineState
from vconsole.security.control_key import key_path, load_control_key
from vconsole.security.curve import ClientCurve
from vconsole.security.key_owner import KeyStatus
from vconsole.telemetry.control import NotAuthorised

CONFIG_RETRY_S = 2.0
NO_KEY = "no control key"   # the read-only reason a key file written later lifts


@dataclass
class ChangePlan:
    """What `Steering.plan_change` decided: ``refused`` (not sent, with the reason), nothing to
    do (``value == old``), or send ``value`` after confirming ``risk`` when there is one."""

    key: str
    old: Any = None
    value: Any = None
    refused: str | None = None
    risk: str | None = None

    @property
    def unchanged(self) -> bool:
        return self.refused is None and self.value == self.old


@dataclass
class AdvicePlan:
    """What `Steering.plan_advice` decided: ``refused``, or ``changes`` (key → (old, new); empty:
    already in force) with the ``risks`` the confirmation names."""

    refused: str | None = None
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    risks: list[str] = field(default_factory=list)


class Steering:
    """See the module docstring."""

    def __init__(self, state: ConsoleState, control: Control | None, *,
                 control_endpoint: str | None = None, control_key_path: Path | None = None,
                 readonly_reason: str = "") -> None:
        self.state = state
        self.control = control
        self.control_endpoint = control_endpoint
        self.control_key_path = control_key_path
        self.readonly_reason = readonly_reason
        self.history: list[ChangeRecord] = []          # every change sent, in order
        self.replies: dict[str, ChangeRecord] = {}     # the last answer per key
        self.generation = 0                            # bumped on every new record or answer
        self.advice_outcomes: list[AdviceOutcome] = []
        self.profile_run: ProfileRun | None = None     # the last profile (screens/profile.py)
        self.control_error: str | None = None          # the last control failure
        self.key_status: KeyStatus | None = None       # whose key the console holds
        self.config_fetches = 0                        # successful get_config calls

    @classmethod
    def connect(cls, state: ConsoleState, *, control_endpoint: str | None,
                control: Control | None = None, readonly: bool = False,
                source_readonly: str = "", control_key: str | None = None,
                control_key_file: str | Path | None = None, timeout_s: float = 3.0,
                curve: ClientCurve | None = None) -> Steering:
        """The console's steering for its command line: a `ControlLink` to
        ``control_endpoint`` (unless ``control`` is given, or the source is read-only: a replay,
        a vLLM server — ``source_readonly`` says why), the key from ``control_key`` or its file,
        and the read-only reason if any."""
        path = None
        if control is None and control_endpoint and not source_readonly:
            path = key_path(control_endpoint, control_key_file)
            if control_key is None:
                control_key = load_control_key(control_endpoint, path)
            control = ControlLink(control_endpoint, timeout_s=timeout_s, key=control_key,
                                  key_path=path, curve=curve)
        if readonly:
            reason = "--readonly"
        elif source_readonly:
            reason = source_readonly
        elif control is None:
            reason = "no control endpoint"
        elif path is not None and control_key is None:
            reason = f"{NO_KEY}: {path}"
        else:
            reason = ""
        return cls(state, control, control_endpoint=control_endpoint, control_key_path=path,
                   readonly_reason=reason)

    # --- read-only ----------------------------------------------------------------------------

    @property
    def readonly(self) -> bool:
        return bool(self.readonly_reason)

    def make_readonly(self, reason: str) -> None:
        """Read-only from now on (the first reason stays)."""
        self.readonly_reason = self.readonly_reason or reason

    def leave_readonly(self, reason_prefix: str) -> bool:
        """Lift read-only mode if it was for this reason; True if it was lifted."""
        if self.readonly and self.readonly_reason.startswith(reason_prefix):
            self.readonly_reason = ""
            return True
        return False

    def key_refused(self) -> str:
        """The engine refused this console's control key: read-only from now on."""
        self.make_readonly(f"engine refused the control key: "
                           f"{self.control_key_path or 'its control key'}")
        return self.readonly_reason

    # --- the config fetch (worker thread) ------------------------------------------------------

    def fetch_config(self, cancelled: threading.Event) -> bool:
        """Ask the control socket for the config until the engine answers (ZeroMQ's slow
        joiner: telemetry's own config announcement may be seconds away) or ``cancelled``;
        True once the state holds the engine's config."""
        assert self.control is not None
        while not cancelled.is_set():
            self.note_key_status()
            try:
                reply = self.control.get_config()
            except Exception as e:  # TimeoutError, ControlError, zmq errors: retry
                self.control_error = f"control {self.control_endpoint or ''}: {e}"
                if cancelled.wait(CONFIG_RETRY_S):
                    return False
                continue
            self.state.set_config_reply(reply)
            self.control_error = None
            self.config_fetches += 1
            return True
        return False

    def take_written_key(self) -> bool:
        """Once the engine answered: a console started before its engine found no key file;
        the engine writes it before it answers, so read it now. True if there is a key to
        leave read-only mode with (`leave_readonly(NO_KEY)` on the app's thread)."""
        if not self.readonly_reason.startswith(NO_KEY) or not isinstance(self.control,
                                                                         ControlLink):
            return False
        key = load_control_key(self.control_endpoint or "", self.control_key_path)
        if key is None:
            return False
        self.control.key = key
        return True

    def note_key_status(self) -> None:
        """Look up which engine the held key belongs to (a file and a pid)."""
        look_up = getattr(self.control, "key_status", None)
        if callable(look_up):
            self.key_status = look_up()

    # --- config changes -----------------------------------------------------------------------

    def plan_change(self, key: str, text: str, engine: EngineState | None) -> ChangePlan:
        """Validate ``text`` for ``key`` against the engine's known config and name the risk.
        A value refused here, or equal to the current one, is recorded as such in ``replies``
        (never in ``history``: nothing was sent)."""
        if self.readonly:
            return ChangePlan(key, refused=f"read-only console ({self.readonly_reason})")
        cfg = self.state.config
        if cfg is None:
            return ChangePlan(key, refused="the engine's config is not known yet")
        row = cfg.row(key)
        if row is None:
            return ChangePlan(key, refused=f"unknown key {key!r}")
        old = cfg.values.get(key)
        value, reason = validate(key, text)
        if reason is not None:
            self.note(ChangeRecord(key, old, text, status=INVALID, reason=reason), sent=False)
            return ChangePlan(key, old, refused=reason)
        if value == old:
            self.note(ChangeRecord(key, old, value, status=UNCHANGED,
                                   reason="same as the current value"), sent=False)
            return ChangePlan(key, old, value)
        sc, kvp = _latest(engine)
        risk = consequence(key, old, value, num_running=sc.get("num_running"),
                           num_cached=kvp.get("num_cached"), hot=bool(row.get("hot", True)))
        return ChangePlan(key, old, value, risk=risk)

    def start_change(self, key: str, old: Any, value: Any) -> ChangeRecord:
        """A change about to be sent: its pending record (send it with `round_trip`)."""
        rec = ChangeRecord(key, old, value)
        self.note(rec, sent=True)
        return rec

    def plan_advice(self, advice: Any, engine: EngineState | None) -> AdvicePlan:
        """A hot suggestion of the advisor (`vconsole.console.advisor.Advice`) as changes to the
        current config, with the risks the confirmation names."""
        if self.readonly:
            return AdvicePlan(f"read-only console ({self.readonly_reason})")
        if not advice.hot:
            return AdvicePlan("restart-only: the engine would answer 'restart required'")
        cfg = self.state.config
        if cfg is None:
            return AdvicePlan("the engine's config is not known yet")
        if engine is not None and engine is not self.state.engine():
            return AdvicePlan("advice for another engine: the control channel steers the "
                              "first one")
        plan = AdvicePlan()
        for key, new in advice.change.items():
            value, reason = validate(key, show_value(new))
            if reason is not None:
                return AdvicePlan(f"{key}: {reason}")
            if value != cfg.values.get(key):
                plan.changes[key] = (cfg.values.get(key), value)
        sc, kvp = _latest(engine)
        plan.risks = [r for k, (old, new) in plan.changes.items()
                      if (r := consequence(k, old, new, num_running=sc.get("num_running"),
                                           num_cached=kvp.get("num_cached"))) is not None]
        return plan

    def start_advice(self, advice: Any, changes: dict[str, tuple[Any, Any]]) -> AdviceOutcome:
        """Advice about to be applied: its outcome, one pending record per change."""
        outcome = AdviceOutcome(advice, [ChangeRecord(k, old, new)
                                         for k, (old, new) in changes.items()])
        self.advice_outcomes.append(outcome)
        for rec in outcome.records:
            self.note(rec, sent=True)
        return outcome

    def round_trip(self, recs: list[ChangeRecord]) -> bool:
        """The one send path of every config change (a worker thread): one ``set_config`` for
        ``recs``, all or nothing; each record takes the engine's answer, and the state the
        config it reports. False when the engine refused the key (call `key_refused` on the
        app's thread)."""
        assert self.control is not None
        try:
            reply = self.control.set_config({r.key: r.new for r in recs})
        except TimeoutError as e:
            failed = (TIMEOUT, str(e))
        except NotAuthorised as e:
            for r in recs:
                r.status, r.reason = ERROR, str(e)
            return False
        except Exception as e:
            failed = (ERROR, f"{type(e).__name__}: {e}")
        else:
            self.note_key_status()      # the key may have been read again (engine restart)
            for r in recs:
                r.take_reply(reply)
            if reply.get("values"):
                self.state.set_config_reply(reply)
            else:
                self.state.apply_set_reply(reply)
            return True
        for r in recs:
            r.status, r.reason = failed
        return True

    def note(self, rec: ChangeRecord, *, sent: bool) -> None:
        """Keep ``rec`` as the last answer for its key (and in ``history`` if it was sent)."""
        rec.sent = sent
        self.replies[rec.key] = rec
        if sent:
            self.history.append(rec)
        self.generation += 1

    def advice_answered(self, outcome: AdviceOutcome) -> None:
        """The engine answered applied advice: the advisor learns whether it held."""
        self.state.note_advice_outcome(self.state.engine(), outcome.advice.rule, outcome.ok,
                                       f"{outcome.summary}: {outcome.advice.change_text()}")
        self.generation += 1


def _latest(engine: EngineState | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's latest ``sched`` and ``kv`` bodies (empty when unknown)."""
    if engine is None:
        return {}, {}
    return engine.latest.get("sched", {}), engine.latest.get("kv", {})
