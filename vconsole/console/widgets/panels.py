"""The Overview's panels, each a `Static` whose text is built from one engine's state.

Builders are plain functions ``(engine, now, width, limits) -> markup`` so tests can pin their
output without a running app; the `Panel` widget only supplies its width and shows the text.
Colours carry meaning only: ``$warning``/``$error`` at thresholds (the engine's own alert
thresholds from its config where there is one; nvitop's 80 % for memory), muted for labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from textual.content import Content
from textual.widgets import Static

from vconsole.console import format as fmt
from vconsole.console import spec_view
from vconsole.console.engine_state import Alert, ConfigView, EngineState, Series

SPARK_WINDOW_S = 120.0
MEM_WARN, MEM_CRIT = 0.80, 0.95
USAGE_WARN, USAGE_CRIT = 0.80, 0.95
TEMP_WARN, TEMP_CRIT = 80.0, 90.0

# Engine config keys the panels colour by, with the engine's defaults.
DEFAULT_LIMITS: dict[str, float] = {
    "alert_waiting_warning": 50, "alert_waiting_critical": 100,
    "alert_sched_share_warning": 0.15, "fragmentation_threshold": 0.5,
    "alert_step_time_warning_s": 0.5, "alert_step_time_critical_s": 1.0,
    "alert_gpu_memory_warning": MEM_WARN, "alert_gpu_memory_critical": MEM_CRIT,
}


def limits_of(cfg: ConfigView | None) -> dict[str, float]:
    """Thresholds to colour by: the engine's own alert settings where known."""
    out = dict(DEFAULT_LIMITS)
    if cfg is not None:
        for k in out:
            v = cfg.values.get(k)
            if isinstance(v, int | float) and not isinstance(v, bool):
                out[k] = float(v)
    return out


ALERT_ICON = {"critical": "[$error b]●[/]", "warning": "[$warning]●[/]", "ok": "[$success]✓[/]"}
LEVEL = {"critical": "$error", "warning": "$warning", "ok": "$success"}


class Panel(Static):
    """A bordered box with a title; ``show`` replaces its text."""

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = title

    @property
    def inner_width(self) -> int:
        return self.content_size.width or 36

    def show(self, markup: str) -> None:
        self.update(Content.from_markup(markup))


def _muted(text: str) -> str:
    return f"[$text-muted]{fmt.escape(text)}[/]"


def _spark(series: Series, now: float, width: int, lo: float | None = 0.0,
           hi: float | None = None) -> str:
    if width < 3:
        return ""
    return _muted(fmt.sparkline(series.resample(now, SPARK_WINDOW_S, width), lo, hi))


def _num(payload: Mapping[str, Any], key: str) -> float | None:
    v = payload.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _waiting(text: str) -> str:
    return _muted(text)


def summary(eng: EngineState | None, now: float) -> str:
    """One line under the tab bar: who, state, uptime, throughput, link health."""
    if eng is None:
        return _waiting("no telemetry yet")
    h = eng.latest.get("health", {})
    st = eng.latest.get("step", {})
    status = eng.status(now)
    style = {"running": "$success", "idle": "$accent", "down": "$error b"}.get(status, "$warning")
    age = eng.heartbeat_age(now)
    hb_style = "$error b" if eng.is_stale(now) else ""
    hb = f"hb {fmt.duration(age)}" if age is not None else "hb –"
    # A down engine has no uptime and makes no tokens: its last figures are not shown as now.
    live = status != "down"
    parts = [f"[b]{fmt.escape(eng.label)}[/]", f"[{style}]{status}[/]",
             f"up {fmt.duration(_num(h, 'uptime_s') if live else None)}",
             f"[b]{fmt.num(_num(st, 'steps_per_s') if live else None)}[/] steps/s",
             f"[b]{fmt.num(_num(st, 'tokens_per_s') if live else None, 0)}[/] tok/s",
             f"[{hb_style}]{hb}[/]" if hb_style else hb]
    if eng.dropped:
        parts.append(f"[$warning]lost {eng.dropped:,}[/]")
    return "  ".join(parts)


