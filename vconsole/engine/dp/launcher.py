"""DPLauncher: `vconsole engine --data-parallel-size N` on one host — N supervised ranks, one front.

The launcher loads no model. It hosts the rendezvous store (a ``torch.distributed.TCPStore``
master on ``--dp-master-addr``:``--dp-master-port``, or a free port), starts the front end in
threads on the PUBLIC endpoints (`vconsole.engine.dp.front.stack.FrontEndStack`: requests,
telemetry proxy, control fan-out, Prometheus with ``--metrics-port``) and runs
each rank as a supervised child (`vconsole.engine.launch.supervisor.EngineSupervisor`, one per
rank, each in a thread): ``python -m vconsole engine ... --data-parallel-size N --dp-rank r
--dp-master-addr A --dp-master-port P`` bound to private ``ipc://`` endpoints under a private
run folder (mode 0700). Device split: with CUDA each rank sees device ``r mod count``
(``CUDA_VISIBLE_DEVICES``); on CPU each gets ``cores // N`` threads (``OMP_NUM_THREADS``).

A rank that dies is restarted by its supervisor (same endpoints, same backoff and give-up rules
as a lone engine); meanwhile the front end fails its in-flight requests with an error naming
the rank and routes new ones to the others, and the proxy publishes ``health`` ``restarting``
with the rank's ``rank`` until it is back. When the rank is ready again the front end
reconnects and regroups every rank.

The public ready file (``--ready-file``) is written once every rank is ready: the front end's
endpoints, its control key file, ``data_parallel_size`` and ``ranks`` (``[{rank, pid,
ready_file}]``, ``pid`` the rank's engine process), rewritten when a rank restarts.

Signals: SIGTERM/SIGINT → every rank drains, the front end closes, exit 0 (a second one kills
the ranks). A rank's supervisor that gives up stops the whole group with its exit code.
Invariant: when `run` returns no rank process is left running and the run folder is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vconsole.engine.dp.front.stack import FrontEndStack, without_refused_text
from vconsole.engine.launch.supervisor import EngineSupervisor
from vconsole.wire import exit_codes
from vconsole.wire.ready_file import ENDPOINT_NAMES

if TYPE_CHECKING:
    from vconsole.engine.launch.launch import EngineLaunch
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.dp")

POLL_S = 0.1


def gpu_count(device: str) -> int:
    """CUDA devices the ranks may use (0 with ``--device cpu`` or without usable CUDA)."""
    if device == "cpu":
        return 0
    try:
        import torch
        return int(torch.cuda.device_count())
    except Exception:   # no usable CUDA: CPU ranks
        return 0


def rank_env(rank: int, world_size: int, device: str) -> dict[str, str]:
    """The rank's environment: its device (CUDA) or its share of the cores (CPU)."""
    env = dict(os.environ)
    gpus = gpu_count(device)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(rank % gpus)
    else:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    return env


