"""The engines a fleet console watches: `Target`, from ``--target KIND=URL``, a ``--fleet`` TOML
file or ``--discover HOST:PORT-PORT`` (`vconsole.console.sources.fleet.detect` probes those).

A fleet file (vllmstat's habit)::

    [[engine]]
    name = "big-0"              # optional: the URL's host:port
    kind = "vllm"               # optional: detected ("auto")
    url = "http://10.0.0.5:8000"
    kv_events = "tcp://10.0.0.5:5557"   # optional, vLLM / SGLang
    labels = { pool = "a100", zone = "eu" }
    control_key_file = "/path/control.key"   # optional, ours: for `vconsole set --fleet`
    [engine.curve]              # optional, our engine with CURVE keys
    server_public = "/path/engine.key"
    client_key = "/path/console.key_secret"

A ``vconsole`` target's URL is its base endpoint ``tcp://HOST:PORT``: input on PORT, output
+1, telemetry +2, control +3 (as ``--base-port``).
"""

from __future__ import annotations

import tomllib
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

KINDS = ("vconsole", "vllm", "sglang", "llama-cpp")
KIND_CHOICES = (*KINDS, "auto")
TELEMETRY_OFFSET, CONTROL_OFFSET = 2, 3


class TargetError(ValueError):
    """A target, fleet file or discovery range that cannot be used; the message says why."""


@dataclass(frozen=True)
class Target:
    name: str
    kind: str                 # one of KINDS, or "auto" until detected
    url: str
    kv_events: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    curve: dict[str, str] = field(default_factory=dict)   # server_public, client_key (files)
    control_key_file: str | None = None   # ours: where its control key is (default: derived)

    @property
    def readonly(self) -> bool:
        """Only our engines take config changes; every other kind is watched only."""
        return self.kind != "vconsole"

    def endpoint(self, offset: int) -> str:
        """A vconsole target's socket ``offset`` ports above its base (`TELEMETRY_OFFSET`)."""
        host, port = split_hostport(self.url)
        return f"tcp://{host}:{port + offset}"


def split_hostport(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url if "://" in url else f"tcp://{url}")
    if not parts.hostname or parts.port is None:
        raise TargetError(f"{url!r}: needs HOST:PORT")
    return parts.hostname, parts.port


def default_name(url: str) -> str:
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    return parts.netloc or url


def normal_url(kind: str, url: str) -> str:
    """``host:port`` → ``tcp://host:port`` for ours, ``http://host:port`` for the others."""
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if kind == "vconsole" and scheme != "tcp":
            raise TargetError(f"vconsole={url}: our engine's URL is tcp://HOST:BASE_PORT")
        if kind in ("vllm", "sglang", "llama-cpp") and scheme not in ("http", "https"):
            raise TargetError(f"{kind}={url}: an HTTP URL (http://HOST:PORT)")
        return url
    return f"{'tcp' if kind == 'vconsole' else 'http'}://{url}"


def make_target(kind: str, url: str, *, name: str | None = None, kv_events: str | None = None,
                labels: dict[str, Any] | None = None, curve: dict[str, Any] | None = None,
                control_key_file: str | None = None) -> Target:
    kind = kind.strip().lower()
    if kind not in KIND_CHOICES:
        raise TargetError(f"unknown kind {kind!r}: one of {', '.join(KIND_CHOICES)}")
    if not url.strip():
        raise TargetError(f"{kind}=: no URL")
    url = normal_url(kind, url.strip())
    if kind == "vconsole":
        split_hostport(url)
    if kv_events:
        from vconsole.telemetry.kv_wire import offset_endpoint

        try:
            offset_endpoint(kv_events, 1)       # rank r's events are on port + r: it needs one
        except ValueError as e:
            raise TargetError(f"kv_events {kv_events!r}: {e}") from None
    return Target(name or default_name(url), kind, url, kv_events,
                  {str(k): str(v) for k, v in (labels or {}).items()},
                  {str(k): str(v) for k, v in (curve or {}).items()}, control_key_file)


def parse_target(text: str) -> Target:
    """``--target KIND=URL`` (``vllm=http://h:8000``; a bare URL is ``auto``)."""
    kind, sep, url = text.partition("=")
    if not sep:
        return make_target("auto", text)
    return make_target(kind, url)


def load_fleet(path: str | Path) -> list[Target]:
    """The ``[[engine]]`` tables of a fleet file (see the module docstring)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise TargetError(f"--fleet {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"--fleet {path}: not TOML: {e}") from None
    engines = data.get("engine")
    if not isinstance(engines, list) or not engines:
        raise TargetError(f"--fleet {path}: no [[engine]] tables")
    out: list[Target] = []
    for i, entry in enumerate(engines, 1):
        where = f"--fleet {path}: engine {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise TargetError(f"{where}: needs url = \"...\"")
        unknown = set(entry) - {"name", "kind", "url", "kv_events", "labels", "curve",
                                "control_key_file"}
        if unknown:
            raise TargetError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        labels, curve = entry.get("labels") or {}, entry.get("curve") or {}
        if not isinstance(labels, dict) or not isinstance(curve, dict):
            raise TargetError(f"{where}: labels and curve are tables")
        try:
            out.append(make_target(str(entry.get("kind") or "auto"), entry["url"],
                                   name=entry.get("name"), kv_events=entry.get("kv_events"),
                                   labels=labels, curve=curve,
                                   control_key_file=entry.get("control_key_file")))
        except TargetError as err:
            raise TargetError(f"{where}: {err}") from None
    return out


def parse_range(text: str) -> tuple[str, list[int]]:
    """``HOST:PORT-PORT`` (or ``HOST:PORT``) → (host, ports); at most 1024 ports."""
    host, sep, ports = text.rpartition(":")
    if not sep or not host:
        raise TargetError(f"--discover {text}: HOST:PORT-PORT")
    lo, _, hi = ports.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise TargetError(f"--discover {text}: ports are numbers (8000-8015)") from None
    if not 0 < a <= b < 65536 or b - a >= 1024:
        raise TargetError(f"--discover {text}: a range of 1-1024 ports within 1-65535")
    return host.strip("[]"), list(range(a, b + 1))


def unique_names(targets: list[Target]) -> list[Target]:
    """Targets with distinct names (a repeated one gets ``#2``, ``#3``...): the name keys its
    rows."""
    seen: dict[str, int] = {}
    out = []
    for t in targets:
        n = seen.get(t.name, 0) + 1
        seen[t.name] = n
        out.append(t if n == 1 else replace(t, name=f"{t.name}#{n}"))
    return out