def dp_summary(eng: EngineState | None, agg: Mapping[str, Any], now: float) -> str:
    """The summary line of a data-parallel group: its name, how many ranks and in which
    states, the summed tokens/s and queues, the wave; the heartbeat of the selected rank."""
    if eng is None:
        return _waiting("no telemetry yet")
    size = agg.get("world_size") or agg.get("ranks")
    down = agg.get("left_out") or []
    ranks = f"[b]{size} ranks[/]" + (f" [$error b]{len(down)} down[/]" if down else "")
    wave = agg.get("wave")
    parts = [f"[b]{fmt.escape(eng.engine)}[/]", ranks,
             f"[b]{fmt.num(agg.get('tokens_per_s'), 0)}[/] tok/s",
             f"run [b]{fmt.count(agg.get('num_running'))}[/]",
             f"wait [b]{fmt.count(agg.get('num_waiting'))}[/]"]
    if wave is not None:
        parts.append(f"wave {wave}" + (" ▶" if agg.get("wave_running") else ""))
    if agg.get("imbalanced"):
        parts.append(f"[$warning b]⚠ imbalance {agg['imbalance']:.1f}×[/]")
    age = eng.heartbeat_age(now)
    parts.append(f"r{eng.rank} hb {fmt.duration(age)}" if age is not None else "hb –")
    return "  ".join(parts)


def queues(eng: EngineState, now: float, width: int, limits: Mapping[str, float]) -> str:
    sc = eng.latest.get("sched")
    if not sc:
        return _waiting("no scheduler snapshot yet")
    waiting = _num(sc, "num_waiting")
    running = _num(sc, "num_running")
    cap = _num(sc, "max_num_seqs")
    wl = fmt.level(waiting, limits["alert_waiting_warning"], limits["alert_waiting_critical"])
    run_text = fmt.count(running) + (f"/{fmt.count(cap)}" if cap else "")
    rows = [("waiting", fmt.styled(f"{fmt.count(waiting):>8}", wl), "waiting", None),
            ("running", f"{run_text:>8}", "running", cap),
            ("preempted", f"{fmt.count(_num(sc, 'num_preempted')):>8}", "preempted", None)]
    spark_w = width - 19
    lines = [f"{_muted(f'{label:<10}')}{value} {_spark(eng.series[name], now, spark_w, 0, hi)}"
             for label, value, name, hi in rows]
    lines.append(_muted(fmt.fit([f"finished {fmt.count(_num(sc, 'num_finished_total'))}",
                                 f"preemptions {fmt.count(_num(sc, 'num_preemptions_total'))}",
                                 *([str(sc["policy"])] if sc.get("policy") else [])], width)))
    spec = spec_view.summary(sc)        # speculative decoding, where configured
    if spec is not None:
        lines.append(spec)
    return "\n".join(lines)


def phases(eng: EngineState, now: float, width: int, limits: Mapping[str, float]) -> str:
    st = eng.latest.get("step")
    if not st:
        return _waiting("no step window yet")
    steps = int(_num(st, "steps") or 0)
    if "phase_s" in (st.get("not_exposed") or ()):
        return "\n".join([
            _muted(f"{fmt.source_name(st.get('source'))} does not expose step phases"),
            fmt.fit([f"{_muted('steps/s')} {fmt.num(_num(st, 'steps_per_s'))}",
                     f"{_muted('tok/s')} {fmt.num(_num(st, 'tokens_per_s'), 0)}"], width, "  "),
            fmt.fit([_window_tokens(st),
                     f"{_muted('finished')} {fmt.count(_num(st, 'num_finished'))}"],
                    width, "  ")])
    ph = st.get("phase_s") or {}
    # structured: the bitmask of the constrained rows and their matchers (shown while > 0)
    names = [n for n in ("schedule", "execute", "update", "structured")
             if n != "structured" or float(ph.get(n) or 0) > 0]
    total = sum(float(ph.get(k) or 0) for k in names)
    share = _num(st, "sched_share")
    thr = limits["alert_sched_share_warning"]
    if steps == 0 or total <= 0:
        return _waiting("idle: no steps in the last window")
    bar_w = max(4, width - 9 - 7 - 9)
    lines = []
    for name in names:
        part = float(ph.get(name) or 0) / total
        lvl = fmt.level(share, thr) if name == "schedule" else ""
        bar = fmt.styled(fmt.bar(part, bar_w), lvl or "$accent")
        label = "grammar" if name == "structured" else name
        lines.append(f"{_muted(f'{label:<9}')}{bar}{fmt.styled(f'{fmt.pct(part):>7}', lvl)}"
                     f"{fmt.ms(float(ph.get(name) or 0) / steps):>9}")
    p50 = _num(st, "step_time_p50_s")
    p50_lvl = fmt.level(p50, limits["alert_step_time_warning_s"],
                        limits["alert_step_time_critical_s"])
    lines.append(fmt.fit([f"{_muted('step p50')} {fmt.styled(fmt.ms(p50), p50_lvl)}",
                          f"{_muted('max')} {fmt.ms(_num(st, 'step_time_max_s'))}",
                          _window_tokens(st)], width, "  "))
    perf = st.get("perf")
    window = _num(st, "window_s")
    if isinstance(perf, Mapping) and window:
        flops = float(perf.get("flops") or 0) / window
        moved = (float(perf.get("read_bytes") or 0) + float(perf.get("write_bytes") or 0)) / window
        lines.append(fmt.fit([f"{_muted('est.')} {_si(flops)}FLOP/s"
                              f"{_of_peak(flops, perf.get('peak_flops_per_s'))}",
                              f"{_muted('memory')} {_si(moved)}B/s"
                              f"{_of_peak(moved, perf.get('peak_bytes_per_s'))}"],
                             width, "  "))
    if share is not None and share >= thr:
        lines.append(fmt.styled(f"⚠ scheduler is {fmt.pct(share, 0)} of step time "
                                f"(≥ {fmt.pct(thr, 0)})", fmt.WARN))
    return "\n".join(lines)


