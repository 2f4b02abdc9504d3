"""Data parallel: several engine ranks behind one front end (issue #12).

Rank side — what makes one `EngineCoreProc` a rank (`vconsole.engine.process.core_proc` calls it
between steps): `rendezvous` (which rank, of how many, where the store is; the store's keys),
`group` (the ``torch.distributed`` process group of one generation), `wave` (the wave state
machine, pure logic), `rank` (`DPRank`: the glue, counters and the ``dp``/``wave`` telemetry).

Front-end side — the public endpoints of the group: `launcher` (single host: store, supervised
ranks, front end), `torchrun` (the front end in torchrun's global rank 0), `stack` (the public
sockets as one object), `frontend` (requests), `router` and `request_map` (which rank, which
id), `control_fanout` (config for N ranks), `telemetry_proxy` (every rank's telemetry on one
endpoint).

`wave` and `rendezvous` import no torch at load time (a lone engine reads `DPEnv` to learn that
it is not a rank, before its sockets are bound).
"""
