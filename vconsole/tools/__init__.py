"""The tools around the engine and the console: the demo, the load generator, offline
`generate`, `doctor`, `top` and the benchmarks (`vconsole.tools.bench`). Each is driven by a
CLI handler in `vconsole.commands`; none is imported by the engine or the console."""
