"""Data-parallel ranks as Ray actors (``--data-parallel-backend ray``, issue #33).

`launcher` (the group: front end, store, one keeper thread per rank: placement group, actor,
restarts), `actor` (`RankActor`: the same rank loop as a process rank, in a Ray worker),
`cluster` (join a Ray cluster or start and own a local one). Only these modules import ``ray``,
and only when this backend is chosen.
"""
