"""One `Source` per fleet target, each with its own thread, so one slow or dead target never
holds up another's refresh.

- `ScrapeSource`: an HTTP kind (vLLM, SGLang, llama.cpp): its kind's scraper every
  ``interval_s``; after a failure it retries with backoff (1, 2, 4 s, at most `MAX_BACKOFF_S`)
  and says why in ``problem``, one line: refused, timed out, HTTP 503 while llama.cpp loads
  (``starting``), or **another kind answered** (``/metrics`` with ``sglang:*`` names where
  ``vllm:*`` was said). Each scrape has a timeout (`SCRAPE_TIMEOUT_S`), and nothing waits on
  it but this target's thread.
- our engine: `vconsole.console.sources.stream.ZmqSource` on the target's telemetry endpoint.

Every target's messages are kept under the target's name (``engine_as``), so two engines that
both call themselves ``engine-0`` are two rows.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from vconsole.console.sources.fleet.detect import kind_of_metrics
from vconsole.console.sources.fleet.targets import CONTROL_OFFSET, TELEMETRY_OFFSET, Target
from vconsole.console.sources.reader import ReaderSource
from vconsole.console.sources.stream import ZmqSource
from vconsole.console.sources.vllm import READONLY_REASON as VLLM_READONLY
from vconsole.console.sources.vllm import ScrapeError, VllmScraper
from vconsole.console.state import ConsoleState

if TYPE_CHECKING:
    from vconsole.console.sources.kv_events import KVEventFeed
    from vconsole.console.sources.source import Source

SCRAPE_TIMEOUT_S = 2.0
MAX_BACKOFF_S = 4.0
READONLY = {
    "vllm": VLLM_READONLY,
    "sglang": "an SGLang server: watched only (config changes go only to vconsole engines)",
    "llama-cpp": "a llama.cpp server: watched only (config changes go only to vconsole "
                 "engines)",
}
NAMES = {"vllm": "vllm:*", "sglang": "sglang:*", "llama-cpp": "llamacpp:*"}


class Scraper(Protocol):
    url: str
    root: str

    def fetch(self) -> str: ...

    def scrape(self, now: float | None = None) -> list[list[Any]]: ...


def scraper_for(target: Target, interval_s: float) -> VllmScraper:
    """The scraper of the target's kind."""
    if target.kind == "sglang":
        from vconsole.console.sources.sglang import SglangTranslator

        s = VllmScraper(target.url, interval_s=interval_s, timeout_s=SCRAPE_TIMEOUT_S)
        s.translator = SglangTranslator(target.name, interval_s=interval_s)
        return s
    if target.kind == "llama-cpp":
        from vconsole.console.sources.llama_cpp import LlamaCppScraper

        return LlamaCppScraper(target.url, interval_s=interval_s, timeout_s=SCRAPE_TIMEOUT_S)
    return VllmScraper(target.url, interval_s=interval_s, timeout_s=SCRAPE_TIMEOUT_S)


