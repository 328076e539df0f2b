"""Batching figures (PNG bytes): the sweep's throughput/latency vs batch size, latency CDFs per rate, and
throughput vs latency over the rates, one line per scheduler."""

from __future__ import annotations

import numpy as np

from infer_tune.report.plots import png_bytes, pyplot


def sweep_png(rows: list[dict], knee: int | None, title: str) -> bytes:
    """rows: {batch_size, throughput, e2e_p50_ms, padding_share}; the knee marked."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4))
    fig.subplots_adjust(wspace=0.4)
    sizes = [r["batch_size"] for r in rows]
    left.plot(sizes, [r["throughput"] for r in rows], marker="o")
    if knee is not None:
        left.axvline(knee, color="tab:red", linestyle="--", label=f"knee (next doubling < 5%): {knee}")
        left.legend(fontsize=8)
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(b) for b in sizes])
    left.set_xlabel("batch size")
    left.set_ylabel("output tokens/s")
    right.plot(sizes, [r["e2e_p50_ms"] for r in rows], marker="o")
    right.set_xscale("log", base=2)
    right.set_xticks(sizes, [str(b) for b in sizes])
    right.set_xlabel("batch size")
    right.set_ylabel("per-request latency p50 (ms)")
    twin = right.twinx()
    twin.plot(sizes, [100 * (r["padding_share"] or 0) for r in rows], color="tab:gray", linestyle=":")
    twin.set_ylabel("padded positions (%, dotted)")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    return png_bytes(fig, 110)


def latency_cdf_png(per_rate: dict[float, dict[str, dict[str, list[float]]]], title: str) -> bytes:
    """per_rate: rate -> scheduler -> {"e2e_ms": [...], "ttft_ms": [...]}; one panel per rate."""
    plt = pyplot()
    rates = sorted(per_rate)
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for k, (name, samples) in enumerate(sorted(per_rate[rate].items())):
            color = f"C{k}"
            for key, style in (("e2e_ms", "-"), ("ttft_ms", ":")):
                values = np.sort(np.asarray(samples[key], dtype=float)) / 1000
                if values.size:
                    ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", color=color,
                            linestyle=style, label=f"{name} {key.removesuffix('_ms')}")
        ax.set_title(f"{rate:g} req/s", fontsize=9)
        ax.set_xlabel("seconds from arrival")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("share of requests")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    return png_bytes(fig, 110)


def sweep_plots(docs: list[dict]) -> dict[str, bytes]:
    """Latency CDFs and the throughput-vs-latency curve of a sweep's trace results (static and
    continuous runs of one trace at one or more rates); nothing for a batch-size sweep."""
    traced = [d for d in docs if (d.get("config") or {}).get("rate") is not None and d.get("samples")]
    if not traced:
        return {}
    per_rate: dict[float, dict[str, dict[str, list[float]]]] = {}
    curves: dict[str, list[dict]] = {}
    for d in traced:
        config, m, samples = d["config"], d.metrics, d["samples"]
        per_rate.setdefault(config["rate"], {})[config["scheduler"]] = {
            "e2e_ms": samples.get("e2e_ms") or [], "ttft_ms": samples.get("ttft_ms") or []}
        curves.setdefault(config["scheduler"], []).append(
            {"rate": config["rate"], "throughput": m["output_throughput_tok_s"], "e2e_mean_ms": m["e2e_ms"]["mean"],
             "e2e_p90_ms": m["e2e_ms"]["p90"]})
    first = traced[0]
    trace = first.get("workload") or {}
    title = (f"{(first.get('model') or {}).get('ref', '')}: {trace.get('requests') or first['config'].get('requests')} "
             f"requests, burstiness {trace.get('burstiness') or first['config'].get('burstiness') or 1:g}, "
             f"batch {first['config'].get('batch_size')}")
    return {"latency_cdf.png": latency_cdf_png(per_rate, title),
            "throughput_latency.png": throughput_latency_png(curves, title)}


def throughput_latency_png(curves: dict[str, list[dict]], title: str) -> bytes:
    """curves: scheduler -> [{rate, throughput, e2e_mean_ms, e2e_p90_ms}] over the rates."""
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, points in sorted(curves.items()):
        points = sorted(points, key=lambda p: p["rate"])
        xs = [p["throughput"] for p in points]
        line = ax.plot(xs, [p["e2e_mean_ms"] / 1000 for p in points], marker="o", label=f"{name} mean")[0]
        ax.plot(xs, [p["e2e_p90_ms"] / 1000 for p in points], marker="x", linestyle=":", color=line.get_color(),
                label=f"{name} p90")
        for p in points:
            ax.annotate(f"{p['rate']:g}/s", (p["throughput"], p["e2e_mean_ms"] / 1000), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("e2e latency (s)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return png_bytes(fig, 110)
