"""Plain formatting: numbers, durations, bytes, bars, sparklines and threshold levels.

Pure functions of their arguments (no widgets, no clock), so every screen formats the same way
and the tests can pin the exact strings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vconsole.telemetry.printable import printable

SPARK = "▁▂▃▄▅▆▇█"
BAR_FULL = "█"
BAR_EMPTY = "░"

# Levels map to theme colours in the markup helpers below.
OK, WARN, CRIT, MUTED = "ok", "warning", "critical", "muted"
LEVEL_STYLE = {OK: "$success", WARN: "$warning", CRIT: "$error", MUTED: "$text-muted", "": ""}


def level(value: float | None, warn: float, crit: float | None = None) -> str:
    """``warning`` at or above ``warn``, ``critical`` at or above ``crit``, else ``""``."""
    if value is None:
        return ""
    if crit is not None and value >= crit:
        return CRIT
    return WARN if value >= warn else ""


def styled(text: str, lvl: str) -> str:
    """Content markup colouring ``text`` by level (text is escaped)."""
    style = LEVEL_STYLE.get(lvl, lvl)
    text = escape(text)
    return f"[{style}]{text}[/]" if style else text


def escape(text: str) -> str:
    """Markup-safe and terminal-safe: ``[`` escaped for Content markup, and control characters
    (ESC, NUL, form feeds … from generated text, ids or names) written as visible escapes
    (`vconsole.telemetry.printable`); line breaks stay."""
    return printable(text, keep_newlines=True).replace("[", "\\[")


def num(value: float | None, digits: int = 1) -> str:
    """1,234 / 12.3 / 0.12 — thousands separators, no more precision than the value has."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 100:
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def count(value: float | None) -> str:
    return "–" if value is None else f"{int(value):,}"


def pct(frac: float | None, digits: int = 1) -> str:
    if frac is None or not math.isfinite(frac):
        return "–"
    return f"{frac * 100:.{digits}f}%"


def duration(seconds: float | None) -> str:
    """Compact human durations: 850ms, 12.3s, 4m05s, 2h03m, 3d04h."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    s = max(0.0, seconds)
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def ms(seconds: float | None) -> str:
    """Step-scale times: 0.42ms, 12.3ms, 1.20s."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds >= 1:
        return f"{seconds:.2f}s"
    v = seconds * 1000
    return f"{v:.2f}ms" if v < 10 else f"{v:.1f}ms"


def _edge(seconds: float, unit: str | None = None) -> tuple[str, str]:
    """A histogram bucket's edge as (number, unit): ``(300, ms)``, ``(2.5, s)``."""
    unit = unit or ("ms" if seconds < 1 else "s")
    v = seconds * 1000 if unit == "ms" else seconds
    return f"{v:.3g}", unit


def bounded_ms(value: float | None, bound: object = None) -> str:
    """A latency percentile as `ms` does, or, when it is known only as a bound (a histogram's
    ``pNN_bound`` ``{"lo", "hi"}``), as the bound: ``< 300ms``, ``> 10s``, ``100–250ms``,
    ``500ms–1s`` — never an interpolated number that would read as measured."""
    if not isinstance(bound, dict):
        return ms(value)
    lo, hi = bound.get("lo"), bound.get("hi")
    if not isinstance(hi, int | float):
        if not isinstance(lo, int | float):
            return ms(value)
        return "> " + "".join(_edge(float(lo)))
    if not isinstance(lo, int | float) or lo <= 0:
        return "< " + "".join(_edge(float(hi)))
    hi_n, hi_u = _edge(float(hi))
    lo_n, lo_u = _edge(float(lo))
    if lo_u == hi_u:
        return f"{lo_n}–{hi_n}{hi_u}"
    return f"{lo_n}{lo_u}–{hi_n}{hi_u}"


def nbytes(n: float | None) -> str:
    if n is None:
        return "–"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f}{unit}" if unit == "B" else f"{v:.1f}{unit}"
        v /= 1024
    return f"{v:.1f}TiB"


def bar(frac: float | None, width: int) -> str:
    """A horizontal bar of ``width`` cells, filled to ``frac`` (0..1)."""
    if width <= 0:
        return ""
    f = 0.0 if frac is None or not math.isfinite(frac) else min(1.0, max(0.0, frac))
    full = round(f * width)
    return BAR_FULL * full + BAR_EMPTY * (width - full)


def sparkline(values: Sequence[float | None], lo: float | None = 0.0,
              hi: float | None = None) -> str:
    """One cell per value; None is a blank. The scale is ``lo..hi`` (defaults: 0 and the max
    seen), so a flat series sits on the floor instead of jumping to the top."""
    real = [v for v in values if v is not None]
    if not real:
        return " " * len(values)
    low = min(real) if lo is None else lo
    high = max(real) if hi is None else hi
    span = high - low
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif span <= 0:
            out.append(SPARK[0])
        else:
            i = int((min(max(v, low), high) - low) / span * (len(SPARK) - 1) + 0.5)
            out.append(SPARK[i])
    return "".join(out)


def clip(text: str, width: int) -> str:
    """One line of at most ``width`` cells, cut with an ellipsis (our texts are single-width);
    control characters, line breaks included, become visible escapes first."""
    if width <= 0:
        return ""
    text = printable(text)
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def clip_middle(text: str, width: int) -> str:
    """As `clip`, cut in the middle: names that differ at their end (``host:port`` of two ranks,
    ``…/engine=1``) stay told apart."""
    if width <= 0:
        return ""
    text = printable(text)
    if len(text) <= width:
        return text
    tail = (width - 1) // 2
    return text[: width - 1 - tail] + "…" + (text[-tail:] if tail else "")


def visible_len(markup: str) -> int:
    """Cells that Content markup takes on screen."""
    from textual.content import Content

    return Content.from_markup(markup).cell_length


def fit(parts: list[str], width: int, sep: str = " · ") -> str:
    """Join markup ``parts`` in order, dropping the ones from the end that do not fit, so
    optional details disappear at narrow widths instead of wrapping or being cut mid-word."""
    out: list[str] = []
    used = 0
    for part in parts:
        n = visible_len(part) + (len(sep) if out else 0)
        if out and used + n > width:
            break
        out.append(part)
        used += n
    return sep.join(out)


def nbytes_pair(used: float | None, total: float | None) -> str:
    """``116.8/141.0GiB``: two sizes in the unit of the larger."""
    if used is None or total is None:
        return f"{nbytes(used)}/{nbytes(total)}"
    v, t = float(used), float(total)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if t < 1024 or unit == "TiB":
            return f"{v:.0f}/{t:.0f}{unit}" if unit == "B" else f"{v:.1f}/{t:.1f}{unit}"
        v /= 1024
        t /= 1024
    return f"{v:.1f}/{t:.1f}TiB"


def source_name(source: object) -> str:
    """How a payload's ``source`` (who produced the figures) is named on screen."""
    return {"vllm": "vLLM", "local": "this machine"}.get(str(source), str(source))