def _si(value: float) -> str:
    """12.3 G: the engine's estimated rates (``--enable-mfu-metrics``, the ``step`` topic's
    ``perf``), as vLLM's logger prints them."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.1f} {unit}"
    return f"{value:.0f} "


def _of_peak(rate: float, peak: Any) -> str:
    """`` 12%``: a rate as a share of the machine's measured peak (none for a GPU engine)."""
    if not isinstance(peak, (int, float)) or peak <= 0:
        return ""
    return f" {_muted(fmt.pct(rate / peak, 0))}"


def _window_tokens(st: Mapping[str, Any]) -> str:
    """``tokens/1s 0p+79d``: the prefill and decode tokens of the whole step window (the
    ``step`` topic carries window totals, not one step's batch), named by the window's length
    so it never reads as a batch beside ``running 2/4``."""
    window = _num(st, "window_s")
    span = f"{window:.1f}".removesuffix(".0") + "s" if window else "window"
    return (f"{_muted(f'tokens/{span}')} {fmt.count(_num(st, 'num_prefill_tokens'))}p+"
            f"{fmt.count(_num(st, 'num_decode_tokens'))}d")


def kv(eng: EngineState, now: float, width: int, limits: Mapping[str, float]) -> str:
    k = eng.latest.get("kv")
    if not k:
        return _waiting("no KV snapshot yet")
    usage, tok = _num(k, "usage"), _num(k, "token_usage")
    frag, hit = _num(k, "fragmentation"), _num(k, "prefix_hit_rate")
    used, total = _num(k, "num_used"), _num(k, "num_blocks")
    blocks = f"{fmt.count(used)}/{fmt.count(total)}"
    if k.get("usage_estimated"):       # llama.cpp: from its slots, not a pool it reports
        blocks = "estimated"
    detail_w = max(len(blocks), 9)
    rows = [("blocks", usage, fmt.level(usage, USAGE_WARN, USAGE_CRIT), blocks, "kv_usage"),
            ("tokens", tok, fmt.level(tok, USAGE_WARN, USAGE_CRIT), "", "token_usage"),
            ("frag", frag, fmt.level(frag, limits["fragmentation_threshold"]), "",
             "fragmentation"),
            ("prefix", hit, "", "hit", "prefix_hit_rate")]
    spark_w = width - 7 - 7 - detail_w - 2
    lines = [f"{_muted(f'{label:<7}')}{fmt.styled(f'{fmt.pct(val):>6}', lvl)} "
             f"{_muted(f'{detail:<{detail_w}}')} {_spark(eng.series[name], now, spark_w, 0, 1)}"
             for label, val, lvl, detail, name in rows]
    lines.append(_muted(fmt.fit([f"free {fmt.count(_num(k, 'num_free'))}",
                                 f"cached {fmt.count(_num(k, 'num_cached'))}",
                                 f"shared {fmt.count(_num(k, 'num_shared'))}",
                                 f"{fmt.count(_num(k, 'block_size'))} tok/block"], width)))
    return "\n".join(lines)


