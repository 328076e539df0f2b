"""`infer-tune serve` now against `infer-tune serve` at an earlier commit, under the same single-turn Poisson load
on the same clock: did a change to the server make throughput, TPOT or TTFT worse than it was?

`--then REV` is checked out into a temporary git worktree (removed at the end); each checkout's own
`python -m infer_tune serve` runs with the same flags (its tree first on PYTHONPATH and as its working
directory) on a free loopback port, both servers up for the whole run. Per repeat and rate, a seeded Poisson
trace (seed + repeat: every repeat new arrivals, the same for both) of `--requests` chat prompts, each asking
for `--max-new-tokens` tokens with `ignore_eos`, is sent to one server and then the other (which goes first
alternates with repeat + rate), by the same client `bench/serving_vs_llamacpp.py` drives llama-server with
(infer_tune/endpoint). Each server's outputs under load are compared with its own outputs for each prompt sent
alone (mismatches), and the two servers' outputs alone are compared with each other.

    flock /tmp/infer-tune-cpu.lock python bench/serve_then_now.py --then f57ece0 --threads 2 --native-step \\
        --activations int8 --rates 1,2,4,8 --repeats 6 --state /tmp/then-now.json
    python bench/serve_then_now.py --table --state /tmp/then-now.json [--markdown] [--pool /tmp/more.json]

The table gives, per rate, now / then of output throughput, TPOT p50 and TTFT p50: the geometric mean of the
per-repeat ratios and its 95% t-interval on the logs, and two verdicts per metric decided by the interval only:
"better" / "worse" when it excludes 1.0 (else "inconclusive"), and "no worse within M" when the whole
interval lies on the good side of 1 + M (`--margin`, default 0.05: TPOT and TTFT upper bound <= 1.05,
throughput lower bound >= 1 / 1.05). A state file that exists with the same arguments is resumed (rows already
measured are kept; `--fresh` starts it again).

`serve` keeps its prefix cache on by default, and every repeat and rate sends the same prompts, so a server that
has one holds them after their first send and skips most of their prefill (a lower TTFT, and fewer prompt rows
beside the decode rows, so a lower TPOT too); an earlier server without one recomputes them.
`--now-arg=--no-prefix-cache` (arguments for the server now only) measures the engine without that help.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving_vs_llamacpp import (  # noqa: E402
    ROOT,
    Side,
    against,
    fmt_ratio,
    git_commit,
    infer_tune_server,
    paired_ratios,
    save,
    spec_of,
)

METRICS = (("throughput_tok_s", "output tok/s", True), ("tpot_p50", "TPOT p50 ms", False),
           ("ttft_p50", "TTFT p50 ms", False))
SAME_ARGS = ("then", "then_commit", "rates", "requests", "prompts", "suite", "batch", "max_new_tokens",
             "max_prompt_tokens", "context", "method", "activations", "native_step", "kv_cache", "threads", "seed",
             "serve_arg", "now_arg", "model")


@contextlib.contextmanager
def worktree(rev: str):
    """`rev` checked out (detached) in a temporary git worktree of this checkout; removed on the way out."""
    where = Path(tempfile.mkdtemp(prefix="infer-tune-then-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(where), rev], check=True,
                   capture_output=True, text=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False,
                       capture_output=True)


def resolve(rev: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise SystemExit(f"--then {rev}: not a commit of this repository")
    return out.stdout.strip()


def measure(args, state: dict) -> None:
    from infer_tune.endpoint.arrivals import poisson_trace

    spec = spec_of(args)
    slo = {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot}
    done = {(r["repeat"], r["rate"], r["engine"]) for r in state["rows"]}
    with worktree(args.then) as then_tree, \
            infer_tune_server(args, name="then", root=then_tree) as then_server, \
            infer_tune_server(args, tuple(args.now_arg), name="now") as now_server:
        now, then = Side(now_server, args, spec), Side(then_server, args, spec)
        n_prompts = len(now.run.inputs.prompts)
        traces = {(repeat, rate): poisson_trace(args.requests, rate, n_prompts, seed=args.seed + repeat,
                                                max_new_tokens=args.max_new_tokens)
                  for repeat in range(args.repeats) for rate in args.rates}
        used = sorted({r.prompt_index for t in traces.values() for r in t})
        for side in (now, then):
            side.references(used)
        differ = [p for p in used if now.alone.get(p) != then.alone.get(p)]
        state["outputs_alone_differ"] = len(differ)
        print(f"outputs of each prompt alone: now and then differ on {len(differ)}/{len(used)} prompts", flush=True)
        for repeat in range(args.repeats):
            for k, rate in enumerate(args.rates):
                order = (now, then) if (repeat + k) % 2 == 0 else (then, now)
                for side in order:
                    if (repeat, rate, side.server.name) in done:
                        continue
                    row = side.measure(traces[(repeat, rate)], rate, repeat, slo)
                    state["rows"].append(row)
                    print(f"r{repeat} {rate:g} req/s {row['engine']}: {row['throughput_tok_s']:.1f} tok/s, TPOT p50 "
                          f"{row['tpot_p50']:.2f} ms, TTFT p50 {row['ttft_p50']:.1f} ms, mismatches "
                          f"{row['mismatches']}", flush=True)
                    save(args, state)


def verdicts(r: dict, higher: bool, margin: float) -> tuple[str, str]:
    """(against 1.0: better / worse / inconclusive, non-inferiority: "no worse within M" / "not shown"), both
    from the interval by serving_vs_llamacpp's `against`."""
    plain = {"met": "better", "missed": "worse"}.get(against(r, 1.0, higher), "inconclusive")
    held = against(r, 1.0 / (1.0 + margin) if higher else 1.0 + margin, higher) == "met"
    return plain, f"no worse within {margin:.0%}" if held else "not shown"


