"""Speculate's own figure: acceptance rate by draft position, one curve per (draft, K), per suite."""

from __future__ import annotations

from infer_tune.report.plots import png_bytes, pyplot


def acceptance_png(docs: list[dict], title: str) -> bytes | None:
    """acceptance_by_position of every config in `docs` (None when no config has a curve)."""
    curves = {d["label"]: d.metrics.get("acceptance_by_position") or [] for d in docs}
    if not docs or not any(curves.values()):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, ys in curves.items():
        if ys:
            ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, linewidth=1, label=name)
    ax.set_xlabel("draft position (1 = first proposed token)")
    ax.set_ylabel("accepted / proposed at this position")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return png_bytes(fig, 110)


def plots(docs: list[dict]) -> dict[str, bytes]:
    """`acceptance.png` for a sweep's speculate results (one sweep measures one suite)."""
    first = docs[0] if docs else {}
    suite = (first.get("workload") or {}).get("suite", "")
    model = (first.get("model") or {}).get("ref", "")
    png = acceptance_png(docs, f"{model} on {suite}: acceptance per draft position")
    return {"acceptance.png": png} if png else {}
