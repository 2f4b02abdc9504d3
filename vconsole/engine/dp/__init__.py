"""Data parallel: several engine ranks behind one front end (issue #12).

Rank side (`rank`) — what makes one `EngineCoreProc` a rank; it builds on
`vconsole.engine.process`, which never imports this package: `choose` (the launcher's pick of
the process's role), `engine_role` (`RankRole`: the rank's seat in the busy loop, its waves
announced), `role` (`DPRank`: the coordination, counters and the ``dp``/``wave`` bodies),
`rendezvous` (which rank, of how many, where the store is; the store's keys), `group` (the
``torch.distributed`` process group of one generation), `wave` (the wave state machine, pure
logic).

Front-end side (`front`) — the public endpoints of the group: `torchrun` (the front end in
torchrun's global rank 0), `stack` (the public sockets as one object), `requests` (requests),
`router` and `request_map` (which rank, which id), `control_fanout` (config for N ranks),
`telemetry_proxy` (every rank's telemetry on one endpoint). `launcher` (single host: store,
supervised ranks, front end) starts both sides;
`ray` runs the ranks as Ray actors instead (``--data-parallel-backend ray``).

`choose`, `wave` and `rendezvous` import no torch at load time (a lone engine reads `DPEnv` to
learn that it is not a rank, before its sockets are bound).
"""
