"""`VConsoleApp`: the Textual console that watches and steers one or more engines.

Two models, no Textual in either: `ConsoleState` (what the engines said) and
`vconsole.console.steering.Steering` (``app.steering``: read-only or not and why, the control
link and key, config changes, applied advice, the profile run). The app is the glue: it runs
their blocking calls in worker threads, asks for confirmation (`request_change`,
`apply_advice`), notifies, and draws.

Data path (Memray's live TUI): a `Source` thread folds telemetry into `ConsoleState` and, when
a snapshot came (its ``sched`` message), wakes the app (one `DataArrived` message at a time,
however many messages it folded in); the app then builds one `Frame` and hands it to the
visible screen inside ``batch_update()`` — at once while a token bucket allows it
(``refresh_hz`` tokens a second, at most ``WAKE_BURST`` saved up), else as soon as it does. (A
plain "at least a period since the last refresh" rule chains: one late refresh delays every
later snapshot too.) A timer (``refresh_hz``) marks engines down and re-applies when the last
refresh is ``AGE_TICK_S`` old (ages move; the 1 Hz topics and data fed without a wake-up show
then), so it never takes the slot a snapshot arriving right after needs. So new snapshots show
promptly, the screen refreshes at most ~``refresh_hz`` times a second, and the message rate
never reaches the event loop.

Data parallel: one telemetry endpoint carries every rank of a group; ``selected_engine`` is then
a rank (``n``, the Ranks screen's cursor, the KV map's ``[`` ``]``), and the Ranks screen
(``6``), its tab and keys exist only while a group is watched (`is_dp`); on one engine ``6``
says so in a notice.

Test hooks: ``state`` and ``steering`` (the models), ``refreshes`` (how many batched applies
ran), ``refresh_view(force=True)`` (apply now).
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
from vconsole.console.changes import AdviceOutcome, ChangeRecord, show_value
from vconsole.console.control_link import Control
from vconsole.console.palette import ConsoleCommands
from vconsole.console.profile_run import supports_profile
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
from vconsole.console.steering import NO_KEY, Steering
from vconsole.console.theme import ANSI_THEME, LOW_COLOUR_SYSTEMS
from vconsole.console.widgets.chrome import Frame, TooSmall
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.console.widgets.panels import DEFAULT_LIMITS
from vconsole.security.curve import ClientCurve
from vconsole.telemetry.record import default_recordings_dir

MIN_WIDTH, MIN_HEIGHT = 64, 18
NARROW_WIDTH = 100
SINGLE_COLUMN_WIDTH = 78
AGE_TICK_S = 0.5          # re-apply this often without a wake-up (ages move, 1 Hz topics)
WAKE_BURST = 2.0          # refreshes a wake-up may spend at once (see the module docstring)


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
        self.steering = Steering.connect(
            self.state, control_endpoint=control_endpoint, control=control, readonly=readonly,
            source_readonly=source.readonly_reason if source.readonly else "",
            control_key=control_key,
            control_key_file=control_key_file, timeout_s=control_timeout_s, curve=curve)
        self._clock = clock
        self.refresh_interval = 1.0 / refresh_hz
        self.record_dir = Path(record_dir) if record_dir else default_recordings_dir()
        self.paused = False
        self.selected_engine: str | None = None
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
        if self.steering.control is not None:
            self.fetch_config()
        self.refresh_view(force=True)

    @property
    def readonly(self) -> bool:
        return self.steering.readonly

    @property
    def readonly_reason(self) -> str:
        return self.steering.readonly_reason

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
                if key == primary and self.steering.control is not None and n:
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
            return not self.readonly and supports_profile(self.steering.control)
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
        self.steering.make_readonly(reason)
        self._bindings_changed()

    def _bindings_changed(self) -> None:
        for screen in self.screen_stack:
            screen.refresh_bindings()
        self.refresh_view(force=True)

    def action_show(self, mode: str) -> None:
        if mode == "dp" and not self.is_dp():
            # The key is always bound so that pressing it says why nothing opens.
            self.notify(keymap.RANKS_ONLY_DP, title="Ranks", severity="warning")
            return
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

    # --- steering: the Textual side of `Steering` -------------------------------------------

    @work(thread=True, exclusive=True, group="config-fetch")
    def fetch_config(self) -> None:
        """The config fetch (`Steering.fetch_config`) in a worker; quitting cancels it. A
        console started before its engine then takes the key the engine wrote."""
        if self.steering.fetch_config(get_current_worker().cancelled_event) \
                and self.steering.take_written_key():
            self.call_from_thread(self._leave_readonly, NO_KEY)

    def _leave_readonly(self, reason_prefix: str) -> None:
        if self.steering.leave_readonly(reason_prefix):
            self._bindings_changed()

    def key_refused(self) -> None:
        """The engine refused this console's control key: read-only from now on."""
        self.steering.key_refused()
        self._bindings_changed()

    def request_change(self, key: str, text: str, *, confirmed: bool = False) -> str | None:
        """Validate ``text`` for ``key`` and send it (after confirmation if risky).

        Returns a reason when the value is refused here (not sent), None otherwise; the engine's
        own answer arrives later in ``steering.replies[key]``."""
        plan = self.steering.plan_change(key, text, self.current_engine())
        self.refresh_view(force=True)
        if plan.refused is not None:
            return plan.refused
        if plan.unchanged:
            self.notify(f"{key} is already {show_value(plan.value)}", title="Config")
            return None
        if plan.risk and not confirmed:
            def done(ok: bool | None) -> None:
                if ok:
                    self.send_change(key, plan.old, plan.value)
                else:
                    self.notify(f"{key} left at {show_value(plan.old)}", title="Config")
            self.push_screen(ConfirmScreen(f"Change {key}: {show_value(plan.old)} → "
                                           f"{show_value(plan.value)}?", plan.risk), done)
            return None
        self.send_change(key, plan.old, plan.value)
        return None

    def send_change(self, key: str, old: Any, value: Any) -> ChangeRecord:
        rec = self.steering.start_change(key, old, value)
        self.refresh_view(force=True)
        self._send([rec], lambda: self._reply_arrived(rec))
        return rec

    @work(thread=True, group="config-set")
    def _send(self, recs: list[ChangeRecord], then: Callable[[], None]) -> None:
        """`Steering.round_trip` in a worker, then ``then`` on the app's thread."""
        if not self.steering.round_trip(recs):
            self.call_from_thread(self.key_refused)
        self.call_from_thread(then)

    def _reply_arrived(self, rec: ChangeRecord) -> None:
        self.steering.generation += 1
        for screen in self.screen_stack:
            if isinstance(screen, ConfigScreen):
                screen.record_shown(rec)
        severity = "information" if rec.ok else ("warning" if rec.status == "restart required"
                                                 else "error")
        self.notify(f"{rec.key} {show_value(rec.old)} → {show_value(rec.new)}: {rec.summary()}",
                    title="Engine reply", severity=severity)
        self.refresh_view(force=True)

    def apply_advice(self, advice: Any, *, confirmed: bool = False) -> str | None:
        """Apply a hot suggestion of the advisor (`vconsole.console.advisor.Advice`): always
        confirmed first (the box names each change and what it does to the running load), then
        sent as one all-or-nothing ``set_config``. Returns why it is not sent, else None; the
        outcome lands in ``steering.advice_outcomes`` and the Alerts panel."""
        plan = self.steering.plan_advice(advice, self.current_engine())
        if plan.refused is not None:
            return plan.refused
        if not plan.changes:
            self.notify(f"already in force: {advice.change_text()}", title="Advice")
            return None
        if confirmed:
            self._send_advice(advice, plan.changes)
            return None
        text = "\n".join(plan.risks) if plan.risks else \
            "Applied between two steps; nothing is preempted."
        text += f"\nSuggested by the advisor ({advice.title}): its reasons are on the Advice " \
                "screen."

        def done(ok: bool | None) -> None:
            if ok:
                self._send_advice(advice, plan.changes)
            else:
                self.notify(f"advice not applied: {advice.change_text()}", title="Advice")
        self.push_screen(ConfirmScreen(f"Apply advice: {advice.change_text()}?", text,
                                       "Apply advice"), done)
        return None

    def _send_advice(self, advice: Any, changes: dict[str, tuple[Any, Any]]) -> AdviceOutcome:
        outcome = self.steering.start_advice(advice, changes)
        self.refresh_view(force=True)
        self._send(outcome.records, lambda: self._advice_replied(outcome))
        return outcome

    def _advice_replied(self, outcome: AdviceOutcome) -> None:
        self.steering.advice_answered(outcome)
        self.notify(f"{outcome.advice.change_text()}: {outcome.summary}", title="Advice",
                    severity="information" if outcome.ok else "error")
        self.refresh_view(force=True)

    # --- actions of the source (a vLLM server's routes) -----------------------------------------

    def source_actions_allowed(self) -> bool:
        """The source has actions of its own (a vLLM server) and the console is not --readonly."""
        return self.source.kind == "vllm" and self.steering.readonly_reason != "--readonly"

    def run_source_action(self, key: str, *, confirmed: bool = False) -> None:
        """Ask the vLLM server to do ``key`` (`vconsole.console.sources.vllm_actions`), after
        the confirmation box; the server's answer is a notification."""
        from vconsole.console.sources.vllm_actions import BY_KEY

        if not self.source_actions_allowed():
            self.notify("read-only console: no actions", title="vLLM", severity="warning")
            return
        action = BY_KEY[key]
        if confirmed:
            self._source_action(key)
            return

        def done(ok: bool | None) -> None:
            if ok:
                self._source_action(key)
        self.push_screen(ConfirmScreen(f"{action.title}?", action.consequence, action.title),
                         done)

    @work(thread=True, group="source-action")
    def _source_action(self, key: str) -> None:
        from vconsole.console.sources.vllm_actions import ActionError

        try:
            text, severity = self.source.run_action(key), "information"  # type: ignore[attr-defined]
        except ActionError as e:
            text, severity = str(e), "error"
        self.call_from_thread(self.notify, text, title="vLLM", severity=severity)

    def edit_key(self, key: str) -> None:
        """Palette entry: go to Config with ``key`` selected and its editor open."""
        def open_editor() -> None:
            screen = self.active_console_screen()
            if isinstance(screen, ConfigScreen) and screen.focus_key(key):
                screen.action_edit()
        if self.current_mode != "config":
            self.switch_mode("config")
        self.call_after_refresh(open_editor)
