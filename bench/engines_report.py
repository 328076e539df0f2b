"""Every engine on one model in one report (issue #51): infer-tune's best in-process row, `infer-tune serve`,
llama.cpp's default and best launch, OpenVINO's default and best, on the same workload, written to one runs
folder and combined by `infer-tune leaderboard` (the project's report: leaderboard.md / .csv / .html).

The servers (infer-tune serve, llama-server's two launches) are measured by the same client: the endpoint
runner of `bench --endpoint` (`bench --engine llama.cpp` drives its launches through it), every request
decoding the full `--max-new-tokens` (`ignore_eos`). The in-process rows are timed by their runners in this
process's way (`bench --recipe`: the torch baseline and the stack in interleaved rounds; `bench --engine
openvino`: OpenVINO's default and the setting in interleaved rounds). Each row keeps the ratio against its own
default (the torch baseline, llama.cpp's default launch, OpenVINO's default); across engines the report compares
the absolute figures (decode tok/s from TPOT p50, TTFT p50) of the same prompts.

"Best" is what each engine's search chose on this host, given as arguments (the defaults are the winners the
docs record: `tune`'s int4 a8 + lean native step, `tune --engine llama.cpp`'s imatrix IQ4_XS with a q8_0 cache
and flash attention, `tune --engine openvino`'s int8 with an f16 cache); nothing is searched here.

    flock /tmp/infer-tune-cpu.lock python bench/engines_report.py --threads 2 --out runs/engines-report
    python bench/engines_report.py --table --out runs/engines-report   # the table of that run again

Each step is one `infer-tune` command (printed before it runs); a step that fails is recorded and the others
still run. `OUT/engines-report.json` holds the command, the date, the host, the commit and every step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_BEST = ("gguf=imatrix-iq4_xs", "cache_type_k=q8_0", "cache_type_v=q8_0", "flash_attn=on")
OPENVINO_BEST = ("kv_cache_precision=f16",)
OURS_RECIPE = "int4-native"  # recipes/int4-native.yaml: int4-rtn g32 a8 weights + the lean loop's native step
# the prefix cache off: the rounds send the same prompts again, and llama-server runs with its prompt cache off
SERVE = ("--method", "int4-rtn", "--activations", "int8", "--native-step", "--slots", "1", "--no-prefix-cache")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default="chat")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--min-iterations", type=int, default=3)
    p.add_argument("--max-duration", type=float, default=90.0, help="seconds of rounds per in-process step at most")
    p.add_argument("--ours-recipe", default=OURS_RECIPE)
    p.add_argument("--llama-best", nargs="*", default=list(LLAMA_BEST))
    p.add_argument("--openvino-best", nargs="*", default=list(OPENVINO_BEST))
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--step-timeout", type=float, default=420.0)
    p.add_argument("--out", type=Path, default=Path("runs/engines-report"))
    p.add_argument("--table", action="store_true", help="print the table of the run in --out, measure nothing")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.min_iterations < 1 or args.max_duration <= 0:
        p.error("--limit, --max-new-tokens and --min-iterations must be >= 1, --max-duration > 0")
    return args


def _env(args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def common(args, folder: str) -> list[str]:
    """The workload every step measures, and its output folder."""
    out = ["--model", args.model, "--suite", args.suite, "--limit", str(args.limit), "--max-new-tokens",
           str(args.max_new_tokens), "--out", str(args.out / folder)]
    return out + (["--threads", str(args.threads)] if args.threads else [])


def rounds(args) -> list[str]:
    return ["--min-iterations", str(args.min_iterations), "--max-round-seconds", str(args.max_duration)]


def run_step(args, name: str, argv: list[str], steps: list[dict]) -> None:
    cmd = [sys.executable, "-m", "infer_tune", *argv]
    print(f"== {name}: infer-tune {shlex.join(argv)}", flush=True)
    began = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=_env(args), capture_output=True, text=True, timeout=args.step_timeout)
        code, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"past {args.step_timeout} s"]
    steps.append({"step": name, "argv": ["infer-tune", *argv], "returncode": code,
                  "seconds": round(time.monotonic() - began, 1), **({"tail": tail} if code != 0 else {})})
    print(f"   {name}: {'ok' if code == 0 else f'FAILED ({code}): ' + ' | '.join(tail)} "
          f"({steps[-1]['seconds']} s)", flush=True)


@contextlib.contextmanager
def served(args):
    """`infer-tune serve` of our best configuration on a free loopback port (its READY line), always stopped."""
    from infer_tune.endpoint.servers import stop

    argv = ["serve", "--model", args.model, *SERVE, "--port", "0"] + (["--threads", str(args.threads)] if args.threads else [])
    log = Path(tempfile.mkdtemp(prefix="engines-report-serve-")) / "serve.log"
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "infer_tune", *argv], stdout=subprocess.PIPE, stderr=err,
                                   text=True, env=_env(args), start_new_session=True)
    try:
        deadline, line = time.monotonic() + args.startup_timeout, ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                break
        yield (line.split()[1] if line.startswith("READY") else None), argv, log
    finally:
        stop(process)


def measure(args) -> dict:
    steps: list[dict] = []
    started = datetime.now(timezone.utc)
    # in-process: the torch baseline and our best stack in interleaved rounds
    run_step(args, "ours in-process", ["bench", "--recipe", args.ours_recipe, *common(args, "ours"), *rounds(args)],
             steps)
    # our server, measured by the endpoint client
    with served(args) as (url, argv, log):
        if url is None:
            steps.append({"step": "ours serve", "argv": ["infer-tune", *argv], "returncode": None,
                          "tail": [f"not ready within {args.startup_timeout} s (log {log})"]})
        else:
            run_step(args, "ours serve", ["bench", "--endpoint", url, "--ignore-eos", "--label",
                                          "infer-tune serve " + " ".join(SERVE), *common(args, "serve"),
                                          *rounds(args)], steps)
            steps[-1]["server_argv"] = ["infer-tune", *argv]
    # llama.cpp: its default launch, then the best, by the same endpoint client
    run_step(args, "llama.cpp default + best", ["bench", "--engine", "llama.cpp",
                                                *[x for s in args.llama_best for x in ("--set", s)],
                                                *common(args, "llama.cpp")], steps)
    # OpenVINO in-process: its default and the best in interleaved rounds
    run_step(args, "openvino default + best", ["bench", "--engine", "openvino",
                                               *[x for s in args.openvino_best for x in ("--set", s)],
                                               *common(args, "openvino"), *rounds(args)], steps)
    run_step(args, "report", ["leaderboard", str(args.out), "--format", "md,html"], steps)
    state = {"command": shlex.join([Path(sys.argv[0]).name if sys.argv else "engines_report.py", *sys.argv[1:]]),
             "started_at": started.isoformat(timespec="seconds"),
             "ended_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "host": {"node": platform.node(), "cpu": _cpu(), "cores": os.cpu_count()}, "commit": _commit(),
             "steps": steps}
    from infer_tune import atomic

    atomic.write_text(args.out / "engines-report.json", json.dumps(state, indent=1))
    return state


def _cpu() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    return None


KIND = {"ours": "in-process", "serve": "server (endpoint client)", "llama.cpp": "server (endpoint client)",
        "openvino": "in-process"}


def table(args) -> list[str]:
    """One markdown row per result of the run: where it ran, what measured it, decode tok/s (1000 / TPOT p50),
    TTFT p50, the ratio against its own default with its interval, perplexity and its change."""
    from infer_tune import results
    from infer_tune.scenarios.engine_tune import table_row

    lines = ["| row | engine | measured by | decode tok/s | TTFT p50 ms | decode vs its default [95%] | "
             "vs | ppl | ppl Δ% |", "|---|---|---|---|---|---|---|---|---|"]
    for folder in ("ours", "serve", "llama.cpp", "openvino"):
        docs = sorted(results.find_results(args.out / folder), key=lambda d: d["created_at"])
        by_id = {d["run_id"]: d for d in docs}
        for doc in docs:
            r = table_row(doc)
            base = by_id.get(doc.baseline_run_id) if doc.baseline_run_id else None
            ci = r["ratio_ci95"]
            ratio = ("-" if r["ratio"] is None or base is None else f"{r['ratio']:.2f}x"
                     + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            lines.append(f"| {r['label']} | {doc.get('engine')} | {KIND[folder]} | {fmt(r['decode_tok_s'], '.1f')} | "
                         f"{fmt(r['ttft_p50_ms'], '.1f')} | {ratio} | {base.label if base else '-'} | "
                         f"{fmt(r['ppl'], '.3f')} | {fmt(r['ppl_delta_pct'], '+.2f')} |")
    lines.append("")
    lines.append("ppl: each engine's own measure, compared within an engine (torch, lean and OpenVINO: the suite "
                 "references' NLL after the rendered prompt; llama.cpp: llama-perplexity over the suite's text)")
    return lines


def main(argv=None) -> None:
    args = parse(argv)
    if not args.table:
        state = measure(args)
        failed = [s["step"] for s in state["steps"] if s.get("returncode") != 0]
        print(f"{state['started_at']} - {state['ended_at']}, {state['host']['cpu']}, commit {state['commit']}"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    print("\n".join(table(args)))
    print(f"report: {args.out}/leaderboard.md, {args.out}/leaderboard.html")


if __name__ == "__main__":
    main()
