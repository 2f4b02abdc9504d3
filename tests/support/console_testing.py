"""Helpers for testing the console without an engine: payload frames, a fake control channel,
and an app driven by a recording (used by tests/test_console*.py and scripts/screenshots.py).

`FakeControl` answers exactly as the engine does — it runs `vconsole.shared.config.apply_update` and
builds the reply with `vconsole.wire.control.config_reply` — so the console's handling of applied /
rejected / restart-required is tested against the real rules. Its profile ops answer with the
engine's status and result shapes (`fake_profile_result`); a profile advances
``profile_steps_per_poll`` steps per ``profile_status`` unless ``profile_hold`` is set. It is a
complete `vconsole.console.control_link.Control` (the type checker verifies it below).
`InlineHost` runs `Steering`'s blocking calls at once, on the calling thread, and keeps the
`Update` each reply brings, so Steering is tested without Textual.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from vconsole.shared.config import EngineConfig, apply_update
from vconsole.telemetry.schema import encode, make_envelope

if TYPE_CHECKING:
    from vconsole.console.control_link import Control
    from vconsole.console.steering_host import SteeringHost, Update
    from vconsole.security.key_owner import KeyStatus

DATA = Path(__file__).resolve().parent.parent / "data"
RECORDING = DATA / "synthetic.vrec"


def frames(topic: str, body: dict[str, Any], *, seq: int = 0, ts: float = 1_700_000_000.0,
           engine: str = "tiny-0", rank: int = 0) -> list[Any]:
    """One encoded message, as a publisher sends it."""
    return encode(topic, {**make_envelope(engine, rank, seq, ts), **body})


def foreign_version_frames(topic: str = "health", version: int = 99) -> list[bytes]:
    """A message from a publisher speaking another schema version (encode refuses to make one)."""
    payload = {"v": version, "ts": 1.0, "engine": "future-0", "rank": 0, "seq": 0,
               "state": "running", "uptime_s": 1.0, "steps": 0, "interval_s": 1.0}
    return [topic.encode(), msgpack.packb(payload, use_bin_type=True)]


class FakeControl:
    """An in-memory control channel with the engine's validation. ``down`` makes every call
    time out, like an engine that is not running."""

    def __init__(self, config: EngineConfig | None = None, version: int = 1) -> None:
        self.config = config or EngineConfig(num_kv_blocks=1024, max_num_seqs=32)
        self.version = version
        self.down = False
        self.calls: list[tuple[str, dict[str, Any] | None]] = []
        self._lock = threading.Lock()
        self.profile: dict[str, Any] | None = None   # the last profile's status
        self.profile_steps_per_poll = 5
        self.profile_hold = False
        self._profiles = 0

    def _reply(self, update: Any = None) -> dict[str, Any]:
        from vconsole.wire.control import config_reply

        return config_reply(self.version, self.config.to_dict(), update)

    def key_status(self) -> KeyStatus | None:
        """No key file: nothing to say whose key this is (as a link without a key)."""
        return None

    def get_config(self) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("get_config", None))
            if self.down:
                raise TimeoutError("no reply from the engine's control socket (fake, down)")
            return self._reply()

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("set_config", dict(values)))
            if self.down:
                raise TimeoutError("no reply from the engine's control socket (fake, down)")
            update = apply_update(self.config, values)
            if update.applied:
                self.config = update.config
                self.version += 1
            return self._reply(update)

    # --- profile ops (the engine's shapes; see vconsole/engine/process/profile_book.py) -----------------------

    def _profile_call(self, op: str, fields: dict[str, Any]) -> None:
        self.calls.append((op, fields))
        if self.down:
            raise TimeoutError("no reply from the engine's control socket (fake, down)")

    def profile_start(self, steps: int) -> dict[str, Any]:
        from vconsole.wire.control import ControlError

        with self._lock:
            self._profile_call("profile_start", {"steps": steps})
            if self.profile is not None and self.profile["state"] == "running":
                raise ControlError(f"profile {self.profile['id']} is running")
            self._profiles += 1
            self.profile = {"id": f"p{self._profiles}", "state": "running", "steps": steps,
                            "steps_done": 0, "profiling": True, "started_ts": 0.0,
                            "finished_ts": None, "slowdown_note": "each profiled step runs "
                            "slower", "result": None, "error": None}
            return dict(self.profile)

    def profile_status(self, profile_id: str) -> dict[str, Any]:
        from vconsole.wire.control import ControlError

        with self._lock:
            self._profile_call("profile_status", {"profile": profile_id})
            p = self.profile
            if p is None or p["id"] != profile_id:
                raise ControlError(f"no profile {profile_id!r}")
            if p["state"] == "running" and not self.profile_hold:
                p["steps_done"] = min(p["steps"], p["steps_done"] + self.profile_steps_per_poll)
                if p["steps_done"] == p["steps"]:
                    p.update(state="done", profiling=False,
                             result=fake_profile_result(p["steps"], profile_id))
            return dict(p)

    def profile_cancel(self, profile_id: str) -> dict[str, Any]:
        with self._lock:
            self._profile_call("profile_cancel", {"profile": profile_id})
            p = self.profile
            if p is not None and p["id"] == profile_id and p["state"] == "running":
                p.update(state="cancelled", profiling=False, error="cancelled")
            return dict(p or {})


class InlineHost:
    """A `SteeringHost` without threads: work runs at once, its reply's step too; ``updates``
    keeps what each step returned, ``groups`` the worker group of each work."""

    def __init__(self) -> None:
        self.updates: list[Update] = []
        self.groups: list[str] = []

    def run_blocking(self, work: Callable[[threading.Event], None], *, group: str,
                     exclusive: bool = False) -> None:
        self.groups.append(group)
        work(threading.Event())

    def from_worker(self, step: Callable[[], Update]) -> None:
        self.updates.append(step())


if TYPE_CHECKING:   # the type checker verifies the fakes are complete
    _control: Control = FakeControl()
    _host: SteeringHost = InlineHost()


def fake_profile_result(steps: int, profile_id: str = "p1") -> dict[str, Any]:
    """A profile result with the engine's fields (`vconsole.engine.worker.profiler`)."""
    ops = [("aten::mm", 0.8), ("aten::_scaled_dot_product_flash_attention_for_cpu", 0.12),
           ("aten::mul", 0.02), ("aten::silu", 0.01), ("aten::index_select", 0.004)]
    phase_s = {"schedule": 0.004 * steps, "execute": 0.05 * steps, "update": 0.002 * steps}
    busy = sum(phase_s.values())
    return {
        "id": profile_id, "steps": steps, "first_step": 40, "last_step": 40 + steps,
        "device": "cpu", "sort_by": "self_cpu_s",
        "ops": [{"name": n, "self_cpu_s": s, "self_cuda_s": 0.0, "calls": 29 * steps}
                for n, s in ops],
        "phases": {k: v / busy for k, v in phase_s.items()}, "phase_s": phase_s,
        "layers": {"attention": 0.5, "mlp": 0.4, "lm_head": 0.05, "norm": 0.03,
                   "other": 0.02, "sampler": 0.001, "prepare": 0.001, "embedding": 0.0005},
        "layers_clock": "cpu", "wall_s": busy * 1.01, "mean_step_s": busy / steps,
        "slowdown_note": "profiled steps run slower than usual (fake)",
    }


