"""What the combined report leads an expert-placement row with (docs/experts.md): measured all-to-all
bytes per token and balancedness against round-robin placement on the same devices in the same stage.
The round-robin row shows its own figures as the reference."""

from __future__ import annotations

from infer_tune.report.leads import Figure, Lead, change_pct, number, same_stage

VS_ROUND_ROBIN = "round-robin placement"


def _round_robin(doc: dict, docs: list[dict]) -> dict | None:
    devices = (doc.get("config") or {}).get("devices")
    for other in docs:
        c = other.get("config") or {}
        if (other.get("technique") == "experts" and c.get("strategy") == "round-robin"
                and c.get("devices") == devices and same_stage(doc, other)):
            return other
    return None


def report_columns(doc: dict, docs: list[dict]) -> Lead:
    m = doc.get("metrics") or {}
    bytes_per_token, balance = number(m.get("alltoall_bytes_per_token")), number(m.get("balancedness"))
    if (doc.get("config") or {}).get("strategy") == "round-robin":
        return Lead((Figure("bytes/token", bytes_per_token, "B/token"), Figure("balancedness", balance, "")),
                    "itself: the reference placement")
    ref = _round_robin(doc, docs)
    if ref is None:
        return Lead((Figure("bytes/token", bytes_per_token, "B/token"), Figure("balancedness", balance, "")),
                    "no round-robin run on these devices here")
    r = ref.get("metrics") or {}
    return Lead((Figure("bytes/token", change_pct(bytes_per_token, r.get("alltoall_bytes_per_token")), "%"),
                 Figure("balancedness", balance, "", reference=number(r.get("balancedness")))), VS_ROUND_ROBIN)
