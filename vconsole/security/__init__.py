"""Who may talk to the engine, in one place for both sides: the control key (`control_key`: the
path rule and reading it; `engine_key`: the engine making, writing, checking and removing it),
owner records that tell a stale key from a live one (`key_owner`), CURVE keys and the engine's
authenticator (`curve`, `curve_server`), the bind policy for non-loopback endpoints
(`bind_policy`) and endpoint parsing (`endpoints`). It imports nothing of the engine, the
telemetry or the console."""
