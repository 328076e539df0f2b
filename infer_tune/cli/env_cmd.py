"""`infer-tune env`: the hardware and software report every result embeds."""

from __future__ import annotations

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.scenarios.common import setup_threads


def env(threads: opt.Threads = None, json_out: opt.Json = False, debug: opt.Debug = False) -> None:
    """Print CPU, cores, threads, RAM, OS, Python/torch/transformers versions, GPU and memory bandwidth."""
    from infer_tune import env as envinfo

    report = {"tool": envinfo.tool_info(), **envinfo.collect_env(setup_threads(threads))}
    if json_out:
        output.print_json(report)
        return
    for key, value in report.items():
        if key == "tool":
            value = f"{value['name']} {value['version']} (git {value['git_revision'] or 'unknown'})"
        elif key == "ram_bytes":
            value = output.fmt_bytes(value)
        elif key == "mem_bandwidth_gb_s":
            value = f"{value:.1f} GB/s (measured on this host)"
        elif key == "mem_bandwidth":
            quick = value.get("quick_check_gb_s")
            value = (f"{value['source']}, measured {value.get('measured_at')}"
                     + (f", quick check now {quick:.1f} GB/s" if quick else ""))
        elif key == "cpu_flags":
            value = " ".join(value) or "-"
        output.out.print(f"{key:<20} {value}")
