"""`DPGroup`: one generation of the ranks' ``torch.distributed`` process group.

The group exists for one question asked every few steps: "is any rank busy?" (`any_busy`, an
all-reduce MAX of one element), plus agreeing on a number when it forms (`agree_max`). It is
formed from the shared store under the prefix ``vconsole/g{generation}`` (each generation's
rendezvous keys are fresh, so a group re-formed after a rank restarted never reads the old
one's). Backend: ``gloo`` on CPU; on CUDA ``cpu:gloo,cuda:nccl`` — nccl for collectives on
device tensors (created lazily, at the first one), while the coordination all-reduce itself
always runs on a CPU tensor over gloo, as vLLM's DP engines do with their CPU group: one int
needs no device round trip, and it still works when several ranks share one GPU (which nccl
refuses).

It is the process's *default* group (``init_process_group``): one per process at a time, so a
new generation needs `destroy` of the old one first. Forming blocks until every rank joined, at
most ``timeout_s``; each collective is bounded by the same timeout.

States: ``"forming"`` → ``"ok"`` → ``"broken"`` (a collective failed: a peer died or hung past
the timeout) or ``"destroyed"``. Any failure raises `GroupBroken`; a broken group is never used
again (the rank serves uncoordinated until the front end sends the next generation).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist


class GroupBroken(RuntimeError):
    """The group could not form, or one of its collectives failed."""


class DPGroup:
    def __init__(self, store: dist.Store, rank: int, world_size: int, generation: int,
                 timeout_s: float, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        self.state = "forming"
        self._store = dist.PrefixStore(f"vconsole/g{generation}", store)

    def form(self) -> None:
        """Join the group; blocks until all ``world_size`` ranks joined (at most
        ``timeout_s``). Raises `GroupBroken` on a timeout or any other failure."""
        if dist.is_initialized():
            raise RuntimeError("another process group is still alive in this process; "
                               "destroy it before forming a new generation")
        try:
            dist.init_process_group(self.backend, store=self._store, rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            self.state = "broken"
            raise GroupBroken(f"group generation {self.generation} did not form within "
                              f"{self.timeout_s:g} s: {_first_line(e)}") from None
        self.state = "ok"

    def any_busy(self, busy: bool) -> bool:
        """True if any rank passed ``busy=True``. Raises `GroupBroken` if a peer is gone."""
        return bool(self._all_reduce_max(1 if busy else 0))

    def agree_max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        return self._all_reduce_max(value)

    def _all_reduce_max(self, value: int) -> int:
        if self.state != "ok":
            raise GroupBroken(f"group generation {self.generation} is {self.state}")
        t = torch.tensor([value], dtype=torch.int64)     # CPU: gloo, see the docstring
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except Exception as e:   # gloo: RuntimeError "Connection closed by peer", timeouts
            self.state = "broken"
            raise GroupBroken(f"group generation {self.generation}: all-reduce failed: "
                              f"{_first_line(e)}") from None
        return int(t.item())

    def destroy(self) -> None:
        """Leave the group (idempotent); peers blocked in a collective with us then fail."""
        if self.state in ("ok", "broken") and dist.is_initialized():
            # A broken backend may complain while tearing down; the group is gone either way.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if self.state != "broken":
            self.state = "destroyed"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
