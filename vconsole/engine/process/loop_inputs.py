"""What the busy loop's input queue carries: one small frozen dataclass per kind of input.

The input thread, the prepare pool, the control and output threads, the config watcher and
signal handlers put these on the queue; only the busy loop takes them off, between two steps
(`EngineCoreProc._handle_input` matches on the type). The queue is a ``SimpleQueue``, which a
signal handler may use (reentrant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vconsole.engine.process.control_server import ControlCall
    from vconsole.engine.request import Request
    from vconsole.wire.protocol import AddMessage


@dataclass(frozen=True, slots=True)
class Add:
    """A client's ``add``, parsed."""
    client_id: bytes
    msg: AddMessage


@dataclass(frozen=True, slots=True)
class AddReady:
    """A long text prompt tokenized off the loop: the request, or why it was refused."""
    engine_id: str
    client_id: bytes
    result: Request | str


@dataclass(frozen=True, slots=True)
class Reject:
    """A message naming ``request_id`` that could not be read."""
    client_id: bytes
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Abort:
    client_id: bytes
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Control:
    """A control call (``set_config``, ``profile_*``), answered once applied."""
    call: ControlCall


@dataclass(frozen=True, slots=True)
class ClientGone:
    """The output thread dropped this client: abort its requests."""
    client_id: bytes


@dataclass(frozen=True, slots=True)
class Reload:
    """Re-read the config file (SIGHUP, or the watcher saw it change)."""
    reason: str


@dataclass(frozen=True, slots=True)
class FrontEnd:
    """A data-parallel front end's ``regroup`` or ``start_wave`` (ranks only)."""
    kind: str
    value: int


@dataclass(frozen=True, slots=True)
class Wake:
    """A grammar finished compiling (a compile thread): the loop, asleep while every request
    waited for its grammar, looks again."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Drain and stop (a signal, a client, or the loop itself)."""
    reason: str


LoopInput = (Add | AddReady | Reject | Abort | Control | ClientGone | Reload | FrontEnd | Wake
             | Shutdown)
