"""A real Prometheus for tests: Debian's ``prometheus`` binary with a generated config, on a free
loopback port, its TSDB in the test's folder; and ``promtool``. Without them the test is skipped,
saying what to install (`make install-test` installs them when it may).

`Prometheus.query` is the HTTP API's instant query (``/api/v1/query``); a query that Prometheus
refuses raises `PromQLError` with its message.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from support.serve_process import free_port

INSTALL = "apt-get install prometheus (or `make install-test` as root)"
DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "vconsole.json"
# Grafana's interval variables, as a dashboard would resolve them, for parsing and querying.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def require(*tools: str) -> dict[str, str]:
    """The path of each tool (``prometheus``, ``promtool``), or skip the test saying why."""
    found = {t: shutil.which(t) for t in tools}
    missing = [t for t, p in found.items() if p is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: {INSTALL}")
    return {t: p for t, p in found.items() if p is not None}


def dashboard_panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in model["panels"]:
        out.append(p)
        out.extend(p.get("panels", ()))
    return out


def dashboard_queries(model: dict[str, Any], **variables: str) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every target, Grafana's variables replaced: the interval
    ones by `GRAFANA_VARS`, the dashboard's own by ``variables`` (default ``.*``, "All")."""
    own = {v["name"]: variables.get(v["name"], ".*") for v in model["templating"]["list"]
           if v["type"] == "query"}
    out = []
    for panel in dashboard_panels(model):
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for name, value in {**GRAFANA_VARS, **{f"${k}": v for k, v in own.items()}}.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


class PromQLError(RuntimeError):
    """Prometheus answered a query with an error (bad PromQL, a timeout)."""


class Prometheus:
    """``prometheus`` scraping ``targets`` (``host:port``, path ``/metrics``) every
    ``scrape_interval`` under job ``job``; `start` returns once it is ready."""

    def __init__(self, folder: Path, targets: Sequence[str], *, job: str = "vconsole",
                 scrape_interval: str = "1s", rule_files: Sequence[Path] = ()) -> None:
        self.folder = folder
        self.targets = list(targets)
        self.job = job
        self.scrape_interval = scrape_interval
        self.rule_files = list(rule_files)
        self.port = free_port()
        self.log = folder / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> str:
        """The generated prometheus.yml (JSON is YAML)."""
        return json.dumps({
            "global": {"scrape_interval": self.scrape_interval,
                       "evaluation_interval": self.scrape_interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": self.job, "metrics_path": "/metrics",
                                "static_configs": [{"targets": self.targets}]}],
        }, indent=2)

    def start(self, timeout_s: float = 60) -> Prometheus:
        binary = require("prometheus")["prometheus"]
        cfg = self.folder / "prometheus.yml"
        cfg.write_text(self.config())
        with open(self.log, "wb") as out:
            self._proc = subprocess.Popen(
                [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        self.wait_until(self._ready, "prometheus never became ready", timeout_s)
        return self

    def _ready(self) -> bool:
        assert self._proc is not None and self._proc.poll() is None, self.log_tail()
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.HTTPError):
            return False

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise PromQLError(f"{params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result: ``[{"metric": {labels}, "value": [t, "v"]}, ...]``."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def values(self, expr: str, at: float | None = None, by: str = "engine"
               ) -> dict[str, float]:
        """``{label value: sample}`` of an instant query, keyed by the label ``by``."""
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in self.query(expr, at)}

    def wait_until(self, cond: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"{what}; prometheus log:\n{self.log_tail()}"
            time.sleep(0.2)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
