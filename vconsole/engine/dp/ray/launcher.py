"""RayLauncher: ``vconsole engine --data-parallel-size N --data-parallel-backend ray``.

The same group as the single-host launcher (`vconsole.engine.dp.launcher`) — one front end on
the public endpoints (`FrontEndStack`), the rendezvous store, N ranks running the rank loop —
except that each rank is a Ray actor (`vconsole.engine.dp.ray.actor.RankActor`) placed by a
placement group of its own: ``STRICT_PACK``, named ``dp_rank_{r}``, one bundle of the rank's
CPUs (and its GPU when the cluster has GPUs and ``--device`` is not ``cpu``; a share of one when
there are fewer GPUs than ranks, `gpu_share`), the actor on it.
Ray is joined or started by `vconsole.engine.dp.ray.cluster.RayCluster` (``--ray-address``).

Restarts — one mechanism, ours: the actors are created with Ray's ``max_restarts=0`` and each
rank's keeper thread (`RankKeeper`) restarts a dead actor in the rank's placement group (which
outlives it) with the supervisor's rules (``--max-restarts`` within ``--restart-window``, the
``--restart-backoff`` doubling). Ours rather than Ray's because the front end must learn of the
death the moment it happens (Ray's restart is silent to the owner until a call fails): it fails
that rank's in-flight requests with ``data-parallel rank R died: <reason>`` (e.g. ``Ray actor
vconsole_dp_rank_1 killed by ray.kill``; what Ray's error says and no more,
`vconsole.engine.dp.ray.death`), routes new ones to the other ranks and publishes
``health`` ``restarting`` with the reason and count; the new actor starts with that count and
reason (its own ``health`` says them), and once it is ready the front end regroups every rank —
the wave numbering carries on. A rank whose loop ends with an error (an exit code such as
``STEP_FAILURES``, or ``run`` raising) is restarted the same way (its actor is killed first: it
still holds its name and bundle). A restart that fails to start, or does not start within
``START_TIMEOUT_S``, counts as one more failure. A rank that fails beyond the rules, or whose
first start fails or times out, stops the group (exit code 4, or 2 when it could never start).

Stopping (SIGTERM/SIGINT): every actor drains (`RankActor.stop`), then is killed and its
placement group removed; an owned Ray is shut down. A second signal kills the actors at once.
A signal while Ray starts (before any rank) is kept: no rank starts, Ray is shut down.
Invariant: when `run` returns, no actor or placement group of this engine is left, and no
process of a Ray it started.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vconsole.engine.dp.front.stack import FrontEndStack, without_refused_text
from vconsole.engine.dp.front.torchrun import rank_curves
from vconsole.engine.dp.ray.actor import RankActor, actor_name
from vconsole.engine.dp.ray.cluster import RayCluster
from vconsole.engine.dp.ray.death import death_reason
from vconsole.engine.launch.restart_policy import RestartPolicy
from vconsole.wire import exit_codes
from vconsole.wire.ready_file import ENDPOINT_NAMES

if TYPE_CHECKING:
    from vconsole.engine.launch.launch import EngineLaunch
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.dp")

POLL_S = 0.2
START_TIMEOUT_S = 600.0      # placing the rank and loading its model
PLACE_TIMEOUT_S = 60.0       # a placement group the cluster cannot fit: say so
STOP_GRACE_S = 30.0


def group_name(rank: int) -> str:
    return f"dp_rank_{rank}"


def gpu_share(gpus: int, world: int) -> float:
    """One rank's GPU request: a whole GPU when there are enough, else the largest share (4
    decimals, rounded down) of which ``ceil(world / gpus)`` fit on one GPU — Ray places a
    fractional request on a single GPU, so 3 ranks on 2 GPUs get 0.5 each (2 + 1), not
    0.6667 (which leaves no room for a second rank on either), and 6 on 1 GPU 0.1666 (six
    fit), not 0.1667 (1.0002 > 1). Like mp (rank r on GPU r mod count), at most
    ``ceil(world / gpus)`` ranks share a GPU; which GPU each gets is Ray's choice."""
    if gpus <= 0:
        return 0.0
    if gpus >= world:
        return 1.0
    return math.floor(1e4 / math.ceil(world / gpus)) / 1e4


