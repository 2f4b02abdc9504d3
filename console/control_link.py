"""The console's side of the control socket: blocking calls, made from worker threads only.

A ZeroMQ socket must not be shared between threads, and the console may fetch the config and
send a change at the same time, so every call opens its own short-lived `ControlClient` (a
DEALER connect on loopback costs well under a millisecond).
"""

from __future__ import annotations

from typing import Any, Protocol


class Control(Protocol):
    """What the app needs from a control channel (tests pass a fake with these two)."""

    def get_config(self) -> dict[str, Any]: ...

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]: ...


class ControlLink:
    def __init__(self, endpoint: str, timeout_s: float = 3.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s

    def _client(self) -> Any:
        from telemetry.control import ControlClient

        return ControlClient(self.endpoint, timeout_s=self.timeout_s)

    def get_config(self) -> dict[str, Any]:
        with self._client() as client:
            return client.get_config()

    def set_config(self, values: dict[str, Any]) -> dict[str, Any]:
        with self._client() as client:
            return client.set_config(values)
