"""Which client owns which request: request ids are scoped per client.

A client names its requests as it likes; two clients may use the same ids, and neither can block
or finish the other's requests. The engine core, however, needs one id per request. The registry
gives each (client, request id) in flight an *engine request id* ``"N:REQUEST_ID"``, where ``N``
is a small number the client holds while it has requests in flight (so telemetry shows which
requests belong together, and the table of numbers never grows beyond the active clients).

Invariants: ``open`` refuses a (client, request id) that is already in flight, so each engine id
names exactly one live request; every engine id maps back to its client and the client's own id
until ``close``; a client's number is released when its last request closes. Used by the busy
loop only (one thread), so there is no locking.
"""

from __future__ import annotations

import itertools


class RequestRegistry:
    def __init__(self) -> None:
        self._engine_ids: dict[tuple[bytes, str], str] = {}
        self._owners: dict[str, tuple[bytes, str]] = {}
        self._clients: dict[bytes, tuple[int, set[str]]] = {}   # client -> (number, engine ids)
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._owners)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._owners

    def open(self, client_id: bytes, request_id: str) -> str | None:
        """The new request's engine id, or None when this client has that id in flight."""
        key = (client_id, request_id)
        if key in self._engine_ids:
            return None
        entry = self._clients.get(client_id)
        if entry is None:
            entry = self._clients[client_id] = (next(self._numbers), set())
        engine_id = f"{entry[0]}:{request_id}"
        entry[1].add(engine_id)
        self._engine_ids[key] = engine_id
        self._owners[engine_id] = key
        return engine_id

    def lookup(self, client_id: bytes, request_id: object) -> str | None:
        """The engine id of this client's request in flight, else None. A malformed message may
        name anything as its request id (a list, a map): that is None too, never an error."""
        if not isinstance(request_id, str):
            return None
        return self._engine_ids.get((client_id, request_id))

    def owner(self, engine_id: str) -> tuple[bytes, str] | None:
        """(client id, the client's request id) of a request in flight."""
        return self._owners.get(engine_id)

    def close(self, engine_id: str) -> None:
        """The request finished (its final output is on its way); unknown ids are ignored."""
        key = self._owners.pop(engine_id, None)
        if key is None:
            return
        del self._engine_ids[key]
        number, ids = self._clients[key[0]]
        ids.discard(engine_id)
        if not ids:
            del self._clients[key[0]]

    def of_client(self, client_id: bytes) -> list[str]:
        entry = self._clients.get(client_id)
        return sorted(entry[1]) if entry else []

    def engine_ids(self) -> list[str]:
        return list(self._owners)
