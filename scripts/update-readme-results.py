#!/usr/bin/env python3
"""Regenerate the README's results section from a finished `make demo` (its leaderboard.md and env).

    .venv/bin/python scripts/update-readme-results.py [runs/demo]

Replaces everything between `<!-- results:begin -->` and `<!-- results:end -->` in README.md with the
machine the run measured on and the report's markdown (table, claims, recommendation): the numbers are
copied from the results, never typed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def main() -> None:
    runs = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "runs" / "demo")
    board = runs / "leaderboard.md"
    if not board.is_file():
        sys.exit(f"error: {board} not found; run `make demo` first")
    env = next((json.loads(p.read_text()).get("env") for p in sorted(runs.glob("*/result.json"))), {}) or {}
    machine = (f"Measured by `make demo` on: {env.get('cpu', '?')} ({', '.join(env.get('cpu_flags') or []) or 'no flags'}), "
               f"{env.get('cores', '?')} cores, {env.get('threads', '?')} threads, "
               f"{(env.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, memory bandwidth "
               f"{env.get('mem_bandwidth_gb_s', 0):.1f} GB/s (measured), torch {env.get('torch', '?')}, "
               f"transformers {env.get('transformers', '?')}, accelerator {env.get('accelerator') or 'none'}.")
    body = board.read_text().replace("# infer-tune leaderboard", "#### Leaderboard", 1)
    body = body.replace("\n## Claims", "\n#### Claims").replace("\n## Recommended configuration", "\n#### Recommended configuration")
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"error: README.md lacks the {BEGIN} / {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{machine}\n\n{body.strip()}\n{END}{tail}")
    print(f"README.md results regenerated from {board}")


if __name__ == "__main__":
    main()
