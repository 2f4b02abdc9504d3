"""The fleet read from Prometheus (``--prometheus URL``) instead of scraping every server:
`PromClient` (the HTTP API's instant query, with a timeout), `read` (every figure of every
engine at one evaluation time: `Reading`) and `PrometheusSource` (a reader thread that reads
every ``interval_s``).

Why a thread: a slow or dead Prometheus must never freeze the screen. Each query has a timeout
(`QUERY_TIMEOUT_S`); a read that fails keeps the last `Reading`, says why in ``problem`` (one
line: refused, timed out, Prometheus's own error), shows it as the console's banner and tries
again with backoff (2, 4, at most `MAX_BACKOFF_S` s); the first read that succeeds clears both.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from vconsole.console.sources.fleet import promql
from vconsole.console.sources.reader import ReaderSource
from vconsole.console.state import ConsoleState

QUERY_TIMEOUT_S = 2.0
INTERVAL_S = 2.0
MAX_BACKOFF_S = 8.0
READONLY = "read from Prometheus: watched only (config changes go to one engine of ours at a " \
           "time: attach to it)"
RowKey = tuple[str, str]          # (instance, engine label or "")


class PromError(RuntimeError):
    """Prometheus could not be read (unreachable, too slow, or it refused the query)."""


class PromClient:
    def __init__(self, url: str, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--prometheus {url!r}: an HTTP URL (http://HOST:9090)")
        self.url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"),
                                            "", ""))
        self.timeout_s = timeout_s

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """An instant query's vector at ``at``: ``[{"metric": {...}, "value": [t, "v"]}]``."""
        params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}",
                                        timeout=self.timeout_s) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as e:
            try:
                answer = json.load(e)
            except ValueError:
                raise PromError(f"{self.url}: HTTP {e.code}") from None
        except TimeoutError:
            raise PromError(f"{self.url}: no answer within {self.timeout_s:g}s") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise PromError(f"{self.url}: no answer within {self.timeout_s:g}s") from None
            raise PromError(f"{self.url}: {getattr(reason, 'strerror', None) or reason}") \
                from None
        except http.client.HTTPException as e:   # BadStatusLine, IncompleteRead: not HTTP
            raise PromError(f"{self.url}: not an HTTP server ({type(e).__name__})") from None
        except (OSError, ValueError) as e:
            raise PromError(f"{self.url}: {type(e).__name__}: {e}") from None
        if answer.get("status") != "success":
            raise PromError(f"{self.url}: {answer.get('errorType')}: {answer.get('error')}")
        return list(answer["data"].get("result", []))


def _value(sample: dict[str, Any]) -> float | None:
    v = float(sample["value"][1])
    return None if math.isnan(v) or math.isinf(v) else v


def _key(sample: dict[str, Any]) -> RowKey:
    m = sample["metric"]
    return str(m.get("instance", "")), str(m.get("engine", ""))


@dataclass
class Reading:
    """Every figure of every engine, as Prometheus had them at ``at`` (its evaluation time)."""
    at: float
    kinds: dict[RowKey, str] = field(default_factory=dict)
    models: dict[RowKey, str] = field(default_factory=dict)
    up: dict[str, float] = field(default_factory=dict)                 # instance -> up
    figures: dict[str, dict[RowKey, float | None]] = field(default_factory=dict)
    # figure -> row -> [(le, cumulative bucket rate)], the rows' histograms over the range
    buckets: dict[str, dict[RowKey, list[tuple[str, float]]]] = field(default_factory=dict)
    fleet: dict[str, float | None] = field(default_factory=dict)       # "ttft_s@0.99" -> s
    fleet_les: dict[str, list[str]] = field(default_factory=dict)      # the bounds merged


