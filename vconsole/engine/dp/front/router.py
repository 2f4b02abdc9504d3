"""Which data-parallel rank gets a new request: the least-loaded live one (a pure function).

Load is the rank's unfinished requests as the front end counts them (waiting + running: every
request it routed there and has not seen finish, exact by construction). Ties go to the rank
whose KV pool is the least used (its latest ``kv`` telemetry ``usage``; a rank not heard from
yet counts as 0), then to the lowest rank, so the choice is deterministic for a given state.

Invariant: the result is always one of the live ranks; with none live it is None.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def choose_rank(live: Iterable[int], load: Mapping[int, int],
                kv_usage: Mapping[int, float] | None = None) -> int | None:
    """The rank for the next request: min by (load, KV usage, rank) over ``live``."""
    usage = kv_usage or {}
    ranks = list(live)
    if not ranks:
        return None
    return min(ranks, key=lambda r: (load.get(r, 0), usage.get(r, 0.0), r))