class Stopped:
    """`wait_for`'s answer when it stopped waiting because the rank is stopping."""


class TimedOut:
    """`wait_for`'s answer when the call did not finish within its time."""


STOPPED, TIMED_OUT = Stopped(), TimedOut()


def wait_for(ray: Any, ref: Any, timeout_s: float, stopping: Callable[[], bool]) -> Any:
    """``ref``'s value, or the Ray error it raised; `STOPPED` as soon as ``stopping()``,
    `TIMED_OUT` when not done within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stopping():
            return STOPPED
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return TIMED_OUT
        ready, _ = ray.wait([ref], timeout=min(POLL_S, remaining))
        if ready:
            try:
                return ray.get(ref)
            except ray.exceptions.RayError as e:
                return e


class RankFailed(Exception):
    """A rank the keeper gives up on; ``code`` is the group's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class RestartFailed(Exception):
    """A restarted actor that did not start: counted as one more failure of its rank."""


class RankKeeper:
    """Rank ``rank``'s placement group and actor, kept alive in a thread of the launcher."""

    def __init__(self, launcher: RayLauncher, rank: int) -> None:
        self.launcher = launcher
        self.rank = rank
        self.ray = launcher.cluster.ray
        sup = launcher.launch.supervision
        self.policy = RestartPolicy(sup.max_restarts, sup.restart_window_s,
                                    sup.restart_backoff_s)
        self.restart_count = 0
        self.actor: Any = None
        self.group: Any = None
        self.failure: RankFailed | None = None
        self._stop = threading.Event()
        self._kill = threading.Event()
        if launcher._stop_signal is not None:      # a keeper made after a stop starts stopped
            self._stop.set()
        self.thread = threading.Thread(target=self._run, name=f"dp-ray-rank-{rank}",
                                       daemon=True)

    # --- the keeper's thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._stop.is_set():
                return
            self._place()
            reason: str | None = None
            while not self._stop.is_set():
                try:
                    record = self._start_actor(reason)
                except RestartFailed as e:      # one more failure, under the same rules
                    self._kill_actor()
                    reason = str(e)
                else:
                    if record is None:
                        break
                    self.launcher.stack.rank_ready(self.rank, record)
                    reason = self._serve()
                    if reason is None:
                        break
                    # The loop ended with an error: its actor is still alive, holding the
                    # rank's name and bundle, which the next one needs.
                    self._kill_actor()
                now = time.monotonic()
                delay = self.policy.on_failure(now)
                self.launcher.stack.rank_exit(self.rank, reason, restarting=delay is not None,
                                              restart_count=self.restart_count + 1)
                if delay is None:
                    raise RankFailed(f"{reason}; gave up after {self.restart_count} restart(s) "
                                     "(--max-restarts)", exit_codes.GAVE_UP)
                log.warning("data-parallel rank %d: %s; restarting in %.1f s", self.rank,
                            reason, delay)
                self.restart_count += 1
                if self._stop.wait(delay):
                    break
        except RankFailed as e:
            self.failure = e
        except Exception as e:      # Ray itself failed under us
            self.failure = RankFailed(f"{type(e).__name__}: {e}", exit_codes.FAILED)
        finally:
            self._clean_up()

    def _place(self) -> None:
        from ray.util import placement_group

        bundle = self.launcher.bundle
        self.group = placement_group([bundle], strategy="STRICT_PACK",
                                     name=group_name(self.rank))
        ready, _ = self.ray.wait([self.group.ready()], timeout=PLACE_TIMEOUT_S)
        if not ready:
            raise RankFailed(
                f"the Ray cluster cannot place rank {self.rank} ({bundle} in placement group "
                f"{group_name(self.rank)}) within {PLACE_TIMEOUT_S:g} s; available: "
                f"{self.ray.available_resources()}", exit_codes.CANNOT_START)

    def _start_actor(self, reason: str | None) -> dict[str, Any] | None:
        """A new actor on the rank's bundle, started; its ready record (None: stopped)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.launcher.bundle
        cls = self.ray.remote(RankActor)
        options: dict[str, Any] = dict(
            name=actor_name(self.rank), max_restarts=0, max_concurrency=2,
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=0))
        deadline = time.monotonic() + 10
        while True:
            try:
                self.actor = cls.options(**options).remote(
                    self.launcher.rank_launch(self.rank),
                    front_node_id=self.launcher.cluster.node_id,
                    restart_count=self.restart_count, restart_reason=reason)
                break
            except ValueError:      # the dead actor's name is not released yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        ref = self.actor.start.remote()
        record = self._wait(ref, START_TIMEOUT_S)
        if record is STOPPED:
            return None
        if record is TIMED_OUT:
            what = f"did not start within {START_TIMEOUT_S:g} s"
            if self.restart_count == 0:
                raise RankFailed(f"data-parallel rank {self.rank} {what}",
                                 exit_codes.CANNOT_START)
            raise RestartFailed(f"Ray actor {actor_name(self.rank)} {what}")
        if isinstance(record, BaseException):
            if self.restart_count == 0:
                raise RankFailed(f"data-parallel rank {self.rank} cannot start: "
                                 f"{_task_error(record)}", exit_codes.CANNOT_START)
            raise RestartFailed(f"Ray actor {actor_name(self.rank)} failed to restart: "
                                f"{_task_error(record)}")
        assert isinstance(record, dict)
        return record

    def _serve(self) -> str | None:
        """The actor's busy loop until it ends: None when stopped (or it exited cleanly),
        else why it died."""
        ref = self.actor.run.remote()
        while True:
            if self._stop.is_set():
                self.actor.stop.remote("SIGTERM")
                self._wait(ref, STOP_GRACE_S, stoppable=False)
                return None
            ready, _ = self.ray.wait([ref], timeout=POLL_S)
            if not ready:
                continue
            try:
                code = self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as e:
                return f"Ray actor {actor_name(self.rank)}: {_task_error(e)}"
            except self.ray.exceptions.RayError as e:
                return death_reason(e, self.rank)
            if code == exit_codes.OK:
                return None
            return f"Ray actor {actor_name(self.rank)}: engine exit code {code}"

    def _wait(self, ref: Any, timeout_s: float, *, stoppable: bool = True) -> Any:
        """`wait_for` stopping on a kill, or (``stoppable``) on a stop."""
        return wait_for(self.ray, ref, timeout_s,
                        lambda: self._kill.is_set() or (stoppable and self._stop.is_set()))

    def _kill_actor(self) -> None:
        if self.actor is not None:
            try:
                self.ray.kill(self.actor, no_restart=True)
            except Exception as e:
                log.debug("rank %d: ray.kill: %s", self.rank, e)
            self.actor = None

    def _clean_up(self) -> None:
        from ray.util import remove_placement_group

        self._kill_actor()
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception as e:
                log.debug("rank %d: remove_placement_group: %s", self.rank, e)
            self.group = None

    # --- from the launcher's thread ---------------------------------------------------------

    def stop(self, kill: bool = False) -> None:
        self._stop.set()
        if kill:
            self._kill.set()


def _task_error(e: BaseException) -> str:
    """The rank's own exception from a `RayTaskError` (its last line: ``Type: message``)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


