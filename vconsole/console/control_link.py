"""The console's side of the control socket: blocking calls, made from worker threads only.

A ZeroMQ socket must not be shared between threads, and the console may fetch the config and
send a change at the same time, so every call opens its own short-lived `ControlClient` (a
DEALER connect on loopback costs well under a millisecond).

Every call carries the engine's control key when the console has one (``key``). When the engine
refuses it and ``key_file`` is known, the file is read again and the change (or profile start or
cancel) retried once: an engine restarted on the same endpoint writes a new key there.
`key_status` says which engine wrote the key held now (its owner record,
`vconsole.security.key_owner`) and whether it still runs. ``curve``: the console's CURVE keys,
for an engine started with them.

`get_trace` (the engine's request trace of its last minutes, for the console's what-if,
`vconsole.console.predictions`) is a seventh call outside `Control`: a channel that has it is
a `TraceChannel`; one without it (a test's fake) has no what-if.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vconsole.security.curve import ClientCurve
    from vconsole.security.key_owner import KeyStatus


@runtime_checkable
class Control(Protocol):
    """What `vconsole.console.steering.Steering` needs from a control channel: the six calls of
    `ControlLink` (tests pass `tests.support.console_testing.FakeControl`, which has them
    all; ``isinstance`` checks that the six are there). Every call blocks: make them from
    worker threads only."""

    def key_status(self) -> KeyStatus | None: ...

    def get_config(self) -> dict[str, Any]: ...

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]: ...

    def profile_start(self, steps: int) -> dict[str, Any]: ...

    def profile_status(self, profile_id: str) -> dict[str, Any]: ...

    def profile_cancel(self, profile_id: str) -> dict[str, Any]: ...


@runtime_checkable
class TraceChannel(Protocol):
    """A control channel that hands out the engine's request trace (`ControlLink` does)."""

    def get_trace(self, window_s: float | None = None) -> str: ...


TRACE_TIMEOUT_S = 30.0   # minutes of trace, serialized on the engine's control thread


class ControlLink:
    def __init__(self, endpoint: str, timeout_s: float = 3.0, *, key: str | None = None,
                 key_file: str | Path | None = None, curve: ClientCurve | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.key = key
        self.key_file = Path(key_file) if key_file else None
        self.curve = curve

    def _client(self) -> Any:
        from vconsole.wire.control_client import ControlClient

        return ControlClient(self.endpoint, timeout_s=self.timeout_s, key=self.key,
                             curve=self.curve)

    def key_status(self) -> KeyStatus | None:
        """Which engine wrote the key held now, and whether it runs; None without a key file.
        Reads a file and the process table: call from a worker thread."""
        from vconsole.security.key_owner import status

        if self.key is None or self.key_file is None:
            return None
        return status(self.key_file, self.key)

    def get_config(self) -> dict[str, Any]:
        with self._client() as client:
            return client.get_config()

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        return self._keyed(lambda client: client.set_config(values))

    def profile_start(self, steps: int) -> dict[str, Any]:
        """The new profile's status (`vconsole.wire.control_client.ControlClient.profile_start`)."""
        return self._keyed(lambda client: client.profile_start(steps))

    def profile_status(self, profile_id: str) -> dict[str, Any]:
        with self._client() as client:
            return client.profile_status(profile_id)

    def profile_cancel(self, profile_id: str) -> dict[str, Any]:
        return self._keyed(lambda client: client.profile_cancel(profile_id))

    def get_trace(self, window_s: float | None = None) -> str:
        """The engine's request trace of the last ``window_s`` seconds (None: all it keeps) as
        JSON lines. Open, like ``get_config``. ``get_config`` first, at the link's timeout, so
        that an engine that is not there costs that, not the longer `TRACE_TIMEOUT_S` a big
        trace may need."""
        with self._client() as client:
            client.get_config()
            client.timeout_s = max(self.timeout_s, TRACE_TIMEOUT_S)
            return str(client.get_trace(window_s))

    def _keyed(self, call: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """A call that needs the key: refused, read the key file again and retry once."""
        from vconsole.security.control_key import load_control_key
        from vconsole.wire.control_client import NotAuthorised

        try:
            with self._client() as client:
                return call(client)
        except NotAuthorised:
            fresh = (load_control_key(self.endpoint, self.key_file) if self.key_file else None)
            if fresh is None or fresh == self.key:
                raise
            self.key = fresh
        with self._client() as client:
            return call(client)
