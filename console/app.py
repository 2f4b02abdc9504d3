"""`VConsoleApp`: the Textual console that watches and steers one or more engines.

Data path (Memray's live TUI): a `Source` thread folds telemetry into `ConsoleState` and, when
a snapshot came (its ``sched`` message), wakes the app (one `DataArrived` message at a time, however
many messages it folded in); the app then builds one `Frame` and hands it to the visible screen
inside ``batch_update()`` — at once while a token bucket allows it (``refresh_hz`` tokens a
second, at most ``WAKE_BURST`` saved up), else as soon as it does. (A plain "at least a period
since the last refresh" rule chains: one late refresh delays every later snapshot too.) A timer (``refresh_hz``) marks engines down and re-applies when the last
refresh is ``AGE_TICK_S`` old (ages move; the 1 Hz topics and data fed without a wake-up show
then), so it never takes the slot a snapshot arriving right after needs. So new snapshots show
promptly, the screen refreshes at most ~``refresh_hz`` times a second, and the message rate
never reaches the event loop.

Steering: `request_change` validates a value, asks for confirmation when the change can hurt,
and sends it from a worker thread; the engine's reply lands in `history` / `replies` and on the
Config screen. Read-only (``--readonly``, a replay, no control endpoint, or no control key)
hides and disables every action that changes the engine. The control key
(`vconsole.security.control_key`) is ``control_key`` when given, else read from ``control_key_file`` or
the path derived from the control endpoint; without it the console still reads the config but is
read-only by itself, and an engine that refuses its key mid-session makes it read-only too
(`set_readonly`). ``key_status`` says which engine wrote the key the console holds (its owner
record, `vconsole.security.key_owner`) and whether it still runs; the Config screen shows it.
``curve``: the console's CURVE keys (`vconsole.security.curve`), for telemetry and control of an
engine started with CURVE keys.

Data parallel: one telemetry endpoint carries every rank of a group; ``selected_engine`` is then
a rank (``n``, the Ranks screen's cursor, the KV map's ``[`` ``]``), and the Ranks screen
(``6``), its tab and keys exist only while a group is watched (`is_dp`).

Test hooks: ``state`` (the model), ``history`` / ``replies`` (change records),
``refreshes`` (how many batched applies ran), ``refresh_view(force=True)`` (apply now),
``control_error`` (the last control failure), ``config_fetches`` (successful get_config calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App
from textual.message import Message
from textual.timer import Timer
from textual.worker import get_current_worker

from vconsole.console import keymap
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
from vconsole.console.palette import ConsoleCommands
from vconsole.console.profile_run import ProfileRun, supports_profile
from vconsole.console.screens.advice import AdviceScreen
from vconsole.console.screens.alerts import AlertsScreen
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.screens.config import ConfigScreen
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.kvmap import KvScreen
from vconsole.console.screens.overview import OverviewScreen
from vconsole.console.screens.profile import ProfileScreen
from vconsole.console.screens.ranks import RanksScreen
from vconsole.console.screens.requests import RequestsScreen
from vconsole.console.screens.trends import TrendsScreen
from vconsole.console.source import ReplaySource, Source, ZmqSource
from vconsole.console.state import ConsoleState, EngineState
from vconsole.console.theme import ANSI_THEME, LOW_COLOUR_SYSTEMS
from vconsole.console.widgets.chrome import Frame, TooSmall
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.console.widgets.panels import DEFAULT_LIMITS
from vconsole.security.control_key import key_path, load_control_key
from vconsole.security.curve import ClientCurve
from vconsole.security.key_owner import KeyStatus
from vconsole.telemetry.control import NotAuthorised
from vconsole.telemetry.record import default_recordings_dir

MIN_WIDTH, MIN_HEIGHT = 64, 18
NARROW_WIDTH = 100
SINGLE_COLUMN_WIDTH = 78
AGE_TICK_S = 0.5          # re-apply this often without a wake-up (ages move, 1 Hz topics)
WAKE_BURST = 2.0          # refreshes a wake-up may spend at once (see the module docstring)
CONFIG_RETRY_S = 2.0
NO_KEY = "no control key"   # the read-only reason a key file written later lifts


class DataArrived(Message):
    """Posted by the reader thread (thread-safe) when it folded new telemetry in."""


class VConsoleApp(App[None]):
    TITLE = "vconsole"
    CSS_PATH = "app.tcss"
    MODES = {"overview": OverviewScreen, "requests": RequestsScreen, "kv": KvScreen,
             "config": ConfigScreen,
             "alerts": AlertsScreen,
             "advice": AdviceScreen,
             "trends": TrendsScreen,
             "profile": ProfileScreen,
             "dp": RanksScreen}
    DEFAULT_MODE = "overview"
    BINDINGS = keymap.GLOBAL
    COMMANDS = App.COMMANDS | {ConsoleCommands}

    def __init__(self, telemetry_endpoints: Sequence[str] | None = None,
                 control_endpoint: str | None = None, readonly: bool = False, *,
                 source: Source | None = None, control: Control | None = None,
                 refresh_hz: float = 10.0, record_dir: str | Path | None = None,
                 control_timeout_s: float = 3.0, clock: Callable[[], float] | None = None,
                 control_key: str | None = None, control_key_file: str | Path | None = None,
                 curve: ClientCurve | None = None) -> None:
        super().__init__()
        self.state = ConsoleState()
        endpoints = list(telemetry_endpoints or [])
        if source is None:
            if not endpoints:
                raise ValueError("VConsoleApp needs telemetry_endpoints or a source")
            source = ZmqSource(endpoints, curve=curve)
        self.source = source
        self.endpoints = endpoints
        self.control_key_path: Path | None = None
        if control is None and control_endpoint and not isinstance(source, ReplaySource):
            self.control_key_path = key_path(control_endpoint, control_key_file)
            if control_key is None:
                control_key = load_control_key(control_endpoint, self.control_key_path)
            control = ControlLink(control_endpoint, timeout_s=control_timeout_s,
                                  key=control_key, key_path=self.control_key_path, curve=curve)
        self.control: Control | None = control
        self.control_endpoint = control_endpoint
        if readonly:
            self.readonly_reason = "--readonly"
        elif source.readonly:
            self.readonly_reason = "replay"
        elif control is None:
            self.readonly_reason = "no control endpoint"
        elif self.control_key_path is not None and control_key is None:
            self.readonly_reason = f"{NO_KEY}: {self.control_key_path}"
        else:
            self.readonly_reason = ""
        self.readonly = bool(self.readonly_reason)
        self._clock = clock
        self.refresh_interval = 1.0 / refresh_hz
        self.record_dir = Path(record_dir) if record_dir else default_recordings_dir()
        self.paused = False
        self.selected_engine: str | None = None
        self.history: list[ChangeRecord] = []
        self.replies: dict[str, ChangeRecord] = {}
        self.replies_generation = 0
        self.advice_outcomes: list[AdviceOutcome] = []
        self.profile_run: ProfileRun | None = None   # the last profile (screens/profile.py)
        self.control_error: str | None = None
        self.key_status: KeyStatus | None = None
        self.config_fetches = 0
        self.refreshes = 0
        self.too_small = False
        self._applied_generation = -1
        self._last_apply = 0.0
        self._wake_pending = False             # a DataArrived is queued, not yet handled
        self._wake_timer: Timer | None = None  # a refresh scheduled for when it is due
        self._tokens = WAKE_BURST              # the wake-ups' refresh budget, and when it was
        self._tokens_ts = time.monotonic()     # last topped up
        self._seen_reconnects: dict[str, int] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    def on_mount(self) -> None:
        if self.console.color_system in LOW_COLOUR_SYSTEMS:
            self.register_theme(ANSI_THEME)
            self.theme = ANSI_THEME.name
        self.source.on_data = self._data_arrived
        self.source.start(self.state)
        if self._clock is not None:
            self.state.clock = self._clock
        self.note_size()
        self.set_interval(self.refresh_interval, self._tick)
        if self.control is not None:
            self.fetch_config()
        self.refresh_view(force=True)

    def on_unmount(self) -> None:
        self.source.stop()

    # --- the refresh loop ----------------------------------------------------------------------

    def _data_arrived(self) -> None:
        """Reader thread: wake the app, once per batch of arrivals it has not yet seen."""
        if not self._wake_pending:
            self._wake_pending = True
            self.post_message(DataArrived())

    @on(DataArrived)
    def _wake(self) -> None:
        self._wake_pending = False
        if self._wake_timer is not None:
            return                                  # a refresh is already scheduled
        wait = self._spend_token()
        if wait <= 0:
            self.refresh_view()
        else:
            self._wake_timer = self.set_timer(wait, self._wake_due)

    def _wake_due(self) -> None:
        self._wake_timer = None
        self._spend_token(force=True)
        self.refresh_view()

    def _spend_token(self, force: bool = False) -> float:
        """Spend a refresh token and return 0, or return the seconds until one is there."""
        now = time.monotonic()
        rate = 1.0 / self.refresh_interval
        self._tokens = min(WAKE_BURST, self._tokens + (now - self._tokens_ts) * rate)
        self._tokens_ts = now
        if self._tokens >= 1.0 or force:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / rate

    def _tick(self) -> None:
        self.state.mark_down()
        self._check_reconnects()
        if time.monotonic() - self._last_apply >= AGE_TICK_S:
            self.refresh_view()

    def _check_reconnects(self) -> None:
        """An engine that came back (or restarted) may have another config: ask again."""
        with self.state.lock:
            events_ = {k: e.reconnects + e.restarts for k, e in self.state.engines.items()}
        primary = next(iter(events_), None)
        for key, n in events_.items():
            if self._seen_reconnects.get(key, 0) != n:
                self._seen_reconnects[key] = n
                if key == primary and self.control is not None and n:
                    self.fetch_config()

    def current_engine(self) -> EngineState | None:
        return self.state.engine(self.selected_engine)

    def frame(self, mode: str) -> Frame:
        st = self.state
        now = st.now()
        engines = st.engine_list()
        eng = st.engine(self.selected_engine)
        ranks = st.dp_ranks(eng)
        return Frame(
            now=now, mode=mode, engine=eng,
            engine_index=engines.index(eng) if eng in engines else 0,
            engine_count=len(engines), source=self.source.describe(),
            live=not isinstance(self.source, ReplaySource), paused=self.paused,
            readonly=self.readonly, readonly_reason=self.readonly_reason,
            recording=self.source.recording_path if self.source.recording else None,
            recorded=self.source.recorded, schema_error=st.schema_problem(now),
            last_error=st.recent_error(now) or (
                f"telemetry reader stopped: {self.source.error}" if self.source.error else None),
            endpoints=" ".join(self.endpoints),
            dp_size=st.dp_world_size(ranks) if ranks else 0)

    def active_console_screen(self) -> ConsoleScreen | None:
        for screen in reversed(self.screen_stack):
            if isinstance(screen, ConsoleScreen):
                return screen
        return None

    def refresh_view(self, force: bool = False) -> None:
        """Apply the latest state to the visible screen, in one batched update."""
        screen = self.active_console_screen()
        if screen is None or not screen.is_mounted:
            return
        with self.batch_update(), self.state.lock:
            self._applied_generation = self.state.generation
            screen.refresh_view(self.frame(screen.MODE), self.state)
        self._last_apply = time.monotonic()
        self.refreshes += 1

    def limits(self) -> dict[str, float]:
        """Thresholds to colour by: the engine's own alert settings where known."""
        out = dict(DEFAULT_LIMITS)
        cfg = self.state.config
        if cfg is not None:
            for k in out:
                v = cfg.values.get(k)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = float(v)
        return out

    # --- size --------------------------------------------------------------------------------

    def note_size(self) -> None:
        w, h = self.size
        self.too_small = w < MIN_WIDTH or h < MIN_HEIGHT
        self.set_class(self.too_small, "-too-small")
        self.set_class(w < NARROW_WIDTH, "-narrow")
        self.set_class(w < SINGLE_COLUMN_WIDTH, "-single")
        for screen in self.screen_stack:
            for box in screen.query(TooSmall):
                box.show_size(w, h, MIN_WIDTH, MIN_HEIGHT)

    # --- actions -------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "next_engine":
            return len(self.state.engines) > 1
        if action == "show" and parameters == ("profile",):
            return not self.readonly and supports_profile(self.control)
        if action == "show" and parameters == ("dp",):
            return self.is_dp()
        return True

    def is_dp(self) -> bool:
        """A data-parallel group is watched (the Ranks screen and rank keys exist only then)."""
        with self.state.lock:
            return bool(self.state.dp_ranks(self.current_engine()))

    def dp_rank_keys(self) -> list[str]:
        """Engine keys of the watched group's ranks, by rank ([] for a lone engine)."""
        with self.state.lock:
            return [e.key for e in self.state.dp_ranks(self.current_engine())]

    def set_readonly(self, reason: str) -> None:
        """Become read-only from now on (e.g. the engine refused this console's key)."""
        if not self.readonly:
            self.readonly, self.readonly_reason = True, reason
        for screen in self.screen_stack:
            screen.refresh_bindings()
        self.refresh_view(force=True)

    def action_show(self, mode: str) -> None:
        if mode in self.MODES and mode != self.current_mode:
            self.switch_mode(mode)

    def action_cycle(self, step: int) -> None:
        modes = [m for m in self.MODES if m != "dp" or self.is_dp()]
        i = modes.index(self.current_mode) if self.current_mode in modes else 0
        self.switch_mode(modes[(i + step) % len(modes)])

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(readonly=self.readonly, dp=self.is_dp()))

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.refresh_view(force=True)

    def action_next_engine(self) -> None:
        keys = list(self.state.engines)
        if len(keys) < 2:
            return
        cur = self.selected_engine if self.selected_engine in keys else keys[0]
        self.selected_engine = keys[(keys.index(cur) + 1) % len(keys)]
        self.refresh_view(force=True)

    def action_next_rank(self, step: int) -> None:
        """Select the previous / next rank of the watched data-parallel group."""
        keys = self.dp_rank_keys()
        if len(keys) < 2:
            return
        cur = self.current_engine()
        i = keys.index(cur.key) if cur is not None and cur.key in keys else 0
        self.selected_engine = keys[(i + step) % len(keys)]
        self.refresh_view(force=True)

    def action_toggle_recording(self) -> None:
        if self.source.recording:
            path, n = self.source.stop_recording()
            self.notify(f"recording stopped: {n:,} messages in {path}", title="Record")
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            path = self.record_dir / f"vconsole-{stamp}.vrec"
            try:
                self.record_dir.mkdir(parents=True, exist_ok=True)
                self.source.start_recording(path)
            except OSError as e:
                self.notify(f"cannot record to {path}: {e}", severity="error", title="Record")
                return
            self.notify(f"recording the raw stream to {path} (R stops)", title="Record")
        self.refresh_view(force=True)

    # --- config: fetch -------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="config-fetch")
    def fetch_config(self) -> None:
        """Ask the control socket for the config (ZeroMQ's slow joiner: telemetry's own config
        announcement may be seconds away), retrying until the engine answers."""
        worker = get_current_worker()
        assert self.control is not None
        while not worker.is_cancelled:
            self._note_key_status()
            try:
                reply = self.control.get_config()
            except Exception as e:  # TimeoutError, ControlError, zmq errors: retry
                self.control_error = f"control {self.control_endpoint or ''}: {e}"
                # Interruptible: quitting cancels the worker, and the executor joins it.
                if worker.cancelled_event.wait(CONFIG_RETRY_S):
                    return
                continue
            self.state.set_config_reply(reply)
            self.control_error = None
            self.config_fetches += 1
            self._take_written_key()
            return

    def _take_written_key(self) -> None:
        """Worker thread, once the engine answered: a console started before its engine found
        no key file; the engine writes it before it answers, so read it now and leave
        read-only mode (no need to quit and attach again)."""
        if not self.readonly_reason.startswith(NO_KEY) or not isinstance(self.control,
                                                                         ControlLink):
            return
        key = load_control_key(self.control_endpoint or "", self.control_key_path)
        if key is not None:
            self.control.key = key
            self.call_from_thread(self._leave_readonly, NO_KEY)

    def _leave_readonly(self, reason_prefix: str) -> None:
        if self.readonly_reason.startswith(reason_prefix):
            self.readonly, self.readonly_reason = False, ""
            for screen in self.screen_stack:
                screen.refresh_bindings()
            self.refresh_view(force=True)

    def _note_key_status(self) -> None:
        """Worker threads: look up which engine the held key belongs to (a file and a pid)."""
        look_up = getattr(self.control, "key_status", None)
        if callable(look_up):
            self.key_status = look_up()

    # --- config: change ------------------------------------------------------------------------

    def request_change(self, key: str, text: str, *, confirmed: bool = False) -> str | None:
        """Validate ``text`` for ``key`` and send it (after confirmation if risky).

        Returns a reason when the value is refused here (not sent), None otherwise; the engine's
        own answer arrives later in ``replies[key]``."""
        if self.readonly:
            return f"read-only console ({self.readonly_reason})"
        cfg = self.state.config
        if cfg is None:
            return "the engine's config is not known yet"
        row = cfg.row(key)
        if row is None:
            return f"unknown key {key!r}"
        value, reason = validate(key, text)
        old = cfg.values.get(key)
        if reason is not None:
            rec = ChangeRecord(key, old, text, status=INVALID, reason=reason)
            self._note_reply(rec, add=False)
            return reason
        if value == old:
            rec = ChangeRecord(key, old, value, status=UNCHANGED, reason="same as the current "
                               "value; not sent")
            self._note_reply(rec, add=False)
            self.notify(f"{key} is already {show_value(value)}", title="Config")
            return None
        eng = self.current_engine()
        sc = eng.latest.get("sched", {}) if eng else {}
        kvp = eng.latest.get("kv", {}) if eng else {}
        risk = consequence(key, old, value, num_running=sc.get("num_running"),
                           num_cached=kvp.get("num_cached"), hot=bool(row.get("hot", True)))
        if risk and not confirmed:
            def done(ok: bool | None) -> None:
                if ok:
                    self.send_change(key, old, value)
                else:
                    self.notify(f"{key} left at {show_value(old)}", title="Config")
            self.push_screen(ConfirmScreen(f"Change {key}: {show_value(old)} → "
                                           f"{show_value(value)}?", risk), done)
            return None
        self.send_change(key, old, value)
        return None

    def send_change(self, key: str, old: Any, value: Any) -> ChangeRecord:
        rec = ChangeRecord(key, old, value)
        self._note_reply(rec, add=True)
        self._send(rec)
        return rec

    @work(thread=True, group="config-set")
    def _send(self, rec: ChangeRecord) -> None:
        self._round_trip([rec])
        self.call_from_thread(self._reply_arrived, rec)

    def _round_trip(self, recs: list[ChangeRecord]) -> None:
        """The one send path of every config change (a worker thread): one ``set_config`` for
        ``recs``, all or nothing; each record takes the engine's answer, and the state the
        config it reports."""
        assert self.control is not None
        try:
            reply = self.control.set_config({r.key: r.new for r in recs})
        except TimeoutError as e:
            failed = (TIMEOUT, str(e))
        except NotAuthorised as e:
            failed = (ERROR, str(e))
            self.call_from_thread(self.key_refused)
        except Exception as e:
            failed = (ERROR, f"{type(e).__name__}: {e}")
        else:
            self._note_key_status()      # the key may have been read again (engine restart)
            for r in recs:
                r.take_reply(reply)
            if reply.get("values"):
                self.state.set_config_reply(reply)
            else:
                self.state.apply_set_reply(reply)
            return
        for r in recs:
            r.status, r.reason = failed

    def key_refused(self) -> None:
        """The engine refused this console's control key: read-only from now on."""
        where = self.control_key_path or "its control key"
        self.set_readonly(f"engine refused the control key: {where}")

    def _reply_arrived(self, rec: ChangeRecord) -> None:
        self.replies_generation += 1
        for screen in self.screen_stack:
            if isinstance(screen, ConfigScreen):
                screen.record_shown(rec)
        severity = "information" if rec.ok else ("warning" if rec.status == "restart required"
                                                 else "error")
        self.notify(f"{rec.key} {show_value(rec.old)} → {show_value(rec.new)}: {rec.summary()}",
                    title="Engine reply", severity=severity)
        self.refresh_view(force=True)

    def _note_reply(self, rec: ChangeRecord, *, add: bool) -> None:
        self.replies[rec.key] = rec
        if add:
            self.history.append(rec)
        self.replies_generation += 1
        self.refresh_view(force=True)

    # --- advice: apply a hot suggestion --------------------------------------------------------

    def apply_advice(self, advice: Any, *, confirmed: bool = False) -> str | None:
        """Apply a hot suggestion of the advisor (`vconsole.console.advisor.Advice`): always
        confirmed first (the box names each change and what it does to the running load), then
        sent as one all-or-nothing ``set_config``. Returns why it is not sent, else None; the
        outcome lands in ``advice_outcomes`` and the Alerts panel."""
        if self.readonly:
            return f"read-only console ({self.readonly_reason})"
        if not advice.hot:
            return "restart-only: the engine would answer 'restart required'"
        cfg = self.state.config
        if cfg is None:
            return "the engine's config is not known yet"
        eng = self.current_engine()
        if eng is not None and eng is not self.state.engine():
            return "advice for another engine: the control channel steers the first one"
        changes: dict[str, tuple[Any, Any]] = {}
        for key, new in advice.change.items():
            value, reason = validate(key, show_value(new))
            if reason is not None:
                return f"{key}: {reason}"
            if value != cfg.values.get(key):
                changes[key] = (cfg.values.get(key), value)
        if not changes:
            self.notify(f"already in force: {advice.change_text()}", title="Advice")
            return None
        sc = eng.latest.get("sched", {}) if eng else {}
        kvp = eng.latest.get("kv", {}) if eng else {}
        risks = [r for k, (old, new) in changes.items()
                 if (r := consequence(k, old, new, num_running=sc.get("num_running"),
                                      num_cached=kvp.get("num_cached"))) is not None]
        if confirmed:
            self._send_advice(advice, changes)
            return None
        text = "\n".join(risks) if risks else "Applied between two steps; nothing is preempted."
        text += f"\nSuggested by the advisor ({advice.title}): its reasons are on the Advice " \
                "screen."

        def done(ok: bool | None) -> None:
            if ok:
                self._send_advice(advice, changes)
            else:
                self.notify(f"advice not applied: {advice.change_text()}", title="Advice")
        self.push_screen(ConfirmScreen(f"Apply advice: {advice.change_text()}?", text,
                                       "Apply advice"), done)
        return None

    def _send_advice(self, advice: Any, changes: dict[str, tuple[Any, Any]]) -> AdviceOutcome:
        recs = [ChangeRecord(k, old, new) for k, (old, new) in changes.items()]
        outcome = AdviceOutcome(advice, recs)
        self.advice_outcomes.append(outcome)
        for rec in recs:
            self._note_reply(rec, add=True)
        self._send_values(outcome)
        return outcome

    @work(thread=True, group="config-set")
    def _send_values(self, outcome: AdviceOutcome) -> None:
        self._round_trip(outcome.records)
        self.call_from_thread(self._advice_replied, outcome)

    def _advice_replied(self, outcome: AdviceOutcome) -> None:
        what = outcome.advice.change_text()
        self.state.note_advice_outcome(self.state.engine(), outcome.advice.rule, outcome.ok,
                                       f"{outcome.summary}: {what}")
        self.replies_generation += 1
        self.notify(f"{what}: {outcome.summary}", title="Advice",
                    severity="information" if outcome.ok else "error")
        self.refresh_view(force=True)

    def edit_key(self, key: str) -> None:
        """Palette entry: go to Config with ``key`` selected and its editor open."""
        def open_editor() -> None:
            screen = self.active_console_screen()
            if isinstance(screen, ConfigScreen) and screen.focus_key(key):
                screen.action_edit()
        if self.current_mode != "config":
            self.switch_mode("config")
        self.call_after_refresh(open_editor)