def kv_storage(k: Mapping[str, Any] | None, width: int) -> str:
    """How the pool stores tokens, plain text within ``width``: ``int8_per_token_head ·
    1,088 B/token · 4,096 tokens``, shortened (``int8 · 1,088 B/tok · 4,096 tok``) where that
    does not fit, then cut from the end; a per-channel format's staging of its open blocks
    beside them (``+ staging 6.0MiB / 64 open``). Only what the source says: an engine from
    before the KV dtypes sends no ``cache_dtype`` (→ ""), a vLLM server no bytes per
    token."""
    if not k or not isinstance(k.get("cache_dtype"), str):
        return ""
    dtype = str(k["cache_dtype"])
    per_token, capacity = _num(k, "bytes_per_token"), _num(k, "capacity_tokens")
    blocks, block_size = _num(k, "num_blocks"), _num(k, "block_size")
    if capacity is None and blocks is not None and block_size is not None:
        capacity = blocks * block_size
    for name, b_unit, t_unit in ((dtype, "B/token", "tokens"),
                                 (dtype.split("_per_")[0], "B/tok", "tok")):
        parts = [name]
        if per_token is not None:
            parts.append(f"{fmt.count(per_token)} {b_unit}")
        if capacity is not None:
            parts.append(f"{fmt.count(capacity)} {t_unit}")
        staging, open_blocks = _num(k, "staging_bytes"), _num(k, "staging_blocks")
        if staging:
            parts.append(f"+ staging {fmt.nbytes(int(staging))}"
                         + (f" / {fmt.count(open_blocks)} open" if open_blocks else ""))
        text = " · ".join(parts)
        if len(text) <= width:
            return text
    return fmt.fit(parts, width)


def gpu(eng: EngineState, now: float, width: int, limits: Mapping[str, float]) -> str:
    g = eng.latest.get("gpu")
    if not g:
        return _waiting("no GPU reading yet")
    if not g.get("available"):
        return fmt.styled(f"no NVIDIA GPU: {g.get('error') or 'unknown reason'}", fmt.MUTED)
    lines = []
    warn = limits.get("alert_gpu_memory_warning", MEM_WARN)
    crit = limits.get("alert_gpu_memory_critical", MEM_CRIT)
    for d in g.get("devices") or ():
        idx = int(d.get("index", 0))
        util = _num(d, "util")
        used, total = _num(d, "mem_used"), _num(d, "mem_total")
        share = used / total if used is not None and total else None
        temp = _num(d, "temp_c")
        name = fmt.clip(str(d.get("name", "GPU")).replace("NVIDIA ", ""), 14)
        util_s = f"{util:.0f}%" if util is not None else "–"
        spark_w = width - 2 - 14 - 11
        series = eng.gpu_series.get(idx)
        spark = _spark(series[0], now, spark_w, 0, 100) if series else ""
        lines.append(f"[b]{idx}[/] {fmt.escape(f'{name:<14}')} {_muted('util')} {util_s:>4} "
                     f"{spark}")
        mem = fmt.nbytes_pair(used, total)
        parts = [f"  {_muted('mem')} {mem} " + fmt.styled(fmt.pct(share, 0),
                                                          fmt.level(share, warn, crit))]
        if temp is not None:
            parts.append(fmt.styled(f"{temp:.0f}°C", fmt.level(temp, TEMP_WARN, TEMP_CRIT)))
        if _num(d, "power_w") is not None:
            parts.append(f"{_num(d, 'power_w'):.0f}W")
        if _num(d, "sm_clock_mhz") is not None:
            parts.append(f"{_num(d, 'sm_clock_mhz'):.0f}MHz")
        lines.append(fmt.fit(parts, width, "  "))
    return "\n".join(lines) or _muted("no devices")


def host(eng: EngineState, now: float, width: int, limits: Mapping[str, float]) -> str:
    h = eng.latest.get("host")
    if not h:
        source = eng.latest.get("health", {}).get("source")
        return _waiting(f"{fmt.source_name(source)} does not expose host readings" if source
                        else "no host reading yet")
    pcpu, scpu = _num(h, "proc_cpu_percent"), _num(h, "sys_cpu_percent")
    used, total = _num(h, "sys_mem_used"), _num(h, "sys_mem_total")
    share = used / total if used is not None and total else None
    threads = _num(h, "proc_num_threads")
    cores = _num(h, "sys_cpu_count")
    rss = fmt.nbytes(_num(h, "proc_rss_bytes"))
    wide = width >= 42
    line1 = fmt.fit([_muted("engine " if wide else "proc") + (f" cpu {pcpu:>3.0f}%" if pcpu is not None else
                                          " cpu   –"),
                     f"rss {rss}", f"{threads:.0f} threads" if threads is not None else ""],
                    width, "  ")
    mem = fmt.styled(fmt.pct(share, 0), fmt.level(share, MEM_WARN, MEM_CRIT))
    line2 = fmt.fit([_muted("machine" if wide else "sys ") + (f" cpu {scpu:>3.0f}%" if scpu is not None else
                                          " cpu   –"),
                     f"mem {fmt.nbytes_pair(used, total)} {mem}",
                     f"{cores:.0f} cores" if cores is not None else ""], width, "  ")
    return f"{line1}\n{line2}"


