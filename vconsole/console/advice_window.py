"""The advisor's evidence: a sliding window over the telemetry stream, and whether a condition
held in it.

`EvidenceWindow` keeps, per topic (``step``, ``sched``, ``kv``, ``latency``), a summary of each
snapshot of the last ``window_s`` seconds of the stream (time is the envelope's ``ts``: no
clock), and the config in force. A condition *held* when it was true in at least ``quorum`` of
the window's snapshots, over at least ``min_samples`` snapshots spanning at least half the
window. A changed tuning key drops the evidence gathered under the old value. The rules that
read it are `vconsole.console.advisor.Advisor`'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vconsole.shared.config import FIELDS, ConfigError, EngineConfig, validate_config

WINDOW_S = 10.0
QUORUM = 0.8
MIN_SAMPLES = 5

# Keys the rules read or suggest: a change to one drops the evidence gathered before it.
TUNING_KEYS = ("max_num_seqs", "max_num_batched_tokens", "policy", "hybrid_aging_s",
               "block_size", "num_kv_blocks", "enable_prefix_caching")

_DEFAULTS = EngineConfig().to_dict()

@dataclass
class _Held:
    """A condition's record over the window: in how many snapshots it held."""

    hits: int
    samples: int


Sample = tuple[float, dict[str, Any]]


def _num(p: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    v = p.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default


class EvidenceWindow:
    """See the module docstring. Not thread-safe (the console calls it under its state lock)."""

    def __init__(self, *, window_s: float = WINDOW_S, quorum: float = QUORUM,
                 min_samples: int = MIN_SAMPLES) -> None:
        self.window_s = window_s
        self.quorum = quorum
        self.min_samples = min_samples
        self.min_span_s = window_s / 2
        self._samples: dict[str, deque[Sample]] = {t: deque() for t in
                                                   ("step", "sched", "kv", "latency")}
        self._config: dict[str, Any] = {}
        self._latest_ts = 0.0
        self._version = 0

    # --- input --------------------------------------------------------------------------------

    def observe(self, msg: Any) -> None:
        """One decoded `TelemetryMessage` (anything with ``topic`` and ``payload``)."""
        self.observe_payload(msg.topic, msg.payload)

    def observe_payload(self, topic: str, p: Mapping[str, Any]) -> None:
        if topic == "config":
            values = p.get("values")
            if isinstance(values, Mapping):
                self.set_config(values)
            return
        summary = _SUMMARIES.get(topic)
        if summary is None:
            return
        ts = _num(p, "ts", self._latest_ts)
        self._latest_ts = max(self._latest_ts, ts)
        self._samples[topic].append((ts, summary(p)))
        self._prune()
        self._version += 1

    def set_config(self, values: Mapping[str, Any]) -> None:
        """The config in force (a ``config`` message, or a console's control reply). A changed
        tuning key drops the evidence gathered under the old value."""
        if values == self._config:
            return                      # the periodic re-announcement: nothing new
        changed = any(k in self._config and k in values and self._config[k] != values[k]
                      for k in TUNING_KEYS)
        self._config = dict(values)
        if changed:
            self.reset()
        self._version += 1

    def reset(self) -> None:
        for q in self._samples.values():
            q.clear()
        self._version += 1

    def evidence_s(self) -> float:
        """Seconds of stream the window holds now: no rule fires before ``min_span_s``."""
        return max((q[-1][0] - q[0][0] for q in self._samples.values() if q), default=0.0)

    def _prune(self) -> None:
        start = self._latest_ts - self.window_s
        for q in self._samples.values():
            while q and q[0][0] < start:
                q.popleft()

    # --- what the rules read ------------------------------------------------------------------

    def _window(self, topic: str) -> list[dict[str, Any]]:
        start = self._latest_ts - self.window_s
        return [s for ts, s in self._samples[topic] if ts >= start]

    def _enough(self, topic: str) -> bool:
        q = self._samples[topic]
        return len(q) >= self.min_samples and q[-1][0] - q[0][0] >= self.min_span_s

    def _held(self, topic: str, cond: Callable[[dict[str, Any]], bool]) -> _Held | None:
        """The record of ``cond`` over ``topic``'s window when it held in a quorum, else None."""
        if not self._enough(topic):
            return None
        samples = self._window(topic)
        hits = sum(1 for s in samples if cond(s))
        return _Held(hits, len(samples)) if hits >= self.quorum * len(samples) else None

    def _value(self, key: str) -> Any:
        """The value in force: the config when known, else what sched / kv report."""
        if key in self._config and not (key == "num_kv_blocks" and self._config[key] is None):
            return self._config[key]
        if key in ("max_num_seqs", "max_num_batched_tokens", "policy"):
            s = self._samples["sched"]
            return s[-1][1].get(key) if s else None
        if key in ("block_size", "num_kv_blocks"):
            k = self._samples["kv"]
            return k[-1][1].get("block_size" if key == "block_size" else "num_blocks") if k \
                else None
        return None

    def _threshold(self, key: str) -> float:
        v = self._config.get(key, _DEFAULTS[key])
        return float(v) if isinstance(v, int | float) else float(_DEFAULTS[key])

    def _base_config(self) -> EngineConfig | None:
        known = {k: v for k, v in self._config.items() if k in FIELDS}
        if not known:
            return None
        try:
            return validate_config(known)
        except (ConfigError, TypeError):
            return None


def _step(p: Mapping[str, Any]) -> dict[str, Any]:
    prefill, decode = _num(p, "num_prefill_tokens"), _num(p, "num_decode_tokens")
    return {"steps": _num(p, "steps"), "sched_share": _num(p, "sched_share"),
            "p50": _num(p, "step_time_p50_s"), "prefill": prefill, "decode": decode,
            "tokens": prefill + decode, "num_reqs_max": _num(p, "num_reqs_max")}


def _sched(p: Mapping[str, Any]) -> dict[str, Any]:
    return {"waiting": _num(p, "num_waiting"), "running": _num(p, "num_running"),
            "preemptions_total": _num(p, "num_preemptions_total"),
            "max_num_seqs": p.get("max_num_seqs"),
            "max_num_batched_tokens": p.get("max_num_batched_tokens"),
            "policy": p.get("policy")}


def _kv(p: Mapping[str, Any]) -> dict[str, Any]:
    return {"usage": _num(p, "usage"), "fragmentation": _num(p, "fragmentation"),
            "num_used": _num(p, "num_used"), "num_blocks": p.get("num_blocks"),
            "block_size": p.get("block_size")}


def _latency(p: Mapping[str, Any]) -> dict[str, Any]:
    p99: Any = p.get("overall")
    for key in ("window", "ttft_s", "p99"):
        p99 = p99.get(key) if isinstance(p99, Mapping) else None
    prio = p.get("priority")
    return {"ttft_p99": float(p99) if isinstance(p99, int | float) else None,
            "classes": len(prio) if isinstance(prio, Mapping) else 0}


_SUMMARIES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "step": _step, "sched": _sched, "kv": _kv, "latency": _latency}