class DPLauncher:
    """See the module docstring; `run` from the main thread (signals)."""

    def __init__(self, launch: EngineLaunch, *, curve: ServerCurve | None = None) -> None:
        self.launch = launch
        self.config = launch.config
        self.world_size = launch.config.data_parallel_size
        self.curve = curve
        self._stop_signal: int | None = None
        self._failed: int | None = None
        self.supervisors: list[EngineSupervisor] = []

    def run(self) -> int:
        self.stack = FrontEndStack.for_launch(self.launch, self.world_size, curve=self.curve)
        run_dir = Path(tempfile.mkdtemp(prefix="vconsole-dp-"))
        previous = {s: signal.signal(s, self._on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            import torch.distributed as dist

            store = dist.TCPStore(self.config.dp_master_addr, self.config.dp_master_port or 0,
                                  is_master=True, wait_for_workers=False)
            try:
                return self._run_ranks(run_dir, store.port)
            finally:
                del store
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stack.close()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _hang_timeout(self) -> float:
        """``--hang-timeout`` for a rank, but never within a collective's own timeout: a rank
        waiting on a dead peer is not hung until its group gives up (``dp_group_timeout_s``,
        for forming the group and for each collective), which then counts as a failure."""
        hang = self.launch.supervision.hang_timeout_s
        return max(hang, 2 * self.config.dp_group_timeout_s + 10) if hang else 0.0

    def _rank_launch(self, rank: int, run_dir: Path, port: int) -> EngineLaunch:
        """Rank ``rank``'s engine: private ipc endpoints and key file in ``run_dir``,
        supervised with the group's restart rules."""
        launch = self.launch.for_rank(
            rank, self.world_size, self.config.dp_master_addr, port,
            endpoints={n: f"ipc://{run_dir}/r{rank}-{n}" for n in ENDPOINT_NAMES},
            control_key_file=str(run_dir / f"r{rank}.key"))
        launch = without_refused_text(launch, self.stack.text_refusal, warn=rank == 0)
        return replace(launch, ready_file=str(run_dir / f"r{rank}.ready"),
                       supervision=replace(launch.supervision,
                                           hang_timeout_s=self._hang_timeout()))

    def _run_ranks(self, run_dir: Path, port: int) -> int:
        gpus = gpu_count(self.config.device)
        if 0 < gpus < self.world_size:
            log.warning("%d ranks share %d CUDA device(s): rank r uses device r mod %d",
                        self.world_size, gpus, gpus)
        codes: dict[int, int] = {}
        threads = []
        for r in range(self.world_size):
            launch = self._rank_launch(r, run_dir, port)
            self.stack.watch(r, launch.endpoints["telemetry"])
            sup = EngineSupervisor(
                launch, env=rank_env(r, self.world_size, self.config.device),
                on_ready=partial(self._rank_ready, r, launch.ready_file),
                on_exit=partial(self._rank_exit, r),
                beacon=False)   # the front end's proxy says `restarting` for the rank
            self.supervisors.append(sup)

            def target(sup: EngineSupervisor = sup, r: int = r) -> None:
                codes[r] = sup.run(install_signals=False)

            threads.append(threading.Thread(target=target, name=f"dp-rank-{r}", daemon=True))
        for t in threads:
            t.start()
        while True:
            alive = any(t.is_alive() for t in threads)
            failed = [r for r, c in sorted(codes.items()) if c != exit_codes.OK]
            if failed and self._failed is None and self._stop_signal is None:
                r = failed[0]
                print(f"vconsole engine: data-parallel rank {r}: "
                      f"{self.supervisors[r].failure or f'exit code {codes[r]}'}; "
                      + ("stopping the group" if alive else "the group stopped"),
                      file=sys.stderr)
                self._failed = codes[r]
                self._on_stop(signal.SIGTERM, None)
            if not alive:
                break
            time.sleep(POLL_S)
        if self._failed is not None:
            return self._failed
        bad = [c for c in codes.values() if c != exit_codes.OK]
        return bad[0] if bad else exit_codes.OK

    def _rank_ready(self, rank: int, ready_file: str | None, record: dict[str, Any]) -> None:
        """A rank's engine serves (its supervisor's thread): the front end connects to it."""
        self.stack.rank_ready(rank, record, ready_file)

    def _rank_exit(self, rank: int, code: int, reason: str) -> None:
        """A rank's process ended (its supervisor's thread): unless the group is stopping or
        it stopped cleanly, its supervisor restarts it."""
        restarting = self._stop_signal is None and code != exit_codes.OK
        self.stack.rank_exit(rank, reason, restarting=restarting,
                             restart_count=self.supervisors[rank].restart_count + 1)

    def _on_stop(self, signum: int, _frame: Any) -> None:
        """First SIGTERM/SIGINT: every rank drains. Another: kill them."""
        first = self._stop_signal is None
        self._stop_signal = self._stop_signal or signum
        for sup in self.supervisors:
            sup.stop(signum if first else signal.SIGKILL)