class ScrapeSource(ReaderSource):
    """See the module docstring. ``last_ok``: when a scrape last succeeded (None: never);
    ``problem``: why the last one failed (None after a success)."""

    def __init__(self, target: Target, *, interval_s: float = 1.0) -> None:
        super().__init__()
        self.target = target
        self.kind = target.kind
        self.readonly_reason = READONLY.get(target.kind, "watched only")
        self.scraper = scraper_for(target, interval_s)
        self.scraper.translator.name = target.name
        self.engine_as = target.name
        self.interval_s = interval_s
        self.last_ok: float | None = None
        self.first_try: float | None = None
        self.problem: str | None = None
        self.failures = 0          # in a row
        self.feed: KVEventFeed | None = None   # the target's KV events (``kv_events``)
        self.kv_events_problem: str | None = None

    @property
    def starting(self) -> bool:
        return bool(getattr(self.scraper, "starting", False))

    def describe(self) -> str:
        return f"{self.target.kind} {self.scraper.url}"

    def scrape_once(self, state: ConsoleState) -> bool:
        """One scrape folded into ``state``; False (and ``problem`` set) when it failed."""
        now = self.now()
        if self.first_try is None:
            self.first_try = now
        try:
            batch = self.scraper.scrape(now)
            if not batch:
                raise ScrapeError(self._wrong_kind())
        except ScrapeError as e:
            self.problem = str(e)
            self.failures += 1
            return False
        except Exception as e:  # a reply no reader expected: one line, and the reads go on
            self.problem = f"{self.scraper.url}: {type(e).__name__}: {e}"
            self.failures += 1
            return False
        self.problem, self.failures, self.last_ok = None, 0, now
        if self.target.kv_events and self.feed is None and self.kv_events_problem is None \
                and self.kind in ("vllm", "sglang"):
            self._follow_kv_events(batch)
        for frames in batch:
            self._tee(now, frames)
        self._ingest_batch(state, [(now, frames) for frames in batch])
        return True

    def _follow_kv_events(self, batch: list[Any]) -> None:
        """Once the first read named the ranks: their KV events (vLLM's format; SGLang's is the
        same without ``medium``), into the ``kv`` messages' ``prefix_cache``. An endpoint it
        cannot use is said once, as the target's problem, and not tried again."""
        from vconsole.console.sources.kv_events import KVEventFeed
        from vconsole.telemetry.schema import decode

        ranks = sorted({decode(f).rank for f in batch})
        try:
            self.feed = KVEventFeed(self.target.kv_events or "", ranks).start()
        except (ValueError, OSError) as e:
            self.kv_events_problem = f"KV events not followed: {e}"
            return
        self.scraper.translator.prefix_cache = self.feed.summary

    def stop(self, timeout: float = 2.0) -> None:
        super().stop(timeout)
        if self.feed is not None:
            self.feed.stop()

    def _wrong_kind(self) -> str:
        """The one line for a ``/metrics`` without this kind's names: what it looks like."""
        try:
            seen = kind_of_metrics(self.scraper.fetch())
        except ScrapeError as e:
            return str(e)
        said = f"said {self.target.kind}, but {self.scraper.url} has no {NAMES[self.kind]} series"
        return f"{said}: it looks like {seen}" if seen else said

    def backoff_s(self) -> float:
        return self.interval_s if not self.failures else min(MAX_BACKOFF_S,
                                                            2.0 ** (self.failures - 1))

    def _run(self, state: ConsoleState) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.scrape_once(state)
            except Exception as e:  # KV events, the recording, folding in: one line, go on
                self.problem = f"{self.scraper.url}: {type(e).__name__}: {e}"
                self.failures += 1
            wait = self.backoff_s() - (time.monotonic() - t0) if not self.failures \
                else self.backoff_s()
            self._stop.wait(max(0.05, wait))


class EngineSource(ZmqSource):
    """Our engine in a fleet: its telemetry endpoint, kept under the target's name. Its
    ``model`` is asked once of its control socket (telemetry announces the config only every
    ``config_interval_s``), in a thread of its own, again every few seconds until it answers."""

    def __init__(self, target: Target) -> None:
        curve = None
        if target.curve:
            from vconsole.security.curve import load_client_curve

            curve = load_client_curve(target.curve.get("server_public"),
                                      target.curve.get("client_key"))
        super().__init__([target.endpoint(TELEMETRY_OFFSET)], curve=curve)
        self.target = target
        self.model: str | None = None
        self.engine_as = target.name
        self.problem: str | None = None
        self.starting = False

    def describe(self) -> str:
        return f"vconsole {self.target.url}"

    def start(self, state: ConsoleState) -> None:
        super().start(state)
        threading.Thread(target=self._ask_model, name=f"fleet-model-{self.target.name}",
                         daemon=True).start()

    def _ask_model(self) -> None:
        import zmq

        from vconsole.wire.control import ControlError
        from vconsole.wire.control_client import ControlClient

        while self.model is None and not self._stop.is_set():
            try:
                with ControlClient(self.target.endpoint(CONTROL_OFFSET), timeout_s=2.0,
                                   curve=self.curve) as client:
                    model = client.get_config()["values"].get("model")
                self.model = str(model) if model is not None else ""
            except (TimeoutError, ControlError, zmq.ZMQError, KeyError, TypeError):
                self._stop.wait(5.0)


def source_for(target: Target, *, interval_s: float = 1.0) -> ScrapeSource | EngineSource:
    """The source that reads ``target`` (its kind already known: `detect.resolve`)."""
    if target.kind == "vconsole":
        return EngineSource(target)
    return ScrapeSource(target, interval_s=interval_s)


if TYPE_CHECKING:
    _a: type[Source] = ScrapeSource
    _b: type[Source] = EngineSource
