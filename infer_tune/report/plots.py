"""Plots shared by the techniques and the leaderboard (matplotlib, Agg backend, PNG bytes)."""

from __future__ import annotations

import io


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def matplotlib_ticker():
    import matplotlib.ticker

    return matplotlib.ticker


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


# --------------------------------------------------------------------------- the combined report's plots
QUALITY_AXIS = "perplexity change, %, lower is better"
SPEEDUP_AXIS = "decode speedup vs the baseline (x, TPOT p50)"


def plot_text(text: str) -> str:
    """A label matplotlib draws as written (no mathtext from a `$` in a config label)."""
    return str(text).replace("$", r"\$")


def row_labels(rows: list[dict]) -> list[str]:
    """Each row's config label (`baseline · suite` for baselines), numbered where two are the same."""
    raw = [f"baseline · {r.get('suite') or '-'}" if r.get("technique") == "baseline" else str(r.get("config") or "-")
           for r in rows]
    keys = [(r.get("technique"), label) for r, label in zip(rows, raw, strict=True)]
    seen: dict = {}
    out = []
    for key, label in zip(keys, raw, strict=True):
        seen[key] = seen.get(key, 0) + 1
        repeats = keys.count(key)
        out.append(f"{label} ({seen[key]})" if repeats > 1 else label)
    return [label[:40] for label in out]


def _quality(row: dict) -> float | None:
    """Perplexity change; a row without one whose outputs equal the baseline's sits at 0."""
    v = row.get("ppl_delta_pct")
    if isinstance(v, (int, float)) and v == v:
        return float(v)
    if row.get("technique") == "baseline" or row.get("output_mismatches") == 0:
        return 0.0
    return None


def pareto_points(rows: list[dict], broken: list[bool]) -> list[tuple[int, float, float]]:
    """(row index, speedup, perplexity change) of the rows judged on decode speedup that have both."""
    points = []
    for i, row in enumerate(rows):
        x, y = row.get("speedup_vs_baseline"), _quality(row)
        decode = row.get("technique") == "baseline" or row.get("lead_decode") is True
        if decode and not broken[i] and isinstance(x, (int, float)) and x == x and y is not None:
            points.append((i, float(x), y))
    return points


# label offsets (points) tried in turn: right of the point first, then above and below it further and further out
_OFFSETS = [(6, dy, "left") for dy in (4, 14, -16, 26, -28, 38, -40, 50, -52, 62, -64)] + \
    [(-6, dy, "right") for dy in (14, -16, 26, -28, 38, -40, 50, -52)]  # then ending left of the point


def text_box(note, renderer):
    """The display box of an annotation's text alone (its own extent includes the leader line)."""
    from matplotlib.text import Text

    note.update_positions(renderer)  # the text's place follows its point only once positions are updated
    return Text.get_window_extent(note, renderer)


def place_labels(fig, ax, labels: list[tuple[str, float, float]]) -> list:
    """Annotate each (text, x, y), trying offsets in turn until the label's box overlaps no label placed before
    it and ends inside the plot (measured with the figure's own renderer, in display pixels); the last offset
    where none is free. A
    label away from its point gets a thin leader line. Returns the annotations."""
    fig.canvas.draw()  # limits settled, so boxes are where they will be drawn
    renderer = fig.canvas.get_renderer()
    right = ax.get_window_extent(renderer).x1  # a label past the plot's right edge is cut where the page shows it
    placed, boxes = [], []
    for text, x, y in labels:
        note = None
        for dx, dy, align in _OFFSETS:
            if note is not None:
                note.remove()
            note = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=9,
                               horizontalalignment=align,
                               arrowprops={"arrowstyle": "-", "color": "#999", "linewidth": 0.6}
                               if abs(dy) > 10 or dx < 0 else None)
            box = text_box(note, renderer).expanded(1.04, 1.15)
            if box.x1 <= right and not any(box.overlaps(other) for other in boxes):
                break
        boxes.append(text_box(note, renderer))
        placed.append(note)
    return placed