# Overview latency rows: label -> (series in the ``latency`` topic, its p99 sparkline series).
LATENCY_ROWS = (("TTFT", "ttft_s", "ttft_p99"), ("ITL", "itl_s", "itl_p99"),
                ("e2e", "e2e_s", "e2e_p99"), ("queue", "queue_s", "queue_p99"))


def _latency_window(eng: EngineState) -> tuple[dict[str, Any], float | None] | None:
    """The overall window percentiles of the last ``latency`` message and its window length."""
    lat = eng.latest.get("latency")
    if not lat:
        return None
    overall = lat.get("overall")
    window = overall.get("window") if isinstance(overall, dict) else None
    return (window if isinstance(window, dict) else {}), _num(lat, "window_s")


def latency_title(eng: EngineState | None) -> str:
    """``Latency p50/p99 · 60s · 315 req``: what the columns are, over which window, and how
    many requests finished in it (so a p99 of three requests reads as such)."""
    got = _latency_window(eng) if eng is not None else None
    if got is None:
        return "Latency p50/p99"
    window, window_s = got
    e2e = window.get("e2e_s")
    n = _num(e2e, "count") if isinstance(e2e, dict) else None
    parts = ["Latency p50/p99"]
    if window_s is not None:
        parts.append(f"{window_s:g}s")
    if n is not None:
        parts.append(f"{n:,.0f} req")
    return " · ".join(parts)


def latency(eng: EngineState, now: float, width: int, limits: Mapping[str, float]) -> str:
    """TTFT, inter-token latency, end-to-end and queue time: p50 and p99 over the engine's
    sliding window (overall, every priority), and a sparkline of the p99. A percentile read
    from a histogram's first, last or a too-wide bucket shows as its bound (``< 300ms``)."""
    got = _latency_window(eng)
    if got is None:
        return _waiting("no latency data")
    window, _ = got
    spark_w = width - 6 - 9 - 10 - 1
    lines = []
    for label, key, spark in LATENCY_ROWS:
        w = window.get(key)
        w = w if isinstance(w, dict) else {}
        # A histogram's percentile (a vLLM server) may be known only as a bound: shown as one.
        p50 = fmt.bounded_ms(_num(w, "p50"), w.get("p50_bound"))
        p99 = fmt.bounded_ms(_num(w, "p99"), w.get("p99_bound"))
        lines.append(f"{_muted(f'{label:<6}')}{p50:>9} [b]{p99:>9}[/] "
                     f"{_spark(eng.series[spark], now, spark_w, 0)}")
    return "\n".join(lines)


def alerts(active: dict[str, str], items: list[tuple[Alert, int]], now: float,
           width: int) -> str:
    """Active alerts first (`ConsoleState.alerts_active`: the heartbeat, which a late
    subscriber also gets, and the changes since), then one line per alerting figure — its
    latest event, newest first, and how often it flapped."""
    lines = []
    if active:
        parts = [f"[{LEVEL.get(lvl, '')}]● {fmt.escape(name)} {lvl}[/]"
                 for name, lvl in sorted(active.items())]
        lines.append(_muted("active ") + "  ".join(parts))
    for a, n in items:
        age = fmt.duration(now - a.recv_ts) + " ago"
        flaps = f" ×{n} in 1m" if n > 1 else ""
        rest = fmt.clip(f"{a.name}: {a.message}", max(10, width - 13 - len(flaps)))
        lines.append(f"{_muted(f'{age:>10}')} {ALERT_ICON.get(a.level, '●')} "
                     f"{fmt.styled(rest, LEVEL.get(a.level, ''))}{_muted(flaps)}")
    if not lines:
        return _muted("no alerts")
    return "\n".join(lines)
