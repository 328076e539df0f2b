"""What the combined report leads a quantization row with (docs/report.md): decode and TTFT
speedup of the reloaded quantized model against the unquantized baseline of the same session."""

from __future__ import annotations

from infer_tune.report.leads import Lead, decode_speedup


def report_columns(doc: dict, docs: list[dict]) -> Lead:
    dtype = (doc.get("model") or {}).get("dtype")
    return decode_speedup(doc, docs, vs=f"{dtype} baseline (same session)" if isinstance(dtype, str) and
                          dtype.isidentifier() else "unquantized baseline (same session)")
