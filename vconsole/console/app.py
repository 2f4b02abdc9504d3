"""`VConsoleApp`: the Textual console that watches and steers one or more engines.

Glue only. Two models, no Textual in either: `ConsoleState` (what the engines said) and
`vconsole.console.steering.Steering` (``app.steering``: read-only or not and why, the control
link, each action from plan to reply). To change an engine the app hands Steering a plan
(`steer`): Steering sends it, or returns the confirmation box to show, whose answer the app
hands back; it runs Steering's blocking calls in worker threads and shows the `Update` each
reply brings (`SteeringHost`). It never sends anything and decides nothing itself. Screens and
the palette see the app only as their host (`vconsole.console.screen_host.ScreenHost`,
`vconsole.console.palette.CommandHost`).

Data path (Memray's live TUI): the app holds a list of sources
(`vconsole.console.sources.source.Source`: our engine's stream, a recording, a vLLM server;
one per engine or group watched, so a fleet is N of them). Each source's thread folds
telemetry into the one `ConsoleState`, under the keys of the engines it heard, and, when a
snapshot came (its ``sched`` message), wakes the app (one `DataArrived` message at a time,
however many messages it folded in); the app then builds one `Frame` and hands it to the
visible screen inside ``batch_update()`` — at once while the `RefreshPacer` allows it, else as
soon as it does (`vconsole.console.pacer` says why a token bucket). A timer (``refresh_hz``)
marks engines down and refreshes when the pacer says the last refresh is old enough. The
header, the recording (``R``) and a source's actions are those of the selected engine's source
(`source_of`); the state's clock and the control channel's read-only reason are the first
source's.

Data parallel: one telemetry endpoint carries every rank of a group; ``selected_engine`` is then
a rank (``n``, the Ranks screen's cursor, the KV map's ``[`` ``]``), and the Ranks screen
(``6``), its tab and keys exist only while a group is watched (`is_dp`); on one engine ``6``
says so in a notice.

What-if (``app.whatif``: Steering's `vconsole.console.predictions.WhatIf`): the engine's
recent trace, fetched over the control channel and simulated in this process. The
confirmation box of a change the what-if models carries its predicted effect (Steering decides
that, `vconsole.console.forecast`); the Advice and What-if screens ask with `predict_later`, in
a thread worker that dies with the screen that asked.

Test hooks: ``state`` and ``steering`` (the models), ``refreshes`` (how many batched applies
ran), ``refresh_view(force=True)`` (apply now).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on
from textual.app import App
from textual.dom import DOMNode
from textual.message import Message
from textual.timer import Timer
from textual.worker import get_current_worker

from vconsole.console import keymap
from vconsole.console.control_link import Control
from vconsole.console.engine_state import EngineState
from vconsole.console.pacer import RefreshPacer
from vconsole.console.palette import CommandHost, ConsoleCommands
from vconsole.console.plans import Ask, Notice, Outcome, Plan
from vconsole.console.predictions import FAILED, Change, Prediction, WhatIf
from vconsole.console.screen_host import ScreenHost
from vconsole.console.screens.advice import AdviceScreen
from vconsole.console.screens.alerts import AlertsScreen
from vconsole.console.screens.base import ConsoleScreen
from vconsole.console.screens.config import ConfigScreen
from vconsole.console.screens.fleet import FleetScreen, tab_status
from vconsole.console.screens.help import HelpScreen
from vconsole.console.screens.kvmap import KvScreen
from vconsole.console.screens.overview import OverviewScreen
from vconsole.console.screens.profile import ProfileScreen
from vconsole.console.screens.ranks import RanksScreen
from vconsole.console.screens.requests import RequestsScreen
from vconsole.console.screens.stacks import StacksScreen
from vconsole.console.screens.trends import TrendsScreen
from vconsole.console.screens.whatif import WhatIfScreen
from vconsole.console.sources.fleet.imbalance import FleetAlerts
from vconsole.console.sources.fleet.rows import Fleet
from vconsole.console.sources.source import Source
from vconsole.console.sources.stream import ZmqSource
from vconsole.console.state import ConsoleState
from vconsole.console.steering import Steering
from vconsole.console.steering_host import SteeringHost, Update
from vconsole.console.theme import ANSI_THEME, LOW_COLOUR_SYSTEMS
from vconsole.console.widgets.chrome import Frame, TooSmall
from vconsole.console.widgets.confirmation import ConfirmScreen
from vconsole.security.curve import ClientCurve
from vconsole.telemetry.record import default_recordings_dir

MIN_WIDTH, MIN_HEIGHT = 64, 18
FLEET_READONLY = ("a fleet: drill into one of our engines (enter on its row) to change its "
                  "config")
NARROW_WIDTH = 100
SINGLE_COLUMN_WIDTH = 78


class DataArrived(Message):
    """Posted by the reader thread (thread-safe) when it folded new telemetry in."""


class VConsoleApp(App[None]):
    TITLE = "vconsole"
    CSS_PATH = "app.tcss"
    MODES = {"overview": OverviewScreen, "requests": RequestsScreen, "kv": KvScreen,
             "config": ConfigScreen, "alerts": AlertsScreen, "advice": AdviceScreen,
             "trends": TrendsScreen, "profile": ProfileScreen, "whatif": WhatIfScreen,
             "dp": RanksScreen, "stacks": StacksScreen, "fleet": FleetScreen}
    DEFAULT_MODE = "overview"
    BINDINGS = keymap.GLOBAL
    COMMANDS = App.COMMANDS | {ConsoleCommands}

    def __init__(self, telemetry_endpoints: Sequence[str] | None = None,
                 control_endpoint: str | None = None, readonly: bool = False, *,
                 source: Source | None = None, sources: Sequence[Source] = (),
                 control: Control | None = None,
                 refresh_hz: float = 10.0, record_dir: str | Path | None = None,
                 control_timeout_s: float = 3.0, clock: Callable[[], float] | None = None,
                 control_key: str | None = None, control_key_file: str | Path | None = None,
                 curve: ClientCurve | None = None, engine_address: str = "",
                 fleet: Fleet | None = None) -> None:
        """The sources: ``sources`` (and ``source``, one more), else one `ZmqSource` of
        ``telemetry_endpoints``. ``control_endpoint``: the first source's engine's.
        ``engine_address``: where the engine is, as the header shows it (the demo's
        ``127.0.0.1:BASE``: what another shell's ``$VCONSOLE_BASE_PORT`` must name).
        ``fleet``: the targets' rows (`vconsole.console.sources.fleet.rows.Fleet`, one source
        each in ``sources``): the Fleet screen comes first; the console steers the engine
        drilled into, when it is ours (`steer_fleet_engine`), and nothing before."""
        super().__init__()
        self.fleet = fleet
        self._readonly_flag = readonly
        self._control_timeout_s = control_timeout_s
        self.fleet_alerts = FleetAlerts()
        self.state = ConsoleState()
        endpoints = list(telemetry_endpoints or [])
        self.sources: list[Source] = [*sources, *([source] if source is not None else [])]
        if not self.sources:
            if not endpoints:
                raise ValueError("VConsoleApp needs telemetry_endpoints or a source")
            self.sources.append(ZmqSource(endpoints, curve=curve))
        self.endpoints = endpoints
        self.engine_address = engine_address
        self.steering = Steering.connect(
            self.state, control_endpoint=control_endpoint, control=control, readonly=readonly,
            source_readonly=FLEET_READONLY if fleet is not None
            else self.sources[0].readonly_reason,
            control_key=control_key, control_key_file=control_key_file,
            timeout_s=control_timeout_s, curve=curve, host=self)
        self._clock = clock
        self.pacer = RefreshPacer(refresh_hz)
        self.record_dir = Path(record_dir) if record_dir else default_recordings_dir()
        self.paused = False
        self.selected_engine: str | None = None
        self.refreshes = 0
        self._wake_pending = False             # a DataArrived is queued, not yet handled
        self._wake_timer: Timer | None = None  # a refresh held until the pacer allows it

    # --- lifecycle ---------------------------------------------------------------------------

    def on_mount(self) -> None:
        if self.console.color_system in LOW_COLOUR_SYSTEMS:
            self.register_theme(ANSI_THEME)
            self.theme = ANSI_THEME.name
        for source in self.sources:
            source.on_data = self._data_arrived
            source.start(self.state)
        self.state.clock = self._clock or self.sources[0].now
        self.note_size()
        self.set_interval(self.pacer.interval_s, self._tick)
        if self.steering.control is not None:
            self.steering.start_fetch()
        if self.fleet is not None and (len(self.fleet.sources) > 1
                                       or getattr(self.fleet, "opens_first", False)):
            self.switch_mode("fleet")
        self.refresh_view(force=True)

    @property
    def readonly(self) -> bool:
        return self.steering.readonly

    @property
    def readonly_reason(self) -> str:
        return self.steering.readonly_reason

    @property
    def whatif(self) -> WhatIf:
        return self.steering.whatif

    def on_unmount(self) -> None:
        for source in self.sources:
            source.stop()

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
        wait = self.pacer.spend()
        if wait <= 0:
            self.refresh_view()
        else:
            self._wake_timer = self.set_timer(wait, self._wake_due)

    def _wake_due(self) -> None:
        self._wake_timer = None
        self.pacer.spend(force=True)
        self.refresh_view()

    def _tick(self) -> None:
        self.state.mark_down()
        if self.fleet is not None:
            self.fleet_alerts.update(self.fleet, self.state)
        self.steering.refetch_on_reconnect()
        if self.pacer.tick_due():
            self.refresh_view()

    def current_engine(self) -> EngineState | None:
        return self.state.engine(self.selected_engine)

    def source_of(self, engine: EngineState | None) -> Source:
        """The source that feeds ``engine`` (before any did: the first)."""
        if engine is not None:
            for source in self.sources:
                if engine.key in source.engine_keys:
                    return source
        return self.sources[0]

    def frame(self, mode: str) -> Frame:
        return Frame.build(self.state, mode, self.selected_engine,
                           self.source_of(self.current_engine()),
                           paused=self.paused, readonly_reason=self.readonly_reason,
                           endpoints=" ".join(self.endpoints), address=self.engine_address,
                           fleet=self.fleet is not None, fleet_status=tab_status(self.fleet, self.state)
                           if self.fleet is not None and mode == "fleet" else "")

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
            screen.refresh_view(self.frame(screen.MODE), self.state)
        self.pacer.refreshed()
        self.refreshes += 1

    def note_size(self) -> None:
        w, h = self.size
        self.set_class(w < MIN_WIDTH or h < MIN_HEIGHT, "-too-small")
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
            return self.steering.can_profile
        return True

    def is_dp(self) -> bool:
        """A data-parallel group is watched (the Ranks screen and rank keys exist only then)."""
        with self.state.lock:
            return bool(self.state.dp_ranks(self.current_engine()))

    def _bindings_changed(self) -> None:
        for screen in self.screen_stack:
            screen.refresh_bindings()
        self.refresh_view(force=True)

    def action_show(self, mode: str) -> None:
        if mode == "fleet" and self.fleet is None:
            self.notify(keymap.FLEET_ONLY, title="Fleet", severity="warning")
            return
        if mode == "dp" and not self.is_dp():
            # The key is always bound so that pressing it says why nothing opens.
            self.notify(keymap.RANKS_ONLY_DP, title="Ranks", severity="warning")
            return
        if mode in self.MODES and mode != self.current_mode:
            self.switch_mode(mode)

    def action_cycle(self, step: int) -> None:
        modes = [m for m in self.MODES if (m != "dp" or self.is_dp())
                 and (m != "fleet" or self.fleet is not None)]
        i = modes.index(self.current_mode) if self.current_mode in modes else 0
        self.switch_mode(modes[(i + step) % len(modes)])

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(readonly=self.readonly, dp=self.is_dp(),
                                        fleet=self.fleet is not None))

    def drill_in(self, engine_key: str) -> None:
        """The Fleet screen's ``enter``: every screen now shows ``engine_key``."""
        self.selected_engine = engine_key
        self.state.set_primary(engine_key)      # the Config screen shows this engine's
        self.steer_fleet_engine(engine_key)
        self.switch_mode("overview")
        self.refresh_view(force=True)

    def steer_fleet_engine(self, engine_key: str) -> None:
        """Steering for the engine drilled into: its own control socket and key when it is
        ours (one engine at a time, each change behind the usual box), read-only with its
        kind's reason otherwise."""
        src = self.source_of(self.state.engine(engine_key))
        target = getattr(src, "target", None)
        endpoint = curve = key_file = None
        if target is not None and target.kind == "vconsole":
            from vconsole.console.sources.fleet.targets import CONTROL_OFFSET
            from vconsole.security.curve import load_client_curve

            endpoint, key_file = target.endpoint(CONTROL_OFFSET), target.control_key_file
            curve = load_client_curve(target.curve.get("server_public"),
                                      target.curve.get("client_key")) if target.curve else None
        self.steering = Steering.connect(
            self.state, control_endpoint=endpoint, readonly=self._readonly_flag,
            source_readonly="" if endpoint else src.readonly_reason or FLEET_READONLY,
            control_key_file=key_file, timeout_s=self._control_timeout_s, curve=curve,
            host=self)
        if self.steering.control is not None:
            self.steering.start_fetch()
        self._bindings_changed()

    def action_fleet_back(self) -> None:
        """``esc`` on a screen that has no use for it: back to the Fleet screen."""
        if self.fleet is not None and self.current_mode != "fleet":
            self.switch_mode("fleet")

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.refresh_view(force=True)

    def action_next_engine(self) -> None:
        self._select(list(self.state.engines), 1)

    def action_next_rank(self, step: int) -> None:
        """Select the previous / next rank of the watched data-parallel group."""
        with self.state.lock:
            keys = [e.key for e in self.state.dp_ranks(self.current_engine())]
        self._select(keys, step)

    def _select(self, keys: list[str], step: int) -> None:
        if len(keys) < 2:
            return
        cur = self.current_engine()
        i = keys.index(cur.key) if cur is not None and cur.key in keys else 0
        self.selected_engine = keys[(i + step) % len(keys)]
        self.refresh_view(force=True)

    def action_toggle_spec(self) -> None:
        """``D``: pause or resume speculative decoding on the selected engine (the hot key
        ``speculative_decoding``, sent as any config change is)."""
        cfg = self.state.config
        if cfg is not None and not cfg.values.get("speculative_config"):
            self.notify("speculative decoding is not configured on this engine (start it "
                        "with --speculative-config)", title="Speculation", severity="warning")
            return
        on = cfg is None or bool(cfg.values.get("speculative_decoding", True))
        reason = self.request_change("speculative_decoding", "false" if on else "true",
                                     confirmed=True)
        if reason is not None:
            self.notify(reason, title="Speculation", severity="warning")

    def action_toggle_recording(self) -> None:
        if self.steering.readonly_reason == "--readonly":
            # A read-only console (a browser tab without the token) writes nothing to disk.
            self.notify("not recorded: --readonly writes no files (run the console without "
                        "--readonly to record)", title="Record", severity="error")
            return
        said, ok = self.source_of(self.current_engine()).toggle_recording(self.record_dir)
        self.notify(said, title="Record", severity="information" if ok else "error")
        if ok:
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

    # --- steering: hand Steering a plan, show the box it asks for, hand the answer back -------

    def steer(self, plan: Plan, *, confirmed: bool = False) -> str | None:
        """Carry out a plan of ``steering``: Steering sends it, or asks (the box, whose answer
        goes back to Steering), or says there is nothing to do. Why it was refused (nothing
        sent; the caller shows it where it asked), else None. ``confirmed``: the caller
        already asked the operator."""
        self.refresh_view(force=True)
        return self._show_outcome(self.steering.begin(plan, confirmed=confirmed))

    def _show_outcome(self, outcome: Outcome) -> str | None:
        if outcome.notice is not None:
            self.show_notice(outcome.notice)
        if outcome.sent:
            self.refresh_view(force=True)
        ask = outcome.ask
        if ask is not None:
            box = ask.confirmation
            self.push_screen(ConfirmScreen(box.title, box.text, box.label, ask.forecast),
                             partial(self._answered, ask))
        return outcome.refused

    def _answered(self, ask: Ask, ok: bool | None) -> None:
        self._show_outcome(self.steering.answer(ask, bool(ok)))

    def request_change(self, key: str, text: str, *, confirmed: bool = False) -> str | None:
        """Change ``key`` to ``text`` (the Config editor's plan, by name). Returns why it is
        refused here (not sent), else None; the engine's answer arrives later in
        ``steering.replies[key]``."""
        return self.steer(self.steering.plan_change(key, text, self.current_engine()),
                          confirmed=confirmed)

    def run_source_action(self, key: str, *, confirmed: bool = False) -> None:
        """Ask the selected engine's source (a vLLM server) to do ``key``
        (`vconsole.console.sources.vllm_actions`); a refusal is a notice."""
        source = self.source_of(self.current_engine())
        reason = self.steer(self.steering.plan_action(source, key), confirmed=confirmed)
        if reason is not None:
            self.notify(reason, title="vLLM", severity="warning")

    # --- what-if ---------------------------------------------------------------------------------

    def predict_later(self, owner: DOMNode, changes: list[Change],
                      done: Callable[[list[Prediction]], None]) -> None:
        """Predict ``changes`` in a thread worker of ``owner`` (a screen: the worker is
        cancelled with it); ``done`` gets the predictions on the UI thread."""
        whatif = self.whatif

        def work() -> None:
            try:
                result = whatif.predict(changes)
            except Exception as e:  # a failed simulation must not take the console down
                result = [Prediction(FAILED, dict(c), f"{type(e).__name__}: {e}")
                          for c in changes]
            if not get_current_worker().is_cancelled:
                self.call_from_thread(done, result)
        owner.run_worker(work, thread=True, group="whatif")

    def show_notice(self, notice: Notice) -> None:
        self.notify(notice.text, title=notice.title, severity=notice.severity)

    # --- Steering's host (`vconsole.console.steering_host.SteeringHost`) -----------------------

    def run_blocking(self, work: Callable[[threading.Event], None], *, group: str,
                     exclusive: bool = False) -> None:
        """A Textual worker thread; quitting sets the event (and cancels the worker)."""
        self.run_worker(lambda: work(get_current_worker().cancelled_event), thread=True,
                        group=group, exclusive=exclusive)

    def from_worker(self, step: Callable[[], Update]) -> None:
        self.call_from_thread(lambda: self.show_update(step()))

    def show_update(self, update: Update) -> None:
        """What a reply changed: the keys a read-only console hides, a refusal inline on the
        Config screen, a notification; then the screen."""
        if update.readonly_changed:
            self._bindings_changed()
        if update.record is not None:
            for screen in self.screen_stack:
                if isinstance(screen, ConfigScreen):
                    screen.record_shown(update.record)
        if update.notice is not None:
            self.show_notice(update.notice)
        self.refresh_view(force=True)


if TYPE_CHECKING:   # the type checker verifies the app is the host each of its parts asks for
    def _hosts(app: VConsoleApp) -> tuple[ScreenHost, CommandHost, SteeringHost]:
        return app, app, app
