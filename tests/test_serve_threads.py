"""`infer-tune serve`'s threads (infer_tune/endpoint/serving.py `serve_until_signal`): the engine runs in the
main thread (torch's OpenMP regions ran 2-3x slower on a thread of its own, infer_tune/tuners/batch/serving.py),
the HTTP server on another; SIGTERM stops both; a port that cannot be bound stops the engine and raises.
A stand-in engine (no model): bounded, loopback only."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

from infer_tune.endpoint.serving import OpenAIServer, serve_until_signal


class StandIn:
    """What the HTTP side and `serve_until_signal` use of a LiveSlots: run until stopped."""

    max_context = 64

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.failure = None
        self.ran_in_main = None

    @property
    def alive(self) -> bool:
        return not self.stopped.is_set()

    def run(self) -> None:
        self.ran_in_main = threading.current_thread() is threading.main_thread()
        self.stopped.wait(30)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped.set()

    def limit(self, prompt_tokens: int, max_tokens: int) -> int:
        return max_tokens


def test_engine_in_the_main_thread_and_sigterm_stops_both():
    engine, urls, health = StandIn(), [], []

    def client() -> None:
        deadline = time.monotonic() + 20
        while not urls and time.monotonic() < deadline:
            time.sleep(0.02)
        with urllib.request.urlopen(urls[0].removesuffix("/v1") + "/health", timeout=10) as response:  # noqa: S310
            health.append(response.status)
        os.kill(os.getpid(), signal.SIGTERM)

    # the SIGTERM goes to this pytest process: a handler of the test's own, so one that came after serve's was
    # gone (a client slower than the stand-in's 30 s) could not end the worker
    late: list[int] = []
    outer = signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
    try:
        previous = signal.getsignal(signal.SIGTERM)
        threading.Thread(target=client, daemon=True).start()
        started = time.monotonic()
        serve_until_signal(OpenAIServer(engine, None, "stand-in"), "127.0.0.1", 0, urls.append)
        assert signal.getsignal(signal.SIGTERM) is previous  # the handler it installed is gone
    finally:
        signal.signal(signal.SIGTERM, outer)
    assert engine.ran_in_main and engine.stopped.is_set() and health == [200] and not late
    assert time.monotonic() - started < 20


def test_a_port_in_use_stops_the_engine_and_raises():
    engine = StandIn()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            serve_until_signal(OpenAIServer(engine, None, "stand-in"), "127.0.0.1", taken.getsockname()[1], print)
    assert engine.stopped.is_set()
