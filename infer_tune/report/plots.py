"""Plots shared by the techniques and the leaderboard (matplotlib, Agg backend, PNG bytes)."""

from __future__ import annotations

import io


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 100) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return buffer.getvalue()


def per_position_png(curves: dict[str, list[float]], *, first_position: int = 0, title: str | None = None,
                     xlabel: str = "decoded token position", dpi: int = 100) -> bytes:
    """Per-token decode latency vs position, one line per curve, log scale (PNG bytes)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, ys in curves.items():
        ax.plot([first_position + k for k in range(len(ys))], ys, label=name, linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("latency per token (ms)")
    ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return png_bytes(fig, dpi)
