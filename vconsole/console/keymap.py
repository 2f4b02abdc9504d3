"""Every key binding in one place, so the footer, the help screen and the docs agree.

Keys follow the operator habits of htop/nvitop/k9s: ``?`` help, ``q`` quit, ``p`` pause, ``/``
filter, digits for screens. Screen digits are not shown in the footer: the tab bar at the top
already shows them.
"""

from __future__ import annotations

from textual.binding import Binding, BindingType

SCREENS: dict[str, tuple[str, str]] = {
    # mode name -> (key, title)
    "overview": ("1", "Overview"),
    "requests": ("2", "Requests"),
    "kv": ("3", "KV map"),
    "config": ("4", "Config"),
    "trends": ("5", "Trends"),
}

# The Ranks screen of a data-parallel group: its tab (and key) only while one is watched, so a
# lone engine's console is exactly as it was.
DP_SCREEN: dict[str, tuple[str, str]] = {"dp": ("6", "Ranks")}

# Screens reached by a letter rather than a digit: each has its tab.
LETTER_SCREENS: dict[str, tuple[str, str]] = {
    "alerts": ("!", "Alerts"),
    "advice": ("a", "Advice"),
    "profile": ("P", "Profile"),
    "whatif": ("w", "What-if"),
}

# The Fleet screen: its tab (and key) only while several targets are watched (a fleet).
FLEET_SCREEN: dict[str, tuple[str, str]] = {"fleet": ("F", "Fleet")}

FLEET_ONLY = ("Fleet (F) is for several targets: vconsole attach --target KIND=URL (twice or "
              "more), --fleet FILE or --discover HOST:PORT-PORT. This console watches one.")

# Tools rather than views of the engine's figures: a tab only while one is shown (so the bar
# says where the operator is); the help lists them.
TOOL_SCREENS: dict[str, tuple[str, str]] = {"stacks": ("S", "Stacks")}


def no_screen(key: str) -> str:
    """What a digit that opens no screen says (a key never does nothing in silence)."""
    digits = [k for k, _ in SCREENS.values()]
    letters = " ".join(k for k, _ in [*LETTER_SCREENS.values(), *TOOL_SCREENS.values()])
    ranks = " · ".join(f"{k} {t}: a data-parallel group only" for k, t in DP_SCREEN.values())
    return (f"{key} opens no screen. Screens: {digits[0]}-{digits[-1]} · {ranks} · {letters}. "
            f"? lists every key.")


# Digits no screen has: bound only to say so (the KV map's own 0, zoom to fit, comes first).
SPARE_DIGITS = ("7", "8", "9", "0")

GLOBAL: list[BindingType] = [
    Binding("q", "quit", "Quit"),
    Binding("question_mark", "help", "Help", key_display="?"),
    Binding("p", "toggle_pause", "Pause"),
    Binding("R", "toggle_recording", "Record", key_display="R"),
    Binding("D", "toggle_spec", "Speculation", key_display="D", show=False),
    Binding("n", "next_engine", "Engine"),
    Binding("exclamation_mark", "show('alerts')", "Alerts", key_display="!", show=False),
    Binding("a", "show('advice')", "Advice", show=False),
    Binding("P", "show('profile')", "Profile", key_display="P", show=False),
    Binding("w", "show('whatif')", "What-if", show=False),
    Binding("S", "show('stacks')", "Stacks", key_display="S", show=False),
    Binding("F", "show('fleet')", "Fleet", key_display="F", show=False),
    Binding("escape", "fleet_back", "Fleet", show=False),
    *(Binding(key, f"show('{mode}')", title, show=False) for mode, (key, title) in SCREENS.items()),
    *(Binding(key, f"show('{mode}')", title, show=False)
      for mode, (key, title) in DP_SCREEN.items()),
    *(Binding(key, f"notify({no_screen(key)!r}, 'Keys', 'warning')", "No screen", show=False)
      for key in SPARE_DIGITS),
]

REQUESTS: list[BindingType] = [
    Binding("enter", "detail", "Detail"),
    Binding("slash", "filter", "Filter", key_display="/"),
    Binding("s", "sort_next", "Sort"),
    Binding("r", "sort_reverse", "Reverse", show=False),   # the help pairs it with s
    Binding("escape", "close", "Close / clear filter", show=False),
]

