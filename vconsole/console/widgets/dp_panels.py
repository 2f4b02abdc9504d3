"""Data-parallel text: the group's aggregate, one row per rank, the load imbalance.

Plain functions of the ranks' `EngineState`s and the aggregate
(`vconsole.console.state.ConsoleState.dp_aggregate`, i.e. `vconsole.console.ranks.aggregate`),
returning Content markup, like `vconsole.console.widgets.panels`: the Ranks screen and the
Overview's "Data parallel" panel show the same figures. Imbalance is the one thing coloured
here besides state: the summary says max/mean, and an overloaded rank's load is ``$warning``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vconsole.console import format as fmt
from vconsole.console.engine_state import EngineState
from vconsole.console.ranks import IMBALANCE_WARN, rank_load
from vconsole.console.widgets.chrome import STATUS_STYLE
from vconsole.console.widgets.panels import USAGE_CRIT, USAGE_WARN

GROUP_STYLE = {"ok": "$success", "forming": "$warning", "broken": "$error b", "none": "$text-muted"}
WIDE = 96     # from this width the rows also get a load bar and the sync cost per step

# (title, width, align) of the row columns; the row builder fills them in this order.
COLUMNS = (("rank", 4, "<"), ("state", 12, "<"), ("wait", 5, ">"), ("run", 5, ">"),
           ("tok/s", 7, ">"), ("KV", 6, ">"), ("sch/exe/upd", 11, ">"), ("dummy", 6, ">"),
           ("wave", 5, ">"), ("group", 7, ">"))
WIDE_COLUMNS = (("load", 12, "<"), ("sync/step", 9, ">"))


def _muted(text: str) -> str:
    return f"[$text-muted]{fmt.escape(text)}[/]"


def _num(payload: Mapping[str, Any] | None, key: str) -> float | None:
    v = payload.get(key) if payload else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _cell(text: str, width: int, align: str, style: str = "") -> str:
    text = fmt.clip(text, width)
    padded = f"{text:{align}{width}}"
    return f"[{style}]{fmt.escape(padded)}[/]" if style else fmt.escape(padded)


def overloaded(eng: EngineState, agg: Mapping[str, Any]) -> bool:
    """This rank carries too much of the load: the group is flagged imbalanced and the rank's
    waiting + running is at least IMBALANCE_WARN x the mean."""
    if not agg.get("imbalanced"):
        return False
    loads = [float(v) for v in (agg.get("load") or {}).values()]
    load = rank_load(eng.live_bodies())
    if load is None or not loads:
        return False
    return load >= IMBALANCE_WARN * (sum(loads) / len(loads))


def imbalance_text(agg: Mapping[str, Any]) -> str:
    ratio = agg.get("imbalance")
    if ratio is None:
        return _muted("imbalance –")
    text = f"imbalance {ratio:.2f}× max/mean"
    if agg.get("imbalanced"):
        return f"[$warning b]⚠ {fmt.escape(text)}[/]"
    return _muted(text)


def wave_text(agg: Mapping[str, Any]) -> str:
    wave = agg.get("wave")
    if wave is None:
        return _muted("wave –")
    state = "[$success]▶ running[/]" if agg.get("wave_running") else _muted("idle")
    split = "" if agg.get("waves_agree", True) else " [$warning](ranks differ)[/]"
    return f"wave [b]{wave}[/] {state}{split}"


def group_text(agg: Mapping[str, Any]) -> str:
    states = agg.get("group_states") or {}
    if not states:
        return _muted("group –")
    parts = [f"[{GROUP_STYLE.get(s, '')}]{fmt.escape(s)}[/]" + (f"×{n}" if n > 1 else "")
             for s, n in sorted(states.items())]
    return "group " + " ".join(parts)


def aggregate_lines(agg: Mapping[str, Any], width: int) -> list[str]:
    """Three lines: the group (ranks, wave, process group, imbalance), the summed queues and
    throughput with the blocks-weighted KV usage, then phases, dummy share and sync cost."""
    size = agg.get("world_size") or agg.get("ranks") or 0
    left = agg.get("left_out") or []
    serving = f"[b]{size} ranks[/]" + (
        f" [$error]({len(left)} down: {', '.join(f'r{r}' for r in left)})[/]" if left else "")
    line1 = fmt.fit([serving, wave_text(agg), group_text(agg), imbalance_text(agg)], width, "  ")
    usage = agg.get("kv_usage")
    line2 = fmt.fit([
        f"{_muted('waiting')} [b]{fmt.count(agg.get('num_waiting'))}[/]",
        f"{_muted('running')} [b]{fmt.count(agg.get('num_running'))}[/]",
        f"{_muted('preempted')} {fmt.count(agg.get('num_preempted'))}",
        f"[b]{fmt.num(agg.get('tokens_per_s'), 0)}[/] tok/s",
        f"{_muted('KV')} " + fmt.styled(fmt.pct(usage), fmt.level(usage, USAGE_WARN, USAGE_CRIT))
        + _muted(" of all blocks")], width, "  ")
    ph = agg.get("phase_s") or {}
    total = sum(float(v or 0) for v in ph.values())
    shares = "/".join(f"{float(ph.get(p) or 0) / total * 100:.0f}" if total > 0 else "–"
                      for p in ("schedule", "execute", "update"))
    sync = agg.get("sync_s_per_step")
    line3 = fmt.fit([f"{_muted('phases sch/exe/upd')} {shares}%",
                     f"{_muted('dummy steps')} {fmt.pct(agg.get('dummy_share'))}",
                     f"{_muted('sync')} {fmt.ms(sync)}/step" if sync is not None else
                     _muted("sync –")], width, "  ")
    return [line1, line2, line3]


def _phases(step: Mapping[str, Any] | None) -> str:
    ph = (step or {}).get("phase_s") or {}
    total = sum(float(ph.get(p) or 0) for p in ("schedule", "execute", "update"))
    if total <= 0:
        return "–"
    return "/".join(f"{float(ph.get(p) or 0) / total * 100:>3.0f}"
                    for p in ("schedule", "execute", "update"))


def header(width: int) -> str:
    cols = COLUMNS + (WIDE_COLUMNS if width >= WIDE else ())
    return _muted(" ".join(f"{t:{a}{w}}" for t, w, a in cols))


def rank_row(eng: EngineState, agg: Mapping[str, Any], now: float, width: int,
             max_load: float) -> str:
    """One rank on one line (see COLUMNS); an overloaded rank's queues in ``$warning``. A rank
    that is down or restarting gets `down_row`: its last figures are not live ones."""
    status = eng.status(now)
    if eng.rank in (agg.get("left_out") or ()) or eng.down_since(now) is not None:
        return down_row(eng, now, width)
    bodies = eng.live_bodies()
    sc, st = bodies.get("sched"), bodies.get("step")
    kvp, dp = bodies.get("kv"), bodies.get("dp")
    hot = "$warning b" if overloaded(eng, agg) else ""
    muted = ""
    usage = _num(kvp, "usage")
    wave = _num(dp, "wave")
    running = bool(dp and dp.get("wave_running"))
    group = str(dp.get("group_state")) if dp and dp.get("group_state") is not None else "–"
    cells = [
        _cell(f"r{eng.rank}", 4, "<", "b" if hot == "$text-muted" else hot or "b"),
        _cell(f"● {status}", 12, "<", STATUS_STYLE.get(status, "")),
        _cell(fmt.count(_num(sc, "num_waiting")), 5, ">", hot),
        _cell(fmt.count(_num(sc, "num_running")), 5, ">", hot),
        _cell(fmt.num(_num(st, "tokens_per_s"), 0), 7, ">", muted),
        _cell(fmt.pct(usage), 6, ">", fmt.LEVEL_STYLE[fmt.level(usage, USAGE_WARN, USAGE_CRIT)]),
        _cell(_phases(st), 11, ">", muted),
        _cell(fmt.pct(_num(dp, "dummy_share")), 6, ">", muted),
        _cell(("▶" if running else "") + (f"{wave:.0f}" if wave is not None else "–"), 5, ">",
              "$success" if running else ""),
        _cell(group, 7, ">", GROUP_STYLE.get(group, "")),
    ]
    if width >= WIDE:
        load = rank_load(bodies)
        frac = load / max_load if load is not None and max_load > 0 else 0.0
        cells.append(fmt.styled(fmt.bar(frac, 12), hot or "$accent"))
        cells.append(_cell(fmt.ms(_num(dp, "sync_s_per_step")), 9, ">"))
    return " ".join(cells)


def down_row(eng: EngineState, now: float, width: int) -> str:
    """A rank that is down or restarting: its state, dashes for the figures it no longer has,
    for how long (by receive time, as the Alerts screen's ages) and why (the restart's reason,
    when given; no heartbeat for a rank gone silent)."""
    status = eng.status(now)
    since = eng.down_since(now)
    cells = [_cell(f"r{eng.rank}", 4, "<", "b"),
             _cell(f"● {status}", 12, "<", STATUS_STYLE.get(status, "$error"))]
    cells += [_cell("–", w, a, "$text-muted") for _t, w, a in COLUMNS[2:6]]
    head = " ".join(cells)
    used = sum(w for _t, w, _a in COLUMNS[:6]) + 6
    words = [f"for {fmt.duration(now - since)}"] if since is not None else []
    reason = eng.latest.get("health", {}).get("restart_reason") if status == "restarting" \
        else "no heartbeat"
    if reason:
        actor = eng.latest.get("dp", {}).get("actor")     # the row names the rank already
        words.append(str(reason).removeprefix(f"Ray actor {actor} ") if actor else str(reason))
    return f"{head} {_muted(fmt.clip(' · '.join(words), max(0, width - used)))}"


def missing_row(rank: int) -> str:
    """A rank the group's size names but that has not been heard yet."""
    return _muted(f"r{rank:<3} ○ not heard yet")


def load_line(ranks: Sequence[EngineState], agg: Mapping[str, Any], width: int) -> str:
    """``load r0 26 r1 3 …``: waiting + running per rank, the overloaded ones highlighted."""
    parts = [_muted("load")]
    left_out = set(agg.get("left_out") or ())
    for eng in ranks:
        if eng.rank in left_out:      # down or restarting: its last figures are stale
            parts.append(f"[$error]r{eng.rank} –[/]")
            continue
        load = rank_load(eng.live_bodies())
        text = f"r{eng.rank} {fmt.count(load)}"
        parts.append(f"[$warning b]{fmt.escape(text)}[/]" if overloaded(eng, agg)
                     else fmt.escape(text))
    return fmt.fit(parts, width, " ")


def overview_panel(ranks: Sequence[EngineState], agg: Mapping[str, Any], width: int) -> str:
    """The Overview's "Data parallel" panel: the aggregate and each rank's load (6: the rest)."""
    return "\n".join([*aggregate_lines(agg, width), load_line(ranks, agg, width)])
