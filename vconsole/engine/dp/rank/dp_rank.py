"""`DPRank`: what makes an engine process a data-parallel rank, behind a few busy-loop hooks.

A rank's engine process reaches it through its role (`engine_role.RankRole`, which the busy
loop calls between steps and which announces the `WaveEvent` s returned here); this module owns
everything else: the store connection
(`vconsole.engine.dp.rank.rendezvous`), the current process group
(`vconsole.engine.dp.rank.group`), the wave state machine (`vconsole.engine.dp.rank.wave`), the
counters, and the bodies of the ``dp`` and ``wave`` telemetry topics.

The busy loop's contract (the design of issue #12, vLLM's DP wave protocol):

- `regroup(g)` (the front end's ``regroup`` message, between two steps): leave the old group,
  form generation ``g`` (blocks until every rank joined, at most ``dp_group_timeout_s``), then
  agree on the wave number (the highest of the ranks). Stale generations are ignored.
- while `in_wave` the loop never blocks for input: it runs a real step when it has requests and
  a dummy step (`vconsole.engine.core.EngineCore.dummy_step`) when it has none, and calls
  `after_step` after each; every ``dp_sync_every`` steps of the wave that runs the all-reduce
  "is any rank busy", and when none is the wave completes (a `WaveEvent` "complete").
- `maybe_start(has_work)` after the inputs were applied: requests and no wave → the wave starts
  here (a `WaveEvent` "start" with ``notify``: the front end must hear it, to tell the others);
  `on_start_wave(w)` (the front end's ``start_wave``) joins another rank's wave.
- Before the first group formed, and after one broke, the rank is *uncoordinated*: it serves
  its own requests as a lone engine would, with no dummy steps and no collectives.

Counters: ``steps_total`` counts every step this process ran (real and dummy), in a wave or not;
``sync_s_per_step`` is the all-reduce time spread over those steps (the coordination overhead);
``dummy_share`` in the ``dp`` topic is the dummy share of the steps run since the previous
``dp`` message (0.0 when none ran). The ``dp`` body also says where the rank runs: ``node``
(the host, or the Ray node) and ``actor`` (the Ray actor's name; None for a process rank).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vconsole.engine.dp.rank.group import DPGroup, GroupBroken
from vconsole.engine.dp.rank.rendezvous import DPEnv, connect_store, publish_rank
from vconsole.engine.dp.rank.wave import CompletedWave, WaveState
from vconsole.shared.config import EngineConfig
from vconsole.wire import protocol

log = logging.getLogger("vconsole.engine.dp")


@dataclass(frozen=True)
class WaveEvent:
    """A wave started or completed on this rank. ``body`` is the ``wave`` telemetry body;
    ``notify``: also send ``{"type": "wave", "event", "wave"}`` to the clients (the front
    end) — a wave this rank started because of its own request, or any completion."""

    event: str
    wave: int
    body: dict[str, Any]
    notify: bool


def wave_body(event: str, wave: int, steps: int = 0, dummy_steps: int = 0,
              duration_s: float = 0.0) -> dict[str, Any]:
    return {"event": event, "wave": wave, "steps": steps, "dummy_steps": dummy_steps,
            "duration_s": duration_s}


class DPRank:
    """One rank's coordination; used by the busy loop's thread only (through `RankRole`)."""

    is_rank = True

    def __init__(self, env: DPEnv, config: EngineConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 placement: Mapping[str, Any] | None = None) -> None:
        """``placement``: where this rank runs, for the ``dp`` topic (``node``, ``actor``; a
        Ray actor rank's come from `vconsole.engine.dp.ray.actor`); by default this host's
        name and no actor."""
        self.env = env
        self.placement = {"node": socket.gethostname(), "actor": None, **(placement or {})}
        self.timeout_s = config.dp_group_timeout_s
        self.sync_every = config.dp_sync_every
        self.wave = WaveState(config.dp_sync_every)
        self.device: Any = "cpu"    # the model's device, set once the core exists
        self._clock = clock
        # Connect first, before anything binds or loads: an unreachable store fails the start
        # at once (RendezvousError, an OSError: exit code CANNOT_START).
        self.store = connect_store(env, self.timeout_s) if env.has_store else None
        self.group: DPGroup | None = None
        self.generation = -1
        self.steps_total = 0
        self.dummy_steps_total = 0
        self.sync_count = 0
        self.sync_s = 0.0
        self._window = (0, 0)       # (steps_total, dummy_steps_total) at the last dp body

    # --- state ----------------------------------------------------------------------------

    @property
    def group_state(self) -> str:
        """``none`` (no group yet), ``forming``, ``ok`` or ``broken``."""
        if self.group is None or self.group.state == "destroyed":
            return "none"
        return self.group.state

    @property
    def coordinated(self) -> bool:
        return self.group is not None and self.group.state == "ok"

    @property
    def in_wave(self) -> bool:
        """A wave runs: the loop must step (real or dummy) instead of waiting for input."""
        return self.coordinated and self.wave.running

    def publish_ready(self, record: dict[str, Any]) -> None:
        """Put this rank's ready record in the store, for the front end (no store: nothing)."""
        if self.store is not None:
            publish_rank(self.store, self.env.rank, record)

    # --- hooks -----------------------------------------------------------------------------

    def regroup(self, generation: int, before_form: Callable[[], None] | None = None) -> None:
        """Form group ``generation`` (see the module docstring); ``before_form`` runs once the
        state reads ``forming`` (the caller publishes it). A failure leaves the state
        ``broken`` and the rank uncoordinated."""
        if self.store is None:
            log.warning("regroup %d ignored: this rank has no data-parallel store", generation)
            return
        if generation <= self.generation:
            log.info("regroup %d ignored: generation %d is the current one", generation,
                     self.generation)
            return
        self.close()
        self.wave.abandon()
        self.generation = generation
        self.group = DPGroup(self.store, self.env.rank, self.env.world_size, generation,
                             self.timeout_s, self.device)
        if before_form is not None:
            before_form()
        t0 = self._clock()
        try:
            self.group.form()
            self.wave.restart_numbering(self.group.agree_max(self.wave.wave))
        except GroupBroken as e:
            log.error("data-parallel rank %d: %s; serving uncoordinated until the next regroup",
                      self.env.rank, e)
            return
        log.info("data-parallel rank %d/%d: group generation %d formed in %.2f s (%s), next "
                 "wave %d", self.env.rank, self.env.world_size, generation,
                 self._clock() - t0, self.group.backend, self.wave.wave)

    def maybe_start(self, has_work: bool) -> WaveEvent | None:
        """This rank has requests and no wave runs: start one here."""
        if not (has_work and self.coordinated) or not self.wave.start(self._clock()):
            return None
        return WaveEvent("start", self.wave.wave, wave_body("start", self.wave.wave), True)

    def on_front_end(self, kind: str, value: int,
                     submit_dp: Callable[[dict[str, Any]], None]) -> WaveEvent | None:
        """The front end's ``regroup`` (form generation ``value``'s group; the ``dp`` topic
        says so before and after) or ``start_wave`` (another rank started wave ``value``)."""
        if kind == protocol.REGROUP:
            self.regroup(value, before_form=lambda: submit_dp(self.dp_body()))
            submit_dp(self.dp_body())
            return None
        return self.on_start_wave(value)

    def on_start_wave(self, wave: int) -> WaveEvent | None:
        """Another rank started ``wave`` (forwarded by the front end)."""
        if not self.coordinated or not self.wave.on_start_wave(wave, self._clock()):
            return None
        return WaveEvent("start", self.wave.wave, wave_body("start", self.wave.wave), False)

    def after_step(self, dummy: bool, busy: bool) -> WaveEvent | None:
        """Count a step; in a wave, run the all-reduce when due (``busy``: this rank still has
        unfinished requests). Returns the completion when the wave completed."""
        self.steps_total += 1
        if dummy:
            self.dummy_steps_total += 1
        if not self.in_wave or not self.wave.on_step(dummy):
            return None
        assert self.group is not None
        t0 = self._clock()
        try:
            any_busy = self.group.any_busy(busy)
        except GroupBroken as e:
            self.wave.abandon()
            log.error("data-parallel rank %d: %s; serving uncoordinated until the next regroup",
                      self.env.rank, e)
            return None
        finally:
            self.sync_count += 1
            self.sync_s += self._clock() - t0
        done = self.wave.on_sync_result(any_busy, self._clock())
        return None if done is None else _completed(done)

    def close(self) -> None:
        """Leave the current group, if any (shutdown, or before the next generation)."""
        if self.group is not None:
            self.group.destroy()

    # --- telemetry -------------------------------------------------------------------------

    def dp_body(self) -> dict[str, Any]:
        """The ``dp`` topic body; moves the ``dummy_share`` window."""
        steps, dummies = self.steps_total, self.dummy_steps_total
        w_steps, w_dummies = steps - self._window[0], dummies - self._window[1]
        self._window = (steps, dummies)
        return {
            "world_size": self.env.world_size, "wave": self.wave.wave,
            "wave_running": self.in_wave, "group_generation": self.generation,
            "group_state": self.group_state, "steps_total": steps,
            "dummy_steps_total": dummies,
            "dummy_share": w_dummies / w_steps if w_steps else 0.0,
            "sync_every": self.sync_every, "sync_count_total": self.sync_count,
            "sync_s_total": self.sync_s,
            "sync_s_per_step": self.sync_s / steps if steps else 0.0,
            **self.placement,
        }


def split_cpu_threads(env: DPEnv, config: EngineConfig,
                      environ: Mapping[str, str] | None = None) -> int | None:
    """On CPU the ranks of one host share its cores: each takes ``cores // ranks on this host``
    torch threads (at least 1), unless ``OMP_NUM_THREADS`` already decides (torchrun sets it).
    Returns the thread count set, None when nothing was changed (CUDA, or the variable set)."""
    import torch

    environ = os.environ if environ is None else environ
    on_cpu = config.device == "cpu" or (config.device == "auto"
                                        and not torch.cuda.is_available())
    if not on_cpu or environ.get("OMP_NUM_THREADS"):
        return None
    try:
        local = int(environ.get("LOCAL_WORLD_SIZE") or env.world_size)
    except ValueError:
        local = env.world_size
    threads = max(1, (os.cpu_count() or 1) // max(1, local))
    torch.set_num_threads(threads)
    return threads


def _completed(done: CompletedWave) -> WaveEvent:
    return WaveEvent("complete", done.wave, wave_body("complete", done.wave, done.steps,
                                                      done.dummy_steps, done.duration_s), True)