def _plus_minus(plus: str, plus_label: str, minus: str, minus_label: str) -> list[Binding]:
    """A +/- pair; + is also "=", its unshifted key on most layouts."""
    return [Binding("plus,equals_sign", plus, plus_label, key_display="+"),
            Binding("minus", minus, minus_label, key_display="-")]


KV: list[BindingType] = [
    *_plus_minus("zoom(-1)", "Zoom in", "zoom(1)", "Zoom out"),
    Binding("0", "zoom_fit", "Fit"),
    Binding("A", "age", "Age view", key_display="A", show=False),   # time since last touched
    # Data parallel only (hidden otherwise): which rank's pool the map shows.
    Binding("left_square_bracket", "rank(-1)", "Prev rank", key_display="["),
    Binding("right_square_bracket", "rank(1)", "Next rank", key_display="]"),
]

# Moving a table's cursor (the Requests table, the Ranks list); pages only where rows scroll.
CURSOR: list[BindingType] = [
    Binding("up,k", "cursor(-1)", "Up", show=False),
    Binding("down,j", "cursor(1)", "Down", show=False),
    Binding("home", "jump(0)", "First", show=False),
    Binding("end", "jump(-1)", "Last", show=False),
]

RANKS: list[BindingType] = [
    *CURSOR,
    Binding("enter", "open_kv", "KV of rank"),
]

CONFIG: list[BindingType] = [
    Binding("e,enter", "edit", "Edit", key_display="e"),
    Binding("slash", "filter", "Filter", key_display="/"),
    Binding("escape", "clear_filter", "Clear filter", show=False),
]

TRENDS: list[BindingType] = [
    Binding("t", "next_range", "Range"),
    Binding("v,right", "page(1)", "Plots", key_display="v"),
    Binding("left", "page(-1)", "Previous plots", show=False),
]

ALERTS: list[BindingType] = [
    Binding("slash", "filter", "Filter", key_display="/"),
    Binding("escape", "clear_filter", "Clear filter", show=False),
]

STACKS: list[BindingType] = [
    Binding("r", "refresh", "Read again"),
]

ADVICE: list[BindingType] = [
    Binding("A,enter", "apply", "Apply", key_display="A"),
]

PROFILE: list[BindingType] = [
    Binding("s,enter", "start", "Start", key_display="s"),
    Binding("c", "cancel", "Cancel"),
    *_plus_minus("steps(1)", "More steps", "steps(-1)", "Fewer steps"),
]

# The What-if screen: its editor's inputs take every printable key while one has focus (esc
# leaves them), so its actions are keys of the screen, not of the inputs.
WHATIF: list[BindingType] = [
    Binding("e", "edit", "Edit"),
    Binding("r", "run", "Predict"),
    Binding("x", "reset", "Reset"),
    Binding("c", "calibrate", "Calibrate"),
    Binding("A", "apply", "Apply", key_display="A"),
    Binding("escape", "leave", "Done editing"),
]

TABLE: list[BindingType] = [
    *CURSOR,
    Binding("pageup", "page(-1)", "Page up", show=False),
    Binding("pagedown", "page(1)", "Page down", show=False),
]

FLEET: list[BindingType] = [
    Binding("enter", "drill", "Drill in"),
    Binding("slash", "filter", "Filter", key_display="/"),
    Binding("s", "sort_next", "Sort"),
    Binding("r", "sort_reverse", "Reverse", show=False),
    Binding("g", "group", "Group by model"),
    Binding("e", "fleet_set", "Change all"),
    Binding("escape", "clear_filter", "Clear filter", show=False),
]

# Shown in the help only while a fleet is watched.
FLEET_HELP: tuple[str, list[tuple[str, str]]] = (
    "Fleet (several targets)", [
        ("F", "every engine of the fleet, any kind, under the fleet's row (merged percentiles)"),
        ("enter / esc", "drill into the selected engine (every screen shows it) / come back"),
        ("/", "filter: kind:llama-cpp, state:down, waiting>0, kv>=0.8, pool=a100, a word"),
        ("s / r", "sort by the next column / reverse"), ("g", "group by model"),
        ("e", "one config change for every engine of ours: KEY=VALUE, then the box lists "
              "every engine it touches; sent one at a time, each one's answer shown")])

