"""Expert-placement plots (PNG bytes): the routing heatmap of a load file and device load per plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from infer_tune.report.plots import png_bytes, pyplot
from infer_tune.tuners.experts.loadfile import LoadFile, load


def load_heatmap_png(load: LoadFile) -> bytes:
    """Left: share of each layer's routed tokens per expert; right: co-activation over all layers."""
    plt = pyplot()
    loads = load.loads()
    share = loads / np.maximum(loads.sum(1, keepdims=True), 1)
    n = load.model.num_experts
    # the layer whose co-activation is least uniform (expert ids mean nothing across layers)
    spread = [layer.coactivation.max() / max(layer.coactivation.sum() / max(n * (n - 1), 1), 1e-9)
              for layer in load.layers]
    pick = int(np.argmax(spread))
    pairs = load.layers[pick].coactivation.astype(np.float64)
    pairs = pairs / max(pairs.sum(), 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, max(4.0, 0.18 * load.num_layers + 1.5)),
                                      gridspec_kw={"width_ratios": [1.4, 1], "wspace": 0.45})
    image = left.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    left.set_xlabel("expert")
    left.set_ylabel("MoE layer")
    left.set_title(f"tokens per expert (share of the layer; uniform = {1 / n:.3f})", fontsize=9)
    fig.colorbar(image, ax=left, fraction=0.046)
    image = right.imshow(pairs, cmap="magma", interpolation="nearest")
    right.set_xlabel("expert")
    right.set_ylabel("expert")
    right.set_title(f"co-activation in layer {pick}: share of expert pairs chosen by one token", fontsize=9)
    fig.colorbar(image, ax=right, fraction=0.046, pad=0.08)
    fig.suptitle(f"{load.model.ref}: {load.tokens} tokens of {load.workload.get('suite', '?')}, "
                 f"top-{load.model.top_k} of {n} experts", fontsize=10)
    return png_bytes(fig)


def validation_plots(docs: list[dict]) -> dict[str, bytes]:
    """A sweep's expert-parallel runs: the measured device load per plan, and the load file's heatmap."""
    rows = [(d["config"]["strategy"], {"device_load_share": d.metrics["measured_device_load_share"],
                                       "balancedness": d.metrics["balancedness"]})
            for d in docs if d.metrics.get("measured_device_load_share")]
    files = {}
    if rows:
        speeds = docs[0]["config"].get("device_speeds") or [1.0] * len(rows[0][1]["device_load_share"])
        files["plan_loads.png"] = plan_loads_png(rows, speeds)
    load_file = docs[0]["config"].get("load_file") if docs else None
    if load_file and Path(load_file).is_file():
        files["heatmap.png"] = load_heatmap_png(load(load_file))
    return files


def plan_loads_png(rows: list[tuple[str, dict]], speeds: list[float]) -> bytes:
    """Each plan's share of the routed work per device (bars), against the ideal share (dashes)."""
    plt = pyplot()
    devices = len(speeds)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4))
    width = 0.8 / devices
    for d in range(devices):
        ax.bar([i + (d - (devices - 1) / 2) * width for i in range(len(rows))],
               [m["device_load_share"][d] for _, m in rows], width=width, label=f"device {d} (speed {speeds[d]:g})")
    even = np.asarray(speeds) / sum(speeds)
    for i in range(len(rows)):
        for d in range(devices):
            x = i + (d - (devices - 1) / 2) * width
            ax.plot([x - width / 2, x + width / 2], [even[d]] * 2, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(rows)),
                  [f"{name}\nbalancedness {m['balancedness']:.2f}" for name, m in rows], fontsize=8)
    ax.set_ylabel("share of routed (token, expert) pairs")
    ax.set_title("device load per plan (dashes: share proportional to speed)", fontsize=9)
    ax.legend(fontsize=7, ncol=min(devices, 4))
    return png_bytes(fig)
