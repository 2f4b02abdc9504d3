"""Steering: what the console may change on the engine, what it asked, and what the engine said.

The model behind every action that changes an engine, apart from Textual: whether the console
is read-only and why, the control link and the key it holds, the config fetch, and each action
from plan to reply — config changes, applied advice, the profile run (start, progress, cancel)
and a vLLM server's actions. Screens read it as their host's ``steering``.

One way for every action: `plan_change` / `plan_advice` / `plan_edits` / `plan_profile` /
`plan_action` return a plan (`vconsole.console.plans`: refused with a reason, nothing to do, or
what the confirmation box must say); `begin` sends it at once or returns the `Ask` the operator
must answer (with the change's predicted effect from ``whatif``, the console's
`vconsole.console.predictions.WhatIf`), and `answer` sends it on yes. The plan sends itself
through Steering (`send`: one dispatch, `Plan.send`); Steering follows and takes the reply. The
app only shows the box, hands the answer back and draws.

Threads: the blocking calls run in the host's workers (`vconsole.console.steering_host`); the
replies are taken on the UI thread, so records, ``generation`` and the read-only reason change
there only, and a screen never sees a record half-updated. (A `ProfileRun` is written by its
follower thread alone, as `vconsole.console.profile_run` says.)

Read-only reasons: ``--readonly``, a replay, no control endpoint, no control key (lifted when the
engine, started after the console, writes its key: `take_written_key`), or an engine that
refused the key mid-session (`key_refused`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vconsole.console.changes import ERROR, TIMEOUT, AdviceOutcome, ChangeRecord, show_value
from vconsole.console.control_link import Control, ControlLink, TraceChannel
from vconsole.console.engine_state import EngineState
from vconsole.console.forecast import forecast
from vconsole.console.plans import (
    ActionPlan,
    AdvicePlan,
    Ask,
    ChangePlan,
    EditsPlan,
    Notice,
    Outcome,
    Plan,
    ProfilePlan,
    Sender,
    plan_advice,
    plan_change,
    plan_edits,
)
from vconsole.console.predictions import WhatIf, modelled
from vconsole.console.profile_run import ProfileRun, follow
from vconsole.console.sources.source import ActionError, Source
from vconsole.console.state import ConsoleState
from vconsole.console.steering_host import SteeringHost, Update
from vconsole.security.control_key import control_key_file as key_file_for
from vconsole.security.control_key import load_control_key
from vconsole.security.curve import ClientCurve
from vconsole.security.key_owner import KeyStatus
from vconsole.wire.control_client import NotAuthorised

CONFIG_RETRY_S = 2.0
NO_KEY = "no control key"   # the read-only reason a key file written later lifts


class Steering:
    """See the module docstring."""

    def __init__(self, state: ConsoleState, control: Control | None, *,
                 control_endpoint: str | None = None, control_key_file: Path | None = None,
                 readonly_reason: str = "", host: SteeringHost | None = None) -> None:
        self.state = state
        self.control = control
        self.control_endpoint = control_endpoint
        self.control_key_file = control_key_file
        self.readonly_reason = readonly_reason
        self.host = host
        # Predicted effects, from the engine's trace (a channel without one: no what-if).
        self.whatif = WhatIf(control.get_trace if isinstance(control, TraceChannel) else None)
        self.change_log: list[ChangeRecord] = []       # every change sent, in order
        self.replies: dict[str, ChangeRecord] = {}     # the last answer per key
        self.generation = 0                            # bumped on every new record or answer
        self.advice_outcomes: list[AdviceOutcome] = []
        self.profile_run: ProfileRun | None = None     # the last profile (screens/profile.py)
        self.control_error: str | None = None          # the last control failure
        self.key_status: KeyStatus | None = None       # whose key the console holds
        self.config_fetches = 0                        # successful get_config calls
        self._seen_reconnects: dict[str, int] = {}

    @classmethod
    def connect(cls, state: ConsoleState, *, control_endpoint: str | None,
                control: Control | None = None, readonly: bool = False,
                source_readonly: str = "", control_key: str | None = None,
                control_key_file: str | Path | None = None, timeout_s: float = 3.0,
                curve: ClientCurve | None = None, host: SteeringHost | None = None) -> Steering:
        """The console's steering for its command line: a `ControlLink` to
        ``control_endpoint`` (unless ``control`` is given, or the source is read-only: a replay,
        a vLLM server — ``source_readonly`` says why), the key from ``control_key`` or its file,
        and the read-only reason if any."""
        path = None
        if readonly:
            control_key = None      # --readonly holds no key at all, not only a UI that hides it
        if control is None and control_endpoint and not source_readonly:
            if not readonly:
                path = key_file_for(control_endpoint, control_key_file)
                if control_key is None:
                    control_key = load_control_key(control_endpoint, path)
            control = ControlLink(control_endpoint, timeout_s=timeout_s, key=control_key,
                                  key_file=path, curve=curve)
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
        return cls(state, control, control_endpoint=control_endpoint, control_key_file=path,
                   readonly_reason=reason, host=host)

    def _host(self) -> SteeringHost:
        if self.host is None:
            raise RuntimeError("Steering has no host to run its blocking calls")
        return self.host

    # --- read-only ----------------------------------------------------------------------------

    @property
    def readonly(self) -> bool:
        return bool(self.readonly_reason)

    @property
    def can_profile(self) -> bool:
        """Profiling is offered: a writable console with a control channel."""
        return not self.readonly and self.control is not None

    def source_actions_allowed(self, source: Source) -> bool:
        """The source has actions of its own (a vLLM server) and the console is not --readonly."""
        return bool(source.actions) and self.readonly_reason != "--readonly"

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
                           f"{self.control_key_file or 'its control key'}")
        return self.readonly_reason

    def _key_refused_update(self) -> Update:
        self.key_refused()
        return Update(readonly_changed=True)

    # --- the config fetch ---------------------------------------------------------------------

    def start_fetch(self) -> None:
        """Fetch the config in a worker (a newer fetch replaces a running one). A console
        started before its engine then takes the key the engine wrote."""
        def work(cancelled: threading.Event) -> None:
            if self.fetch_config(cancelled) and self.take_written_key():
                self._host().from_worker(
                    lambda: Update(readonly_changed=self.leave_readonly(NO_KEY)))
        self._host().run_blocking(work, group="config-fetch", exclusive=True)

    def refetch_on_reconnect(self) -> None:
        """An engine that came back (or restarted) may have another config: ask again. The
        UI's timer calls this."""
        with self.state.lock:
            events = {k: e.reconnects + e.restarts for k, e in self.state.engines.items()}
        primary = self.state.primary or next(iter(events), None)   # (a fleet's drill-in)
        for key, n in events.items():
            if self._seen_reconnects.get(key, 0) != n:
                self._seen_reconnects[key] = n
                if key == primary and self.control is not None and n:
                    self.start_fetch()

    def fetch_config(self, cancelled: threading.Event) -> bool:
        """Ask the control socket for the config until the engine answers (ZeroMQ's slow
        joiner: telemetry's own config announcement may be seconds away) or ``cancelled``;
        True once the state holds the engine's config. Blocks: a worker thread."""
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
        leave read-only mode with (`leave_readonly(NO_KEY)` on the UI thread)."""
        if not self.readonly_reason.startswith(NO_KEY) or not isinstance(self.control,
                                                                         ControlLink):
            return False
        key = load_control_key(self.control_endpoint or "", self.control_key_file)
        if key is None:
            return False
        self.control.key = key
        return True

    def note_key_status(self) -> None:
        """Look up which engine the held key belongs to (a file and a pid)."""
        if self.control is not None:
            self.key_status = self.control.key_status()

    # --- plans --------------------------------------------------------------------------------

    def plan_change(self, key: str, text: str, engine: EngineState | None) -> ChangePlan:
        """Validate ``text`` for ``key`` against the engine's known config and name the risk.
        A value refused here, or equal to the current one, is recorded as such in ``replies``
        (never in ``change_log``: nothing was sent)."""
        if self.readonly:
            return ChangePlan(key, refused=f"read-only console ({self.readonly_reason})")
        plan = plan_change(self.state.config, key, text, engine)
        if plan.noted is not None:
            self.note(plan.noted, sent=False)
        return plan

    def plan_advice(self, advice: Any, engine: EngineState | None) -> AdvicePlan:
        """A hot suggestion of the advisor (`vconsole.console.advisor.Advice`) as changes to the
        current config, with the risks the confirmation names."""
        if self.readonly:
            return AdvicePlan(advice, f"read-only console ({self.readonly_reason})")
        return plan_advice(self.state.config, advice, engine,
                           steered=engine is None or engine is self.state.engine())

    def plan_edits(self, values: dict[str, str], engine: EngineState | None) -> EditsPlan:
        """The What-if screen's edits (key → text) as one change of hot keys."""
        if self.readonly:
            return EditsPlan(refused=f"read-only console ({self.readonly_reason})")
        return plan_edits(self.state.config, values, engine)

    def plan_profile(self, steps: int) -> ProfilePlan:
        """Profile the engine's next ``steps`` steps: one run at a time."""
        if not self.can_profile:
            return ProfilePlan(steps, refused=f"read-only console ({self.readonly_reason})"
                               if self.readonly else "no control channel")
        run = self.profile_run
        if run is not None and run.active:
            return ProfilePlan(steps, refused=f"{run.id or 'a profile'} is running: c cancels it")
        return ProfilePlan(steps)

    def plan_action(self, source: Source, key: str) -> ActionPlan:
        """One of the source's actions (a vLLM server's routes,
        `vconsole.console.sources.vllm_actions`)."""
        if not self.source_actions_allowed(source):
            return ActionPlan(refused="read-only console: no actions")
        action = next((a for a in source.actions if a.key == key), None)
        if action is None:
            return ActionPlan(refused=f"{source.describe()} offers no action {key!r}")
        return ActionPlan(action, run=partial(source.run_action, key))

    # --- from plan to send ----------------------------------------------------------------

    def begin(self, plan: Plan, *, confirmed: bool = False) -> Outcome:
        """Carry ``plan`` as far as the console may without the operator: refused (nothing
        sent), nothing to do (a notice), sent (no box to confirm, or ``confirmed`` already),
        or the `Ask` the UI shows and hands back to `answer`. A change the what-if models gets
        its predicted effect in the box (and a routine one asks for that reason alone)."""
        if plan.refused is not None:
            return Outcome(refused=plan.refused)
        if plan.nothing_to_do is not None:
            return Outcome(notice=plan.nothing_to_do)
        change = plan.proposed or {}
        lines = forecast(self.whatif, change) if change and not confirmed else None
        ask = plan.confirmation_for(modelled=lines is not None and modelled(change))
        if ask is None or confirmed:
            return self.send(plan)
        return Outcome(ask=Ask(plan, ask, lines))

    def answer(self, ask: Ask, yes: bool) -> Outcome:
        """The operator's answer to ``ask``: sent, or what the console says to a no."""
        return self.send(ask.plan) if yes else Outcome(notice=ask.plan.declined)

    def send(self, plan: Plan) -> Outcome:
        """Send a plan that was not refused (confirmed when it asks): the reply comes back
        through the host as an `Update`."""
        plan.send(self)
        return Outcome(sent=True)

    # --- config changes and advice: one send path -------------------------------------------

    def start_change(self, key: str, old: Any, value: Any) -> ChangeRecord:
        """A change about to be sent: its pending record (send it with `round_trip`)."""
        rec = ChangeRecord(key, old, value)
        self.note(rec, sent=True)
        return rec

    def send_change(self, key: str, old: Any, value: Any) -> ChangeRecord:
        """Send one change; its record takes the engine's answer."""
        rec = self.start_change(key, old, value)
        self._send([rec], partial(self._change_replied, rec))
        return rec

    def start_advice(self, advice: Any, changes: dict[str, tuple[Any, Any]]) -> AdviceOutcome:
        """Advice about to be applied: its outcome, one pending record per change."""
        outcome = AdviceOutcome(advice, [ChangeRecord(k, old, new)
                                         for k, (old, new) in changes.items()])
        self.advice_outcomes.append(outcome)
        for rec in outcome.records:
            self.note(rec, sent=True)
        return outcome

    def send_advice(self, advice: Any, changes: dict[str, tuple[Any, Any]]) -> AdviceOutcome:
        """Apply advice as one all-or-nothing ``set_config``; the outcome lands in
        ``advice_outcomes`` and the advisor learns whether it held."""
        outcome = self.start_advice(advice, changes)
        self._send(outcome.records, partial(self._advice_replied, outcome))
        return outcome

    def send_edits(self, changes: dict[str, tuple[Any, Any]]) -> list[ChangeRecord]:
        """Several keys in one all-or-nothing ``set_config``; each record takes the answer."""
        recs = [self.start_change(k, old, new) for k, (old, new) in changes.items()]
        self._send(recs, partial(self._edits_replied, recs))
        return recs

    def _send(self, recs: list[ChangeRecord], replied: Callable[[bool], Update]) -> None:
        def work(cancelled: threading.Event) -> None:
            key_ok = self.round_trip(recs)
            self._host().from_worker(lambda: replied(key_ok))
        self._host().run_blocking(work, group="config-set")

    def round_trip(self, recs: list[ChangeRecord]) -> bool:
        """The one send path of every config change (a worker thread): one ``set_config`` for
        ``recs``, all or nothing; each record takes the engine's answer, and the state the
        config it reports. False when the engine refused the key (then `key_refused` on the
        UI thread)."""
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
        """Keep ``rec`` as the last answer for its key (and in ``change_log`` if it was sent)."""
        rec.sent = sent
        self.replies[rec.key] = rec
        if sent:
            self.change_log.append(rec)
        self.generation += 1

    def _change_replied(self, rec: ChangeRecord, key_ok: bool) -> Update:
        if not key_ok:
            self.key_refused()
        self.generation += 1
        return Update(Notice("Engine reply", f"{rec.key} {show_value(rec.old)} → "
                             f"{show_value(rec.new)}: {rec.summary()}", "information" if rec.ok
                             else "warning" if rec.status == "restart required" else "error"),
                      record=rec, readonly_changed=not key_ok)

    def _edits_replied(self, recs: list[ChangeRecord], key_ok: bool) -> Update:
        if not key_ok:
            self.key_refused()
        self.generation += 1
        bad = next((r for r in recs if not r.ok), None)
        text = ", ".join(f"{r.key} {show_value(r.old)} → {show_value(r.new)}" for r in recs)
        return Update(Notice("Engine reply", f"{text}: {(bad or recs[0]).summary()}",
                             "information" if bad is None else "error"),
                      record=bad, readonly_changed=not key_ok)

    def _advice_replied(self, outcome: AdviceOutcome, key_ok: bool) -> Update:
        if not key_ok:
            self.key_refused()
        self.state.note_advice_outcome(self.state.engine(), outcome.advice.rule, outcome.ok,
                                       f"{outcome.summary}: {outcome.advice.change_text()}")
        self.generation += 1
        return Update(Notice("Advice", f"{outcome.advice.change_text()}: {outcome.summary}",
                             "information" if outcome.ok else "error"), readonly_changed=not key_ok)

    # --- the profile run --------------------------------------------------------------------

    def start_profile(self, steps: int) -> ProfileRun:
        """Start following a new profile of ``steps`` steps (the operator confirmed): a
        worker starts it and polls it until it is over; each change refreshes the UI."""
        run = ProfileRun(steps)
        self.profile_run = run
        self._host().run_blocking(partial(self._follow, run), group="profile", exclusive=True)
        return run

    def _follow(self, run: ProfileRun, cancelled: threading.Event) -> None:
        assert self.control is not None

        def changed() -> None:
            if not cancelled.is_set():
                self._host().from_worker(Update)
        try:
            follow(self.control, run, cancelled, changed)
        except NotAuthorised:
            self._host().from_worker(self._key_refused_update)

    def cancel_profile(self) -> None:
        """Ask the engine to cancel the running profile (the follower sees it end)."""
        run = self.profile_run
        if self.readonly or self.control is None or run is None or not run.active \
                or run.id is None:
            return
        self._host().run_blocking(partial(self._cancel, self.control, run.id),
                                  group="profile-cancel")

    def _cancel(self, control: Control, profile_id: str, cancelled: threading.Event) -> None:
        try:
            control.profile_cancel(profile_id)
        except Exception as e:
            notice = Notice("Profile", f"cancelling {profile_id} failed: {e}", "error")
            self._host().from_worker(lambda: Update(notice))

    # --- a vLLM server's actions ------------------------------------------------------------

    def run_action(self, run: Callable[[], str]) -> None:
        """Run a source's action (``run``: blocking) in a worker; the answer is a notice."""
        def work(cancelled: threading.Event) -> None:
            try:
                notice = Notice("vLLM", run())
            except ActionError as e:
                notice = Notice("vLLM", str(e), "error")
            self._host().from_worker(lambda: Update(notice))
        self._host().run_blocking(work, group="source-action")


if TYPE_CHECKING:   # the type checker verifies plans can send themselves through Steering
    def _sender(steering: Steering) -> Sender:
        return steering