def read(client: PromClient, sel: str, at: float | None = None) -> Reading:
    """One read: every query evaluated at the same time ``at`` (one consistent snapshot)."""
    at = time.time() if at is None else at
    out = Reading(at)
    q = client.query
    for s in q(promql.inventory(sel), at):
        key, name = _key(s), s["metric"].get("__name__", "")
        kind = promql.kind_of(name)
        if kind == "vconsole" or key not in out.kinds:
            out.kinds[key] = kind
        if s["metric"].get("model_name"):
            out.models[key] = s["metric"]["model_name"]
    ours = {inst for (inst, _), k in out.kinds.items() if k == "vconsole"}
    for key in out.kinds:            # our engine's ranks (vconsole:engine_up may lack the label)
        if key[0] in ours:
            out.kinds[key] = "vconsole"
    out.kinds = {k: v for k, v in out.kinds.items() if k[1] or not any(
        o[0] == k[0] and o[1] for o in out.kinds)}   # a server-wide series beside its ranks
    out.up = {str(s["metric"].get("instance", "")): _value(s) or 0.0
              for s in q(promql.series("up", sel), at)}
    # A target Prometheus cannot scrape: its series went stale with the failed scrape, so the
    # inventory no longer names it; it is still one of the fleet, down, its kind unknown here
    # ("" : the row keeps the kind it was last seen with).
    known = {inst for inst, _ in out.kinds}
    for inst, up in out.up.items():
        if up < 1.0 and inst not in known:
            out.kinds[(inst, "")] = ""
    exprs = {"running": promql.gauge(promql.RUNNING, sel),
             "waiting": promql.gauge(promql.WAITING, sel),
             "kv_usage": promql.gauge(promql.KV_USAGE, sel, how="avg"),
             "gen_tok_s": f"sum by ({promql.BY}) "
                          f"(rate({promql.any_of(promql.GENERATION, sel)}[{promql.RANGE}]))",
             "preemptions_per_min": promql.per_minute(promql.PREEMPTIONS, sel),
             "prefix_hit": promql.prefix_hit(sel)}
    for figure, expr in exprs.items():
        out.figures[figure] = {_key(s): _value(s) for s in q(expr, at)}
    for figure, quant in promql.QUANTILES:
        name = f"{figure}@{quant:g}"
        out.figures[name] = {_key(s): _value(s)
                             for s in q(promql.row_quantile(quant, figure, sel), at)}
    for figure in promql.HISTOGRAMS:
        rows: dict[RowKey, list[tuple[str, float]]] = {}
        for s in q(promql.buckets(figure, sel), at):
            rows.setdefault(_key(s), []).append((s["metric"].get("le", "+Inf"),
                                                 _value(s) or 0.0))
        out.buckets[figure] = {k: sorted(v, key=lambda b: _le(b[0])) for k, v in rows.items()}
        layouts = {tuple(le for le, _ in v) for v in rows.values()}
        les = sorted(set.intersection(*(set(x) for x in layouts)), key=_le) \
            if len(layouts) > 1 else []
        out.fleet_les[figure] = les
    for figure, quant in promql.QUANTILES:
        got = q(promql.fleet_quantile(quant, figure, sel, out.fleet_les[figure] or None), at)
        out.fleet[f"{figure}@{quant:g}"] = _value(got[0]) if got else None
    return out


def _le(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf") else float(text)


class PrometheusSource(ReaderSource):
    """See the module docstring. ``reading``: the last good `Reading` (None: none yet);
    ``received``: when it came; ``problem`` / ``failing_since``: why and since when the reads
    fail (None once one succeeds)."""

    kind = "prometheus"
    readonly_reason = READONLY

    def __init__(self, url: str, selector: str | None = None, *, interval_s: float = INTERVAL_S,
                 timeout_s: float = QUERY_TIMEOUT_S) -> None:
        super().__init__()
        self.client = PromClient(url, timeout_s)
        self.selector = selector or ""
        self.sel = promql.matchers(selector)
        self.interval_s = interval_s
        self.reading: Reading | None = None
        self.received: float | None = None
        self.problem: str | None = None
        self.failing_since: float | None = None
        self.failures = 0
        self.reads = 0
        self._banner: str | None = None

    @property
    def url(self) -> str:
        return self.client.url

    def describe(self) -> str:
        return f"prometheus {self.url}" + (f" {self.selector}" if self.selector else "")

    def read_once(self, state: ConsoleState | None = None) -> bool:
        """One read; False (``problem`` set, and the banner in ``state``) when it failed."""
        now = self.now()
        try:
            reading = read(self.client, self.sel, now)
        except Exception as e:  # PromError, or an answer no reader expected: one line, go on
            self.problem = str(e) if isinstance(e, PromError) else \
                f"{self.url}: {type(e).__name__}: {e}"
            self.failures += 1
            self.failing_since = self.failing_since or now
            if state is not None:
                self._banner = banner(self.url, self.problem, now - self.failing_since,
                                      self.received, now)
                state.note_error(self._banner)
            return False
        self.reading, self.received, self.reads = reading, now, self.reads + 1
        self.problem, self.failing_since, self.failures = None, None, 0
        if state is not None and self._banner is not None:
            with state.lock:
                if state.last_error == self._banner:
                    state.last_error = None
                    state.generation += 1
            self._banner = None
        return True

    def backoff_s(self) -> float:
        if not self.failures:
            return self.interval_s
        return min(MAX_BACKOFF_S, self.interval_s * 2.0 ** (self.failures - 1))

    def _run(self, state: ConsoleState) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.read_once(state)
            if self.on_data is not None:
                self.on_data()
            self._stop.wait(max(0.05, self.backoff_s() - (time.monotonic() - t0)))


def banner(url: str, problem: str, for_s: float, received: float | None, now: float) -> str:
    """The console's one line while Prometheus cannot be read."""
    last = "no figures yet" if received is None else \
        f"the rows are {int(now - received)}s old"
    return (f"PROMETHEUS UNREACHABLE — {problem} (for {int(for_s)}s); {last}; "
            f"retrying by itself.").replace(f"{url}: ", f"{url} ")
