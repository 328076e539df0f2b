"""Scenarios: the library layer below the CLI. Each builds a run (model, workload, protocol, context),
runs a sweep through `sweep.run_configs` (or its own loop) and returns data; the CLI parses, calls
one scenario function and renders what it returns. See docs/architecture.md."""
