"""Where a data-parallel rank stands and how it finds the others: `DPEnv` and the store.

`DPEnv` says which rank this process is, of how many, and where the rendezvous store listens.
It comes from the engine's flags (``--data-parallel-size``, ``--dp-rank``, ``--dp-master-addr``,
``--dp-master-port``) or from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``): a flag wins; the environment fills only what the flags left
unset. `DPEnv.from_config` treats a config value equal to its default as unset (the config does
not remember which keys came from a flag), so ``--data-parallel-size 1`` under torchrun still
takes ``WORLD_SIZE``.

The store is a ``torch.distributed.TCPStore``; a rank is always a *client* of it: the
``vconsole engine --data-parallel-size N`` launcher hosts the master, and under torchrun the
elastic agent hosts it at ``MASTER_ADDR:MASTER_PORT`` (its workers get
``TORCHELASTIC_USE_AGENT_STORE=True``; checked with torchrun 2.13). Keys live under ``vconsole/``:
``vconsole/rank/{r}`` holds rank r's ready record as JSON (`publish_rank`, `read_rank`), and
each group generation g forms under ``vconsole/g{g}`` (`vconsole.engine.dp.rank.group`).

Failures are explicit: a store that cannot be reached raises `RendezvousError` (an `OSError`, so
`vconsole engine` exits with ``exit_codes.CANNOT_START`` and the message), a record that does not
appear in time raises `TimeoutError`, and inconsistent values (rank >= world size, a non-integer
``RANK``) raise `ValueError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from vconsole.shared.config import EngineConfig, validate_config

if TYPE_CHECKING:
    import torch.distributed as dist

KEY_PREFIX = "vconsole/"
DEFAULT_MASTER_ADDR = "127.0.0.1"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RendezvousError(OSError):
    """The rendezvous store cannot be reached: this rank cannot join its group."""


def rank_key(rank: int) -> str:
    return f"{KEY_PREFIX}rank/{rank}"


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class DPEnv:
    """This rank's place in the group. ``master_port`` None: no store (a rank that only serves
    uncoordinated, e.g. a test that drives it by hand)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None
    from_torchrun: bool = False   # RANK and WORLD_SIZE came from the environment

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"data-parallel size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"data-parallel rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"data-parallel master port {self.master_port} is not a TCP port")

    @property
    def is_rank(self) -> bool:
        """Part of a group of two or more (a lone engine is not)."""
        return self.world_size > 1

    @property
    def has_store(self) -> bool:
        return self.master_port is not None

    @classmethod
    def resolve(cls, *, rank: int | None = None, world_size: int | None = None,
                master_addr: str | None = None, master_port: int | None = None,
                environ: Mapping[str, str] | None = None) -> DPEnv:
        """Flags (None = unset) over torchrun's environment over the defaults. The environment's
        ``RANK``/``WORLD_SIZE`` count only when both are set (a torchrun worker)."""
        env = os.environ if environ is None else environ
        env_rank, env_world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        torchrun = env_rank is not None and env_world is not None
        if world_size is None:
            world_size = env_world if torchrun and env_world is not None else 1
        if rank is None:
            rank = env_rank if torchrun and env_rank is not None else 0
        local_rank = _env_int(env, "LOCAL_RANK") if torchrun else None
        if master_addr is None:
            master_addr = env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
        if master_port is None:
            master_port = _env_int(env, "MASTER_PORT")
        return cls(rank=rank, world_size=world_size,
                   local_rank=rank if local_rank is None else local_rank,
                   master_addr=master_addr, master_port=master_port, from_torchrun=torchrun)

    @classmethod
    def from_config(cls, config: EngineConfig, environ: Mapping[str, str] | None = None
                    ) -> DPEnv:
        """`resolve` with the config's dp keys as flags, a key at its default counting as
        unset."""
        default = EngineConfig()
        def flag(key: str) -> Any:
            value = getattr(config, key)
            return None if value == getattr(default, key) else value
        return cls.resolve(rank=flag("dp_rank"), world_size=flag("data_parallel_size"),
                           master_addr=flag("dp_master_addr"), master_port=flag("dp_master_port"),
                           environ=environ)

    def apply(self, config: EngineConfig) -> EngineConfig:
        """``config`` with this rank's dp keys (torchrun's values become the config's, so the
        ready record, telemetry ``rank`` and ``get_config`` tell the truth)."""
        values = {**config.to_dict(), "data_parallel_size": self.world_size,
                  "dp_rank": self.rank, "dp_master_addr": self.master_addr,
                  "dp_master_port": self.master_port}
        return config if values == config.to_dict() else validate_config(values)


def connect_store(env: DPEnv, timeout_s: float) -> dist.TCPStore:
    """A client of the group's store. Raises `RendezvousError` if it cannot be reached within
    about ``timeout_s`` (which also bounds every later wait on it)."""
    import torch.distributed as dist

    if env.master_port is None:
        raise RendezvousError("no data-parallel store configured (set --dp-master-port, or run "
                              "under torchrun)")
    try:
        return dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:   # DistNetworkError / DistStoreError are RuntimeErrors
        raise RendezvousError(
            f"cannot reach the data-parallel store at {env.master_addr}:{env.master_port} "
            f"within {timeout_s:g} s (is the launcher, or torchrun's agent, running?): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def publish_rank(store: dist.Store, rank: int, record: Mapping[str, Any]) -> None:
    """Announce rank ``rank``'s ready record (endpoints, control key file, pid, ...): the
    front end reads it with `read_rank`. A restarted rank overwrites its predecessor's."""
    store.set(rank_key(rank), json.dumps(dict(record)))


def read_rank(store: dist.Store, rank: int, timeout_s: float) -> dict[str, Any]:
    """Rank ``rank``'s ready record, waiting up to ``timeout_s`` for it to appear. Raises
    `TimeoutError` if it does not."""
    key = rank_key(rank)
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        raw = store.get(key)
    except RuntimeError as e:
        raise TimeoutError(f"data-parallel rank {rank} published no ready record within "
                           f"{timeout_s:g} s: {str(e).splitlines()[0] if str(e) else e!r}"
                           ) from None
    record = json.loads(raw)
    if not isinstance(record, dict):
        raise ValueError(f"data-parallel rank {rank}: the store holds no ready record at {key}")
    return record