class RayLauncher:
    """See the module docstring; `run` from the main thread (signals)."""

    def __init__(self, launch: EngineLaunch, *, curve: ServerCurve | None = None,
                 ray_address: str | None = None) -> None:
        self.launch = launch
        self.config = launch.config
        self.world_size = launch.config.data_parallel_size
        self.curve = curve
        self.ray_address = ray_address
        self._stop_signal: int | None = None
        self.keepers: list[RankKeeper] = []

    def run(self) -> int:
        """Raises `RayMissing`, `ConnectionError` (Ray), `RemoteBindRefused` / `OSError` (the
        public endpoints), `CurveKeyError` before any rank starts."""
        _, front_curve = rank_curves(self.launch.dp_curve_dir, front_end=True)
        self.stack = FrontEndStack.for_launch(self.launch, self.world_size, curve=self.curve,
                                              rank_curve=front_curve)
        previous = {s: signal.signal(s, self._on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            import torch.distributed as dist

            store = dist.TCPStore(self.config.dp_master_addr, self.config.dp_master_port or 0,
                                  is_master=True, wait_for_workers=False)
            self.store_port = store.port
            t0 = time.monotonic()
            try:
                self.cluster = RayCluster.connect(self.ray_address,
                                                  engine_id=self.config.engine_id,
                                                  min_cpus=self.world_size)
            except SystemExit as e:
                # SIGTERM inside ray.init (whose own handler exits at once): a stop; `connect`
                # has undone what it started.
                if e.code != signal.SIGTERM:
                    raise
                log.info("stopped (SIGTERM) while Ray started")
                return exit_codes.OK
            log.info("Ray %s in %.1f s (namespace %s)",
                     "started" if self.cluster.owned else f"joined at {self.ray_address}",
                     time.monotonic() - t0, self.cluster.namespace)
            for s in previous:      # ray.init installed its own (exit at once): ours again
                signal.signal(s, self._on_stop)
            try:
                self.bundle = self._bundle()
                return self._run_ranks()
            finally:
                self.cluster.close()
                del store
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stack.close()

    def _bundle(self) -> dict[str, float]:
        """One rank's resources: its share of the cores of a Ray we started (1 CPU in a
        cluster), and one GPU when there are GPUs and the device allows them."""
        cpus = (max(1, (os.cpu_count() or 1) // self.world_size) if self.cluster.owned else 1)
        bundle: dict[str, float] = {"CPU": float(cpus)}
        gpus = self.cluster.gpus() if self.config.device != "cpu" else 0
        share = gpu_share(gpus, self.world_size)
        if share:
            bundle["GPU"] = share
        if 0 < share < 1:      # fewer devices than ranks: they share
            log.warning("%d ranks share %d GPU(s): %g GPU per rank (at most %d on one)",
                        self.world_size, gpus, share, math.ceil(self.world_size / gpus))
        return bundle

    def rank_launch(self, rank: int) -> EngineLaunch:
        """Rank ``rank``'s engine: the group's store, its private endpoints chosen by its
        actor, no public metrics, ready file or key file of its own."""
        launch = self.launch.for_rank(rank, self.world_size, self.config.dp_master_addr,
                                      self.store_port, endpoints=dict.fromkeys(ENDPOINT_NAMES, ""),
                                      control_key_file="")
        launch = without_refused_text(launch, self.stack.text_refusal, warn=rank == 0)
        return replace(launch, control_key_file=None, ready_file=None, child=None)

    def _run_ranks(self) -> int:
        if self._stop_signal is not None:       # stopped while Ray started: no rank starts
            log.info("stopped (signal %d) before any rank started", self._stop_signal)
            return exit_codes.OK
        self.keepers = [RankKeeper(self, r) for r in range(self.world_size)]
        if self._stop_signal is not None:       # ... or while the keepers were made
            return exit_codes.OK
        for k in self.keepers:
            k.thread.start()
        failed: RankFailed | None = None
        while any(k.thread.is_alive() for k in self.keepers):
            bad = next((k for k in self.keepers if k.failure is not None), None)
            if bad is not None and failed is None and bad.failure is not None:
                failed = bad.failure
                if self._stop_signal is None:
                    print(f"vconsole engine: data-parallel rank {bad.rank}: {failed}; "
                          "stopping the group", file=sys.stderr, flush=True)
                    self._on_stop(signal.SIGTERM, None)
            time.sleep(POLL_S)
        failed = failed or next((k.failure for k in self.keepers if k.failure), None)
        if failed is not None:
            if self._stop_signal is None:
                print(f"vconsole engine: {failed}", file=sys.stderr, flush=True)
            return failed.code
        return exit_codes.OK

    def _on_stop(self, signum: int, _frame: Any) -> None:
        """First SIGTERM/SIGINT: every rank drains. Another: kill them."""
        first = self._stop_signal is None
        self._stop_signal = self._stop_signal or signum
        for k in self.keepers:
            k.stop(kill=not first)