def same_package(a: str | None, b: str | None) -> bool:
    """Whether commits `a` and `b` hold the same infer_tune/ (what `serve` runs); a bench-only change between them
    keeps their runs comparable."""
    if not a or not b:
        return False
    return a == b or subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", a, b, "--", "infer_tune"],
                                    check=False, capture_output=True).returncode == 0


def pooled(state: dict, others: list[str]) -> dict:
    """`state` with the repeats of the state files `others` added (renumbered after its own): each must have run
    the same two servers on the same load (SAME_ARGS but the rates and the seed) with seeds no other one used, so
    every pooled repeat is a trace of its own."""
    rows, args = list(state["rows"]), state["args"]
    used = set(range(args["seed"], args["seed"] + 1 + max((r["repeat"] for r in rows), default=0)))
    for name in others:
        other = json.loads(Path(name).read_text())
        a = other["args"]
        differ = [k for k in SAME_ARGS  # an argument an older run did not have reads as its empty default
                  if k not in ("rates", "seed") and (a.get(k) or None) != (args.get(k) or None)]
        if differ or not same_package(other.get("infer_tune_commit"), state.get("infer_tune_commit")):
            raise SystemExit(f"--pool {name}: not the same servers and load "
                             f"({', '.join(differ) or 'the package at the two commits'} differ)")
        seeds = set(range(a["seed"], a["seed"] + 1 + max((r["repeat"] for r in other["rows"]), default=0)))
        if seeds & used:
            raise SystemExit(f"--pool {name}: its seeds {min(seeds)}-{max(seeds)} overlap the runs already pooled")
        used |= seeds
        offset = 1 + max((r["repeat"] for r in rows), default=-1)
        rows += [{**r, "repeat": r["repeat"] + offset} for r in other["rows"]]
    return {**state, "rows": rows}


