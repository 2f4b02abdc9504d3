"""Watching a vLLM server: its ``/metrics`` scraped about once a second, as telemetry messages.

`VllmScraper.scrape` fetches the text and hands it to `VllmTranslator`; `VllmSource` is the
console's `vconsole.console.sources.source.Source` around it (a reader thread,
`vconsole.console.sources.reader.ReaderSource`, as `ZmqSource`): every scrape's messages go through
`ConsoleState.ingest` exactly as our own engine's would, and into a recording when one runs. A
scrape that fails (connection refused, timeout, an HTTP error, text that is not Prometheus's)
ingests nothing: the heartbeat goes stale and the console shows the engine down, as for ours,
and the reason is shown as the console's recent error.

Read-only by nature: vLLM has no runtime config API, so the console's config changes are refused
with that reason (`READONLY_REASON`).
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

from vconsole.console.sources.kv_events import KVEventFeed
from vconsole.console.sources.reader import ReaderSource
from vconsole.console.sources.source import SourceAction
from vconsole.console.sources.vllm_actions import probe as probe_actions
from vconsole.console.sources.vllm_actions import run_action
from vconsole.console.sources.vllm_metrics import WINDOW_S, VllmTranslator
from vconsole.console.state import ConsoleState
from vconsole.telemetry.schema import decode

if TYPE_CHECKING:
    from vconsole.console.sources.source import Source

SCRAPE_INTERVAL_S = 1.0
SCRAPE_TIMEOUT_S = 5.0
READONLY_REASON = "a vLLM server: vLLM has no runtime config API"


class ScrapeError(RuntimeError):
    """One scrape failed; the message says how."""


def metrics_url(url: str) -> str:
    """``http://host:8000`` or ``host:8000`` → ``http://host:8000/metrics`` (a path is kept)."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class VllmScraper:
    def __init__(self, url: str, *, interval_s: float = SCRAPE_INTERVAL_S,
                 timeout_s: float = SCRAPE_TIMEOUT_S, window_s: float = WINDOW_S) -> None:
        self.url = metrics_url(url)
        self.timeout_s = timeout_s
        parts = urllib.parse.urlsplit(self.url)
        self.root = f"{parts.scheme}://{parts.netloc}"     # where vLLM's action routes are
        netloc = parts.netloc
        self.translator = VllmTranslator(f"vllm@{netloc}", interval_s=interval_s,
                                         window_s=window_s)
        self.scrapes = 0
        self.failures = 0

    def fetch(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:  # noqa: S310
                return resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            raise ScrapeError(f"{self.url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ScrapeError(f"{self.url}: {reason}") from None
        except http.client.HTTPException as e:   # something that is not HTTP answered
            raise ScrapeError(f"{self.url}: not an HTTP server ({type(e).__name__})") from None

    def scrape(self, now: float | None = None) -> list[list[Any]]:
        """One scrape's messages (encoded frames); `ScrapeError` when it failed."""
        try:
            text = self.fetch()
            try:
                frames = self.translator.translate(text, now)
            except ValueError as e:
                raise ScrapeError(f"{self.url}: not Prometheus text ({e})") from None
        except ScrapeError:
            self.failures += 1
            raise
        self.scrapes += 1
        return frames


def is_local(url: str) -> bool:
    """The server's host is this machine (loopback): its GPUs are the ones NVML sees here."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class VllmSource(ReaderSource):
    """See the module docstring. With the server on this machine (a loopback URL, as over an
    SSH tunnel it is not: the tunnel's far end is another box) the GPU panel gets this
    machine's NVML reading (`GpuProbe`), which vLLM's metrics do not carry."""

    kind = "vllm"
    readonly_reason = READONLY_REASON

    def __init__(self, url: str, *, interval_s: float = SCRAPE_INTERVAL_S,
                 local_gpu: bool | None = None, kv_events: str | None = None,
                 kv_events_replay: str | None = None) -> None:
        super().__init__()
        self.scraper = VllmScraper(url, interval_s=interval_s)
        self.interval_s = interval_s
        self.local_gpu = is_local(self.scraper.url) if local_gpu is None else local_gpu
        self.kv_events = kv_events
        self.kv_events_replay = kv_events_replay
        self.feed: KVEventFeed | None = None
        self.actions: tuple[SourceAction, ...] = ()   # the routes it answers (`vllm_actions`)

    def _follow_kv_events(self, batch: list[Any]) -> None:
        """Once the first scrape named the ranks: subscribe to each one's KV events."""
        ranks = sorted({decode(f).rank for f in batch})
        self.feed = KVEventFeed(self.kv_events or "", ranks,
                                replay_endpoint=self.kv_events_replay).start()
        self.scraper.translator.prefix_cache = self.feed.summary

    def run_action(self, key: str) -> str:
        """POST one of the server's action routes (`vllm_actions.run_action`); blocking."""
        return run_action(self.scraper.root, key)

    def stop(self, timeout: float = 2.0) -> None:
        super().stop(timeout)
        if self.feed is not None:
            self.feed.stop()

    def describe(self) -> str:
        return self.scraper.url

    def _run(self, state: ConsoleState) -> None:
        gpu = None
        if self.local_gpu:
            from vconsole.telemetry.gpu import GpuProbe

            gpu = GpuProbe()     # no NVIDIA driver: an "unavailable" reading, shown as such
        self.actions = probe_actions(self.scraper.root)
        while not self._stop.is_set():
            now = self.now()
            try:
                batch: list[Any] = self.scraper.scrape(now)
            except ScrapeError as e:
                state.note_error(f"scrape failed: {e}")
                batch = []
            if batch and self.kv_events and self.feed is None:
                try:
                    self._follow_kv_events(batch)
                except (ValueError, OSError) as e:   # an endpoint it cannot use: say so
                    state.note_error(f"KV events not followed: {e}")
                    self.kv_events = None
            if batch and gpu is not None:
                batch += self.scraper.translator.local("gpu", gpu.read(), now)
            if batch:
                for frames in batch:
                    self._tee(now, frames)
                self._ingest_batch(state, [(now, frames) for frames in batch])
            self._stop.wait(self.interval_s)


if TYPE_CHECKING:   # the type checker verifies it is a whole Source
    _source: type[Source] = VllmSource
