"""Plain data both sides of the wire import: the config table (`config`), the stats records
the engine fills and telemetry publishes (`stats`), the KV cache event records (`kv_events`).

Why a package of its own: the engine's scheduler, KV cache and worker build these records and
the console and telemetry read them, so they sit below both. The engine never imports the
console, telemetry never imports the engine; both import this. Standard library and numpy only.
"""