def table(state: dict, markdown: bool = False) -> None:
    rows, margin = state["rows"], state["args"]["margin"]
    now_args = " ".join(state["args"].get("now_arg") or [])
    print(f"now {state.get('infer_tune_commit')}{' ' + now_args if now_args else ''} against then "
          f"{state['args']['then_commit']}; "
          f"{state['args']['requests']} requests x {state['args']['max_new_tokens']} tokens, "
          f"{state['args']['batch']} slots; outputs alone differing: {state.get('outputs_alone_differ')}")
    head = ["rate req/s", "repeats", *(name + " now/then" for _, name, _ in METRICS), "mismatches now/then"]
    body = []
    for rate in sorted({r["rate"] for r in rows}):
        ratios = paired_ratios(rows, rate, "now", "then", metrics=METRICS)
        cells = [f"{rate:g}", str(ratios["repeats"])]
        for key, _, higher in METRICS:
            plain, held = verdicts(ratios[key], higher, margin)
            cells.append(f"{fmt_ratio(ratios[key])} {plain}; {held}")
        mism = [sum(r["mismatches"] for r in rows if r["rate"] == rate and r["engine"] == e) for e in ("now", "then")]
        cells.append(f"{mism[0]}/{mism[1]}")
        body.append(cells)
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for cells in body:
            print("| " + " | ".join(cells) + " |")
    else:
        for cells in body:
            print("  ".join(f"{h}: {c}" for h, c in zip(head, cells)))
    for rate in sorted({r["rate"] for r in rows}):
        for e in ("then", "now"):
            mine = [r for r in rows if r["rate"] == rate and r["engine"] == e]
            print(f"{rate:g} req/s {e}: TPOT p50 {[round(r['tpot_p50'], 2) for r in mine]} ms, TTFT p50 "
                  f"{[round(r['ttft_p50'], 1) for r in mine]} ms, tok/s {[round(r['throughput_tok_s'], 1) for r in mine]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--then", help="the earlier commit (any git revision) whose serve is the baseline")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8", choices=("bf16", "int8"))
    p.add_argument("--native-step", action="store_true", help="serve --native-step (both)")
    p.add_argument("--kv-cache", default="fp32", choices=("fp32", "int8"))
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0, 8.0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompts", type=int, default=24, help="prompts of the suite the traces draw from")
    p.add_argument("--suite", default="chat")
    p.add_argument("--batch", type=int, default=4, help="serve --slots (both)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--slo-ttft", type=float, default=1000.0)
    p.add_argument("--slo-tpot", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0, help="repeat r's traces use seed + r")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--margin", type=float, default=0.05, help="the non-inferiority margin of the verdicts")
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for both servers, repeatable")
    p.add_argument("--now-arg", action="append", default=[],
                   help="an argument for the server now only, repeatable (e.g. --now-arg=--no-prefix-cache: without "
                        "the prefix cache, which the earlier server may not have, repeated prompts do not hit it)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="/tmp/infer-tune-then-now")
    p.add_argument("--state", default="/tmp/infer-tune-then-now.json")
    p.add_argument("--fresh", action="store_true", help="start the state file again instead of resuming it")
    p.add_argument("--table", action="store_true", help="print the table of the state file and stop")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--pool", action="append", default=[], metavar="STATE",
                   help="with --table: add the repeats of another state file of the same servers and load (its own "
                        "seeds, e.g. a run of more repeats at one rate with --seed past this run's), repeatable")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.table:
        table(pooled(json.loads(Path(args.state).read_text()), args.pool), markdown=args.markdown)
        return
    if not args.then:
        raise SystemExit("--then REV is needed (the commit whose serve is the baseline)")
    if args.repeats < 1 or not args.rates or args.margin < 0:
        raise SystemExit("--repeats >= 1 (3 or more for an interval), --rates not empty, --margin >= 0")
    args.then_commit = resolve(args.then)
    given = {k: v for k, v in vars(args).items() if k not in ("table", "markdown", "fresh")}
    path = Path(args.state)
    state = {"rows": [], "args": given, "command": " ".join(sys.argv),
             "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "infer_tune_commit": git_commit()}
    if path.exists() and not args.fresh:
        saved = json.loads(path.read_text())
        same = all(saved["args"].get(k) == given.get(k) for k in SAME_ARGS)
        if same and saved.get("infer_tune_commit") == state["infer_tune_commit"]:
            state = {**saved, "args": given, "resumed": saved.get("resumed", []) + [state["started"]]}
            print(f"resuming {path}: {len(state['rows'])} rows measured", flush=True)
    measure(args, state)
    save(args, state)
    table(state)


if __name__ == "__main__":
    main()
