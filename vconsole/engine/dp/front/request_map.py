"""The data-parallel front end's request ids: (client, client's request id) <-> (rank, id).

Each client scopes its own request ids (two clients may both send ``"1"``); a rank sees one
client, the front end, so the front end gives every request an id of its own, unique per rank
connection (``"<n>"`` from one counter), and maps outputs back. The entry is dropped when the
request's final output passes, or when its rank dies (`fail_rank`), so `load` is exact: a
rank's entries are its unfinished requests.

Invariants: a (client, request id) pair is in flight at most once; every entry has exactly one
rank; `pop`/`fail_rank`/`drop_client` each remove an entry once, so a request gets at most one
final output from the front end.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Routed:
    client: bytes
    request_id: str        # the client's id
    rank: int
    fe_id: str             # the id the rank knows it by


class RequestMap:
    """Owned by the front end's I/O thread only (no lock)."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._by_fe: dict[tuple[int, str], Routed] = {}
        self._by_client: dict[tuple[bytes, str], Routed] = {}
        self._per_rank: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_fe)

    def add(self, client: bytes, request_id: str, rank: int) -> Routed | None:
        """A new entry; None when this client already has ``request_id`` in flight."""
        if (client, request_id) in self._by_client:
            return None
        entry = Routed(client, request_id, rank, str(next(self._ids)))
        self._by_fe[(rank, entry.fe_id)] = entry
        self._by_client[(client, request_id)] = entry
        self._per_rank[rank] = self._per_rank.get(rank, 0) + 1
        return entry

    def lookup(self, rank: int, fe_id: str) -> Routed | None:
        return self._by_fe.get((rank, fe_id))

    def of_client(self, client: bytes, request_id: str) -> Routed | None:
        return self._by_client.get((client, request_id))

    def pop(self, rank: int, fe_id: str) -> Routed | None:
        entry = self._by_fe.pop((rank, fe_id), None)
        if entry is not None:
            del self._by_client[(entry.client, entry.request_id)]
            self._per_rank[rank] -= 1
        return entry

    def fail_rank(self, rank: int) -> list[Routed]:
        """Remove and return every entry on ``rank`` (it died: their outputs will not come)."""
        gone = [e for (r, _), e in self._by_fe.items() if r == rank]
        for e in gone:
            self.pop(e.rank, e.fe_id)
        return gone

    def drop_client(self, client: bytes) -> list[Routed]:
        """Remove and return every entry of ``client`` (it left: the caller aborts them)."""
        gone = [e for (c, _), e in self._by_client.items() if c == client]
        for e in gone:
            self.pop(e.rank, e.fe_id)
        return gone

    def load(self, ranks: list[int]) -> dict[int, int]:
        """Unfinished requests per rank (0 for a rank with none)."""
        return {r: self._per_rank.get(r, 0) for r in ranks}
