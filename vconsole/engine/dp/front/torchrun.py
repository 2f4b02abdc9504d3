"""TorchrunFrontEnd: the data-parallel front end when torchrun launched the ranks.

Under ``torchrun --nnodes ... --nproc-per-node ... -m vconsole engine ...`` every worker is one
rank (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` from the environment;
`vconsole.engine.dp.rank.rendezvous.DPEnv`): it serves on private ``tcp://127.0.0.1:*``
endpoints (see "Several hosts" below) and publishes its ready record in the store that torchrun's agent hosts. Global rank
0's process also runs this front end, in threads, on the PUBLIC endpoints of the command line:
it reads every rank's record from the store (`read_rank`, waiting for ranks still loading) and
then serves exactly as the single-host launcher's front end does
(`vconsole.engine.dp.front.stack.FrontEndStack`).

What differs: nothing restarts one rank (torchrun's ``--max-restarts`` restarts the whole
group); a rank whose heartbeats stop is taken out of routing and its requests fail with an
error naming it.

Several hosts: a rank registers its endpoints as it bound them, so the front end can reach a
rank on another host only when that rank binds an address of its host (``--dp-rank-host``,
`rank_endpoints`). Its sockets can then change the engine from the network, so beyond loopback
they must be CURVE servers (``--dp-curve-dir DIR``, `rank_curves`: the ranks' server pair and
an allow-list holding the front end's key only); the front end connects to every rank as that
CURVE client, and learns each rank's control key from the rank's ``ready`` over that channel
(the rank's key file is on the rank's host). Invariant: the bind policy
(`vconsole.security.bind_policy.check_endpoints`) refuses a remote rank host without keys
before anything binds, the public endpoints included.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from vconsole.engine.dp.front.stack import FrontEndStack, without_refused_text
from vconsole.engine.dp.rank.rendezvous import DPEnv, connect_store, read_rank
from vconsole.security.bind_policy import request_text_refusal
from vconsole.security.curve import (
    AUTHORIZED_CLIENTS,
    CLIENT,
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
    SERVER,
    ClientCurve,
    load_client_curve,
)

if TYPE_CHECKING:
    from vconsole.engine.launch.launch import EngineLaunch
    from vconsole.security.curve_server import ServerCurve

log = logging.getLogger("vconsole.engine.dp")

DEFAULT_RANK_HOST = "127.0.0.1"
WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})


def rank_endpoints(names: Iterable[str], host: str | None) -> dict[str, str]:
    """A rank's private endpoints: ``tcp://HOST:*`` for every socket name. ``host`` must be an
    IPv4 address (or interface) the front end can connect to (what the rank registers is what
    it bound), so a wildcard is refused (`ValueError`), and IPv6, which engine sockets do not
    enable, too."""
    bare = (DEFAULT_RANK_HOST if host is None else host).strip()
    if bare in WILDCARDS or "/" in bare or ":" in bare:
        raise ValueError(f"--dp-rank-host {host!r}: give this node's IPv4 address that the "
                         "front end's host can reach (a rank registers the address it bound, "
                         "and a wildcard address cannot be connected to)")
    return dict.fromkeys(names, f"tcp://{bare}:*")


def rank_launch(launch: EngineLaunch, private: Mapping[str, str], *, public_curve: bool,
                front_end: bool) -> EngineLaunch:
    """This worker's rank: ``launch`` on its ``private`` endpoints, without the group's
    /metrics, control key file, ready file and remote telemetry (the front end's). Request text
    is decided by the PUBLIC telemetry endpoint (``public_curve``: its CURVE keys), as the
    single-host launcher does: refused there, it starts off on every rank (the front end's
    proxy strips whatever a rank still sends)."""
    refusal = request_text_refusal(launch.endpoints["telemetry"], public_curve)
    launch = without_refused_text(launch, refusal, warn=front_end)
    return replace(launch, endpoints=dict(private), ready_file=None, metrics=None,
                   control_key_file=None, allow_remote=False)


def rank_curves(curve_dir: str | os.PathLike[str] | None, *, front_end: bool
                ) -> tuple[ServerCurve | None, ClientCurve | None]:
    """``--dp-curve-dir DIR`` (a `vconsole keys DIR` folder): the ranks' CURVE server keys
    (DIR/server.key_secret, allow-list DIR/authorized_clients/) and, for the process that runs
    the front end, its client keys (DIR/server.key, DIR/client.key_secret). (None, None)
    without a folder. Raises `CurveKeyError` naming the file that is wrong."""
    if not curve_dir:
        return None, None
    from vconsole.security.curve_server import load_server_curve

    root = Path(curve_dir).expanduser()
    server = load_server_curve(root / f"{SERVER}{SECRET_SUFFIX}", root / AUTHORIZED_CLIENTS)
    client = (load_client_curve(root / f"{SERVER}{PUBLIC_SUFFIX}", root / f"{CLIENT}{SECRET_SUFFIX}")
              if front_end else None)
    return server, client


class TorchrunFrontEnd:
    """Bound at construction (a busy public port fails the rank before it loads its model);
    `start` (once this rank serves) finds the ranks in a thread; `close` undoes it all."""

    def __init__(self, launch: EngineLaunch, *, curve: ServerCurve | None = None,
                 rank_curve: ClientCurve | None = None) -> None:
        """``curve``: the public endpoints' server keys; ``rank_curve``: the front end's
        client keys for the ranks (`rank_curves`)."""
        self.env = DPEnv.from_config(launch.config)
        self.timeout_s = launch.config.dp_group_timeout_s
        self.stack = FrontEndStack.for_launch(launch, self.env.world_size, curve=curve,
                                              liveness=True, rank_curve=rank_curve)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._find_ranks, name="dp-find-ranks",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _find_ranks(self) -> None:
        try:
            store = connect_store(self.env, self.timeout_s)
            for rank in range(self.env.world_size):
                while not self._stop.is_set():
                    try:
                        record = read_rank(store, rank, 1.0)
                        break
                    except TimeoutError:
                        continue
                else:
                    return
                self.stack.rank_ready(rank, record)
        except OSError as e:
            log.error("the data-parallel front end cannot find its ranks: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.stack.close()