def replay_app(path: str | Path = RECORDING, *, control: Any = None, readonly: bool = False,
               clock: Any = None, records: Sequence[tuple[float, Sequence[Any]]] | None = None,
               **kw: Any) -> Any:
    """A VConsoleApp fed instantly from ``path`` (or ``records``); writable when a control is
    given (unless ``readonly``)."""
    from vconsole.console.app import VConsoleApp
    from vconsole.console.sources.stream import ReplaySource

    src = ReplaySource(path, speed=0, records=(lambda: iter(records)) if records is not None
                       else None, readonly=control is None)
    return VConsoleApp(source=src, control=control, readonly=readonly, clock=clock, **kw)


async def until(pilot: Any, cond: Callable[[], Any], timeout: float = 5.0) -> None:
    """Pause the pilot until ``cond()`` holds (worker threads answer asynchronously)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


def big_sched(n: int, snapshot_ts: float = 1_700_000_000.0) -> dict[str, object]:
    """A sched payload of ``n`` request rows, a third in each state."""
    states = ("running", "waiting", "preempted")
    rows = [{"id": f"req-{i:06d}", "state": states[i % 3], "priority": i % 7,
             "num_prompt_tokens": 100 + i % 900, "num_output_tokens": i % 300,
             "num_blocks": i % 40, "age_s": (i % 1000) / 10} for i in range(n)]
    return {"num_waiting": n // 3, "num_running": n // 3, "num_preempted": n // 3,
            "num_preemptions_total": 0, "num_finished_total": 0, "max_num_seqs": n,
            "max_num_batched_tokens": 8192, "policy": "priority", "requests": rows,
            "requests_truncated": False, "snapshot_ts": snapshot_ts}
