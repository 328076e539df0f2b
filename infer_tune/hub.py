"""Whether the Hugging Face hub can be used right now. Offline is a normal state, not an error path:
it is answered at once (the `HF_HUB_OFFLINE` flag, else one connection attempt bounded by a short
timeout, remembered for the process), so an unknown name fails in a second with one line instead of
spending tens of seconds in library retries."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

TRUE = ("1", "true", "yes", "on")
PROBE_TIMEOUT_S = 2.0
# `from_pretrained` keyword arguments: the model runs the modules its architecture defines. transformers >= 5.25
# swaps layers for kernels fetched from the hub by default (`use_kernels`): code from the network in every baseline,
# and not what a technique is measured against (docs/architecture.md, "Loading")
PLAIN_MODULES = {"use_kernels": False}
_reachable: bool | None = None


def offline_flag() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set."""
    return any(os.environ.get(name, "").strip().lower() in TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)


def reachable() -> bool:
    """False when offline by flag, or when a TCP connection to the hub does not open within a couple
    of seconds (DNS included); probed once per process."""
    global _reachable
    if offline_flag():
        return False
    if _reachable is None:
        result: list[bool] = []

        def probe() -> None:
            try:
                with socket.create_connection(_endpoint(), timeout=PROBE_TIMEOUT_S):
                    result.append(True)
            except OSError:
                result.append(False)

        thread = threading.Thread(target=probe, daemon=True)  # getaddrinfo has no timeout of its own
        thread.start()
        thread.join(PROBE_TIMEOUT_S + 0.5)
        _reachable = bool(result and result[0])
    return _reachable


def why_offline() -> str:
    """How to say why the hub cannot be used, for one-line errors."""
    return "offline (HF_HUB_OFFLINE is set)" if offline_flag() else "unreachable from here"


def _hub_cache() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    return home / "hub"


def cached_model(repo_id: str) -> bool:
    """The local hub cache holds a snapshot of model `repo_id` (usable offline)."""
    return any((_hub_cache() / f"models--{repo_id.replace('/', '--')}" / "snapshots").glob("*/config.json"))


def cached_dataset(repo_id: str) -> bool:
    """The local caches hold dataset `repo_id` (the hub cache or the datasets library's own)."""
    if (_hub_cache() / f"datasets--{repo_id.replace('/', '--')}" / "snapshots").is_dir():
        return True
    home = Path(os.environ.get("HF_DATASETS_CACHE") or
                Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "datasets").expanduser()
    return any(home.glob(repo_id.replace("/", "___") + "*"))
