"""The engine process's publishing: the telemetry publisher and its loop, the Prometheus
exporter, the DP/supervisor beacon, the host probe and vLLM's KV event publisher.

Why beside the engine process: only the engine's process, launch and data-parallel packages run
them. What they put on the wire (the schema, the KV event wire form, vLLM's metric names) lives
in `vconsole.telemetry`, which the console reads too.
"""
