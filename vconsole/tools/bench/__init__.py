"""`vconsole bench …`: each benchmark measures one part against its peer in the same run and
prints JSON (docs/benchmarks.md)."""
