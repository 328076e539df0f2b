"""`python -m infer_tune.engines.probe ENGINE ARGS_JSON`: one in-process engine's configuration built and run for
a few tokens in a process of its own (engines/crash.py `run_child`), before infer-tune loads it into its own
process: if the engine dies here (SIGILL, SIGSEGV, the OOM killer) or hangs, that is the configuration's
crashed row, and the search goes on. Calls `ENGINES[ENGINE].probe(args)`; exit 0 when it returns, 3 with one
line when the engine refuses the configuration (an exception)."""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m infer_tune.engines.probe ENGINE ARGS_JSON", file=sys.stderr)
        return 2
    from infer_tune.engines.base import ENGINES

    engine = ENGINES[argv[0]]
    if engine.probe is None:
        print(f"engine {engine.name} has no probe", file=sys.stderr)
        return 2
    try:
        engine.probe(json.loads(argv[1]))
    except Exception as exc:  # noqa: BLE001 (the engine refused it: one line for the parent's refused row)
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
        return 3
    print("probe ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