HELP_SECTIONS: list[tuple[str, list[tuple[str, str]]]] = [
    ("Everywhere", [(" ".join(k for k, _ in [*SCREENS.values(), *LETTER_SCREENS.values()]),
                     " / ".join(t for _, t in [*SCREENS.values(), *LETTER_SCREENS.values()])),
                    ("?", "this help"), ("q", "quit"),
                    ("p", "pause the request table and KV map (header and graphs keep moving)"),
                    ("R", "start / stop recording the raw telemetry stream"),
                    ("D", "pause / resume speculative decoding (the hot key "
                          "speculative_decoding; engines started with --speculative-config)"),
                    ("n", "next engine (when several are attached)"),
                    ("ctrl+p", "command palette: every action by name")]),
    ("Requests", [("/", "filter: words match id or state; prio>0, state:running, age>10"),
                  ("s / r", "sort by the next column / reverse"), ("↑ ↓ pgup pgdn", "move"),
                  ("enter", "detail pane: the request's figures, prompt head and output tail "
                            "(text only with --set publish_request_text=true)"),
                  ("esc", "close the detail pane, else clear the filter")]),
    ("KV map", [("+ / -", "zoom in / out (blocks per cell)"), ("0", "fit the pool to the "
                                                                   "screen"),
                ("A", "age view: time since each block was last touched, and block lifetime, "
                      "idle before evict and reuse gap (--kv-cache-metrics)")]),
    ("Config", [("e / enter", "edit the selected key; enter sends, esc cancels"),
                ("/", "filter keys")]),
    ("Alerts", [("!", "every alert heard, newest first (engine restarts and applied advice "
                      "too); the active ones on top"),
                ("/", "filter: words match the name, level, engine or message"),
                ("esc", "clear the filter")]),
    ("Advice", [("a", "tuning advice from the last 10 s of telemetry, with its evidence"),
                ("A / enter", "apply the selected hot suggestion (asks first; restart-only "
                              "ones are shown, not sent)")]),
    ("Profile", [("P", "profile the engine's next N steps: operators, step phases, layers"),
                 ("s / enter", "start (asks first: profiling slows the engine until done)"),
                 ("+ / -", "more / fewer steps (10 to 200)"), ("c", "cancel the profile")]),
    ("What-if", [("w", "predict a config change from the engine's last minutes of traffic, "
                       "simulated in the console: live | now | with the edits"),
                 ("e", "edit the keys (tab moves, enter predicts, esc leaves the editor)"),
                 ("r", "predict again (a fresh trace after 10 s)"),
                 ("x", "reset the edits to the live config"),
                 ("c", "calibrate: an engine of its own measures the step costs the edits "
                       "need (vconsole whatif --calibrate); later predictions use it"),
                 ("A", "apply the edits (hot keys; asks first)")]),
    ("Stacks", [("S", "every thread of the engine process and its Python stack, the busy "
                      "loop's first, read every 2 s (py-spy, else the engine's own dump)"),
                ("r", "read them again now")]),
    ("Trends", [("5", "plots: throughput, step time, queues, KV, TTFT, ITL"),
                ("t", "time range: last 1 / 5 / 15 minutes"),
                ("v / → ←", "next / previous plots, when not all fit")]),
]

# What ``6`` says on a lone engine (the key stays bound so that it never silently does nothing),
# and the help's line for it there.
RANKS_ONLY_DP = ("Ranks (6) is for a data-parallel group: start the engine with "
                 "--data-parallel-size N, or watch a vLLM server with several engines. "
                 "This is one engine.")
LONE_ENGINE_HELP: tuple[str, list[tuple[str, str]]] = (
    "Ranks", [("6", "every rank of a data-parallel group: only while one is watched (vconsole "
                    "engine --data-parallel-size N); this is one engine")])

# Shown in the help only while a data-parallel group is watched.
DP_HELP: tuple[str, list[tuple[str, str]]] = (
    "Ranks (data parallel)", [
        ("6", "every rank: state, queues, tok/s, KV, step phases, dummy share, wave, group; "
              "the aggregate and the load imbalance on top"),
        ("↑ ↓ home end", "select a rank (it becomes the engine every screen shows)"),
        ("enter", "the selected rank's KV map"),
        ("[ / ]", "KV map: previous / next rank")])
