"""What the output thread's queue carries: one small frozen dataclass per kind of message.

The busy loop (outputs, a rank's wave messages, `STOP`) and the input thread (``hello``, a
message that named no request) put these on the queue; only the output thread takes them off
(`vconsole.engine.process.output_thread.OutputThread` matches on the type), as
`vconsole.engine.process.loop_inputs` does for the busy loop's own queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vconsole.wire.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class Hello:
    """A client said ``hello``: answer ``ready`` once its output connection is known."""
    client_id: bytes


@dataclass(frozen=True, slots=True)
class Outputs:
    """One step's outputs for one client. ``to_detokenize``: finished outputs whose ``text``
    the output thread fills in (with the request's every output token id) before sending, so
    the busy loop never decodes."""
    client_id: bytes
    outputs: list[RequestOutput]
    to_detokenize: list[tuple[RequestOutput, list[int]]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Error:
    """An ``error`` for one client: ``request_id`` None when the message named none;
    ``in_flight``: that request goes on."""
    client_id: bytes
    reason: str
    request_id: str | None
    in_flight: bool


@dataclass(frozen=True, slots=True)
class Wave:
    """A data-parallel rank's ``wave`` message, to every handshaken client."""
    event: str
    wave: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Flush what was queued before it, close the socket, end."""


STOP = Stop()

OutputItem = Hello | Outputs | Error | Wave | Stop
