"""What kind of engine answers at an address: ``--target auto=URL`` and ``--discover``.

An HTTP ``/metrics`` says its kind by its names (`kind_of_metrics`: ``vllm:*``, ``sglang:*``,
``llamacpp:*``); our engine's telemetry socket by a message that decodes (a SUB socket hears
its heartbeat within a second). A port that answers neither is skipped, with the reason.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from vconsole.console.sources.fleet.targets import (
    TELEMETRY_OFFSET,
    Target,
    TargetError,
    make_target,
)

PREFIXES = (("vllm:", "vllm"), ("sglang:", "sglang"), ("llamacpp:", "llama-cpp"))


def kind_of_metrics(text: str) -> str | None:
    """The kind whose names fill a ``/metrics`` text (the most series wins), else None."""
    counts = {kind: 0 for _, kind in PREFIXES}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for prefix, kind in PREFIXES:
            if line.startswith(prefix):
                counts[kind] += 1
    kind, n = max(counts.items(), key=lambda kv: kv[1])
    return kind if n else None


def http_kind(base: str, timeout_s: float) -> str:
    """The kind of the HTTP server at ``base``; TargetError saying what answered instead."""
    url = base.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310
            text = resp.read(4_000_000).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise TargetError(f"{url}: HTTP {e.code} (llama-server needs --metrics, SGLang "
                          "--enable-metrics)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TargetError(f"{url}: {getattr(e, 'reason', e)}") from None
    except http.client.HTTPException as e:
        raise TargetError(f"{url}: not an HTTP server ({type(e).__name__})") from None
    kind = kind_of_metrics(text)
    if kind is None:
        raise TargetError(f"{url}: answers, but with no vllm:, sglang: or llamacpp: series")
    return kind


def telemetry_heard(endpoint: str, timeout_s: float) -> bool:
    """Our engine's telemetry PUB is at ``endpoint``: a message that decodes within the time."""
    import zmq

    from vconsole.telemetry.schema import SchemaError, decode

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.subscribe(b"")
        sock.connect(endpoint)
        if not sock.poll(int(timeout_s * 1000)):
            return False
        try:
            decode(sock.recv_multipart(zmq.NOBLOCK))
        except (SchemaError, zmq.Again):
            return False
        return True
    finally:
        sock.close(0)


def resolve(target: Target, timeout_s: float = 2.0) -> Target:
    """``target`` with its kind detected when it is ``auto``; TargetError when nothing known
    answers."""
    if target.kind != "auto":
        return target
    if target.url.startswith("tcp://"):
        probe = make_target("vconsole", target.url)
        if telemetry_heard(probe.endpoint(TELEMETRY_OFFSET), timeout_s):
            return _with_kind(target, "vconsole")
        raise TargetError(f"{target.url}: no engine telemetry on base + {TELEMETRY_OFFSET}")
    return _with_kind(target, http_kind(target.url, timeout_s))


def _with_kind(t: Target, kind: str) -> Target:
    return replace(t, kind=kind)


def probe_port(host: str, port: int, timeout_s: float = 1.5) -> Target | str:
    """The target a port is (our engine's telemetry port gives its base, ``port - 2``), or
    why it was skipped."""
    try:
        kind = http_kind(f"http://{host}:{port}", timeout_s)
        return make_target(kind, f"http://{host}:{port}")
    except TargetError as e:
        why = str(e)
    if port > TELEMETRY_OFFSET and telemetry_heard(f"tcp://{host}:{port}", timeout_s):
        return make_target("vconsole", f"tcp://{host}:{port - TELEMETRY_OFFSET}")
    return why


def discover(host: str, ports: list[int], timeout_s: float = 1.5
             ) -> tuple[list[Target], list[str]]:
    """(the targets found on ``host``'s ``ports``, one line per port skipped)."""
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(ports)))) as pool:
        answers = list(pool.map(lambda p: probe_port(host, p, timeout_s), ports))
    found = [a for a in answers if isinstance(a, Target)]
    skipped = [f"{host}:{p}: {a}" for p, a in zip(ports, answers, strict=True)
               if isinstance(a, str)]
    return found, skipped