def pareto_svg(rows: list[dict], broken: list[bool], front_of) -> str | None:
    """Speedup vs perplexity change as an inline SVG: every point has a hover title, only the Pareto
    front is labelled, the recommended row is a star. `front_of(points)` -> indices of the front."""
    import re
    from xml.sax.saxutils import escape

    points = pareto_points(rows, broken)
    if not points:
        return None
    plt = pyplot()
    labels = row_labels(rows)
    names = [f"{rows[i].get('technique')} {labels[i]}" if rows[i].get("technique") != "baseline" else labels[i]
             for i, _, _ in points]
    front = set(front_of([(x, -y) for _, x, y in points]))
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for k, (i, x, y) in enumerate(points):
        on_front = k in front
        marker, size, color = ("*", 16, "tab:orange") if rows[i].get("recommended") else \
            ("o", 7, "tab:red" if on_front else "tab:blue")
        ax.plot([x], [y], marker=marker, markersize=size, color=color, linestyle="none", gid=f"pt{k}")
    ordered = sorted((k for k in front), key=lambda k: points[k][1])
    ax.plot([points[k][1] for k in ordered], [points[k][2] for k in ordered], "--", color="tab:red", linewidth=1,
            label="Pareto front (faster, or lower perplexity change)")
    recommended = [k for k, (i, _, _) in enumerate(points) if rows[i].get("recommended") and k not in front]
    ordered = sorted(ordered + recommended, key=lambda k: points[k][1])  # the recommended row is labelled too
    ax.margins(x=0.25, y=0.3)  # before the labels: their boxes are measured against the final limits
    place_labels(fig, ax, [(plot_text(names[k]), points[k][1], points[k][2]) for k in ordered])
    if any(rows[i].get("recommended") for i, _, _ in points):
        ax.plot([], [], marker="*", markersize=12, color="tab:orange", linestyle="none", label="recommended")
    ax.set_xlabel(SPEEDUP_AXIS, fontsize=10)
    ax.set_ylabel(QUALITY_AXIS, fontsize=10)
    ax.axhline(0, color="#bbb", linewidth=0.8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 class="plot" role="img"', svg, count=1)
    for k, (_, x, y) in enumerate(points):
        title = f"{names[k]}: {x:.2f}x decode, perplexity change {y:+.2f}%"
        svg = svg.replace(f'<g id="pt{k}">', f'<g id="pt{k}" class="point"><title>{escape(title)}</title>', 1)
    return svg


def latency_png(rows: list[dict]) -> bytes | None:
    """TTFT and TPOT p50 / p99 as horizontal bars, grouped by technique (a bold header per group),
    labelled by config; the recommended row starred. Log scale: TTFT under load and single-stream
    decode differ by orders of magnitude."""
    if not rows:
        return None
    plt = pyplot()
    labels = row_labels(rows)
    order: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        order.setdefault(str(row.get("technique")), []).append(i)
    ticks, names, bold, slots = [], [], [], []
    y = 0
    for technique, members in order.items():
        ticks.append(y), names.append(plot_text(technique)), bold.append(True)
        y += 1
        for i in members:
            star = " ★" if rows[i].get("recommended") else ""
            ticks.append(y), names.append(plot_text(labels[i]) + star), bold.append(False)
            slots.append((y, i))
            y += 1
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.3 * y + 1.2), sharey=True)
    for ax, key in zip(axes, ("ttft", "tpot"), strict=True):
        for y_at, i in slots:
            p50, p99 = rows[i].get(f"{key}_p50_ms"), rows[i].get(f"{key}_p99_ms")
            color = "tab:orange" if rows[i].get("recommended") else "tab:blue"
            if isinstance(p99, (int, float)) and p99 == p99 and p99 > 0:
                ax.barh(y_at, p99, height=0.7, color=color, alpha=0.3, label="p99" if y_at == slots[0][0] else None)
            if isinstance(p50, (int, float)) and p50 == p50 and p50 > 0:
                ax.barh(y_at, p50, height=0.7, color=color, label="p50" if y_at == slots[0][0] else None)
        values = [v for _, i in slots for v in (rows[i].get(f"{key}_p50_ms"), rows[i].get(f"{key}_p99_ms"))
                  if isinstance(v, (int, float)) and v == v and v > 0]
        wide = bool(values) and max(values) / min(values) > 20
        if wide:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(matplotlib_ticker().FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(f"{key.upper()} (ms{', log scale' if wide else ''}; dark p50, light p99)", fontsize=10)
        ax.tick_params(axis="x", labelsize=9)
        ax.grid(True, axis="x", alpha=0.3, which="both")
    axes[0].set_yticks(ticks, names, fontsize=10)
    for tick, is_bold in zip(axes[0].get_yticklabels(), bold, strict=True):
        if is_bold:
            tick.set_fontweight("bold")
    axes[0].invert_yaxis()
    fig.tight_layout()
    return png_bytes(fig)


def pareto_front(points) -> list[int]:
    """Indices of the points no other point beats on both axes (both maximised)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(ox >= x and oy >= y and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def report_plots(rows: list[dict], positions: dict[str, list[float]]) -> list[tuple[str, str, object]]:
    """(title, "svg" | "png", content) of each shared plot that has data."""
    from infer_tune.report.display import is_broken

    figures: list[tuple[str, str, object]] = []
    broken = [is_broken(r) and r.get("technique") != "baseline" for r in rows]
    svg = pareto_svg(rows, broken, pareto_front)
    if svg:
        figures.append(("Decode speedup vs perplexity change (Pareto front labelled; hover a point for its name)",
                        "svg", svg))
    bars = latency_png(rows)
    if bars:
        figures.append(("TTFT and TPOT p50 / p99 by technique and config", "png-wide", bars))
    if positions:
        names = dict(zip((r["run_id"] for r in rows), row_labels(rows), strict=True))
        curves = {plot_text(names.get(run_id, "?")): values for run_id, values in positions.items()}
        figures.append(("Per-position decode latency", "png", per_position_png(curves)))
    return figures
