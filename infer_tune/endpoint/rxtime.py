"""Kernel receive timestamps of TCP reads, on the clock the load generator and the paced server use.

With `SO_TIMESTAMPNS` set on a socket (set on a listening socket, accepted sockets inherit it), every
`recvmsg` carries, as ancillary data, the CLOCK_REALTIME time the kernel received the data it returns
(for TCP: the last segment that read consumed). `read` converts it to `perf_counter_ns` (CLOCK_MONOTONIC
on Linux) by the two clocks' offset, read at that moment (`realtime_offset_ns`: a monotonic read between
two realtime ones, read again when the thread was switched out between them), so a wall-clock step
between runs does not matter. Where the platform gives no
timestamp (no `SO_TIMESTAMPNS`, no ancillary data, or one that is in the future or older than
`MAX_AGE_NS`), the caller gets None and uses the read time, recorded as such. docs/endpoint.md
("Load generation across processes").
"""

from __future__ import annotations

import socket
import struct
import time

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if hasattr(socket, "SO_REUSEPORT") else None)
_TIMESPEC = struct.Struct("@qq")
ANC_SIZE = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 0
MAX_AGE_NS = 60 * 10**9  # a timestamp older than this is not the read's (a clock step): the read time stands in
CLOCK_SLACK_NS = 1_000_000  # a timestamp up to this far "in the future" (the two clocks read apart) counts as now
CLOSE_PAIR_NS = 20_000  # two realtime reads this close around a monotonic one give the clocks' offset
OFFSET_TRIES = 5


def enable(sock: socket.socket) -> bool:
    """Ask the kernel to timestamp what `sock` receives; False where it cannot (the read time is used)."""
    if SO_TIMESTAMPNS is None or not hasattr(sock, "recvmsg"):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def read(sock: socket.socket, size: int) -> tuple[bytes, int | None, int]:
    """One non-blocking read of at most `size` bytes: (data, when the kernel received it on
    `perf_counter_ns` or None where it gave no timestamp, when this read returned on `perf_counter_ns`).
    Raises what `recvmsg` / `recv` raise (BlockingIOError, OSError)."""
    if not ANC_SIZE:
        data = sock.recv(size)
        return data, None, time.perf_counter_ns()
    data, ancillary, _flags, _addr = sock.recvmsg(size, ANC_SIZE)
    mono = time.perf_counter_ns()
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(payload)
            age = mono - (sec * 10**9 + nsec - realtime_offset_ns())
            if -CLOCK_SLACK_NS <= age <= MAX_AGE_NS:
                return data, mono - max(0, age), mono
    return data, None, mono


def realtime_offset_ns() -> int:
    """CLOCK_REALTIME minus `perf_counter_ns`, from a realtime read on each side of a monotonic one; a pair
    read far apart (the thread was switched out between them: another Python thread took the GIL, or the
    OS ran something else) is read again, so the offset is off by at most half the closest pair's gap, not
    by a preemption (which put a read's time before its request's send)."""
    best = None
    for _ in range(OFFSET_TRIES):
        before = time.time_ns()
        mono = time.perf_counter_ns()
        after = time.time_ns()
        if best is None or after - before < best[0]:
            best = (after - before, (before + after) // 2 - mono)
        if after - before <= CLOSE_PAIR_NS:
            break
    return best[1]


def drain(sock: socket.socket, pending: bytearray) -> bool | None:
    """Send what `pending` holds on a non-blocking socket and drop what went: True when nothing is left,
    False when the socket took only part (wait until it is writable again), None when the connection failed."""
    try:
        sent = sock.send(pending)
    except BlockingIOError:
        return False
    except OSError:
        return None
    del pending[:sent]
    return not pending
