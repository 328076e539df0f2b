"""Hostile local conditions: another account's files in the cache, dead builders' locks, listeners, leftovers.

Each test is one case of docs/hardening.md ("Nothing another account wrote is loaded or run" and the
sections after it); each asserts the clean outcome. The native-library cases use a tiny extension
(one C function, built in about a second) instead of the real kernels (minutes to compile), through the
same `native.build_library` the kernels are built with.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from infer_tune import native, paths

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_UID = 65534  # nobody: "another account"
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="making a file another account's needs root")
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def _fake_source(tmp_path: Path) -> Path:
    src = tmp_path / "fake.cpp"
    src.write_text('extern "C" int infer_tune_fake_probe() { return 7; }\n')
    return src


def _planted_library(tmp_path: Path, marker: Path) -> Path:
    """A library that, once loaded, writes `marker` (what a swapped-in library of another account would do)."""
    src = tmp_path / "evil.cpp"
    src.write_text('#include <cstdio>\n__attribute__((constructor)) static void planted() {\n'
                   f'  FILE* f = std::fopen("{marker}", "w"); if (f) std::fclose(f);\n}}\n')
    out = tmp_path / "evil.so"
    subprocess.run(["c++", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def _name() -> str:
    return f"infer_tune_fake_{uuid.uuid4().hex[:8]}"


# ---- 1. another account's library or binary ------------------------------------------------------------------


def test_home_folders_are_private_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "a" / "home"))
    old = os.umask(0)
    try:
        home = paths.home()
        kernels = paths.private_dir(home / "kernels" / "native-x")
        models = paths.models_dir()
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", home, home / "kernels", kernels, models):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert paths.untrusted(kernels) is None


@needs_root
def test_untrusted_names_the_foreign_or_writable_path(tmp_path):
    home = paths.private_dir(tmp_path / "home")
    lib = paths.private_dir(home / "kernels") / "lib.so"
    lib.write_bytes(b"x")
    lib.chmod(0o755)
    assert paths.untrusted(lib, home) is None
    (home / "kernels").chmod(0o777)
    assert "writable by group or others (mode 0777)" in paths.untrusted(lib, home)
    (home / "kernels").chmod(0o700)
    lib.chmod(0o775)
    assert "lib.so is writable by group or others" in paths.untrusted(lib, home)
    lib.chmod(0o755)
    os.chown(lib, FOREIGN_UID, FOREIGN_UID)
    assert f"belongs to uid {FOREIGN_UID}" in paths.untrusted(lib, home)
    os.chown(lib, 0, 0)
    os.chown(home, FOREIGN_UID, FOREIGN_UID)
    assert f"{home} belongs to uid {FOREIGN_UID}" in paths.untrusted(lib, home)


def _swap_in(library: Path, data: bytes) -> None:
    """Put `data` where `library` is as a new file (a new inode), as another process's copy would: this
    process maps the honest library it loaded, and writing over that mapping in place crashes it at exit."""
    staged = library.with_name(library.name + ".swap")
    staged.write_bytes(data)
    os.replace(staged, library)


@needs_root
@needs_compiler
@pytest.mark.parametrize("attack", ["foreign-owner", "folder-world-writable"])
def test_a_library_planted_by_another_account_is_never_loaded(tmp_path, monkeypatch, capfd, attack):
    """uid 65534 swaps its own library (with a matching digest) into the kernel cache; without the checks,
    ninja sees a library newer than the sources, keeps it, and torch dlopens it as root."""
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    name = _name()
    folder = paths.private_dir(paths.home() / "kernels" / "native-fake")
    src = _fake_source(tmp_path)
    native.build_library(folder, name, [src])  # an honest first build
    marker = tmp_path / "planted-library-ran"
    evil = _planted_library(tmp_path, marker)
    library = folder / f"{name}.so"
    _swap_in(library, evil.read_bytes())
    (folder / f"{name}.so.sha256").write_text(hashlib.sha256(evil.read_bytes()).hexdigest() + "\n")
    if attack == "foreign-owner":
        for item in (library, folder / f"{name}.so.sha256"):
            os.chown(item, FOREIGN_UID, FOREIGN_UID)
    else:
        folder.chmod(0o777)
    # a second process loads the cache (this one already holds the honest library under that name)
    code = ("import sys; from pathlib import Path; from infer_tune import native; "
            f"print(native.build_library(Path({str(folder)!r}), {name!r}, [Path({str(src)!r})]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "the planted library was loaded"
    used = Path(done.stdout.strip().splitlines()[-1])
    if attack == "foreign-owner":  # the folder is ours: the foreign files are removed and the library rebuilt
        assert used == folder
        assert library.stat().st_uid == os.getuid()
        assert (folder / f"{name}.so.sha256").read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    else:  # a folder others can write: built into a private temp folder instead, said on stderr
        assert used != folder
        assert "writable by group or others" in done.stderr and "building them into" in done.stderr


@needs_compiler
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A library cut short (a full disk, a killed copy) dies with SIGBUS when loaded; its digest catches it."""
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    name = _name()
    folder = paths.home() / "kernels" / "native-fake"
    src = _fake_source(tmp_path)
    native.build_library(folder, name, [src])
    library = folder / f"{name}.so"
    whole = library.read_bytes()
    _swap_in(library, whole[: len(whole) // 3])
    code = ("from pathlib import Path; from infer_tune import native; "
            f"native.build_library(Path({str(folder)!r}), {name!r}, [Path({str(src)!r})])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert len(library.read_bytes()) == len(whole)
    assert (folder / f"{name}.so.sha256").read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()


@needs_root
@pytest.mark.parametrize("attack", ["foreign-owner", "world-writable", "bin-world-writable"])
def test_llama_server_of_another_account_is_refused(tmp_path, monkeypatch, attack):
    from infer_tune.engines.launched import server_binary
    from infer_tune.errors import ConfigError

    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    binary = paths.private_dir(paths.home() / "bin") / "llama-server"
    binary.write_text("#!/bin/sh\ntouch planted-server-ran\n")
    binary.chmod(0o755)
    assert server_binary() == binary
    if attack == "foreign-owner":
        os.chown(binary, FOREIGN_UID, FOREIGN_UID)
    elif attack == "world-writable":
        binary.chmod(0o777)
    else:
        binary.parent.chmod(0o777)
    with pytest.raises(ConfigError, match="refusing to run .*llama-server") as caught:
        server_binary()
    assert "\n" not in str(caught.value)


# ---- 3. a killed first build --------------------------------------------------------------------------------


@needs_compiler
def test_a_dead_builders_lock_does_not_hang_the_next_load(tmp_path, monkeypatch):
    """A build killed mid-way (`timeout -s TERM 6 infer-tune bench ...`) leaves torch's `lock` file behind;
    the next load takes it over and finishes in bounded time instead of waiting forever."""
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    name = _name()
    folder = paths.private_dir(paths.home() / "kernels" / "native-fake")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / "lock").write_text(f"{dead.pid}\n")  # the dead builder's lock
    (folder / "build.flock").write_text(f"{dead.pid}\n")
    src = _fake_source(tmp_path)
    code = ("from pathlib import Path; from infer_tune import native; "
            f"native.build_library(Path({str(folder)!r}), {name!r}, [Path({str(src)!r})]); print('loaded')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    assert not (folder / "lock").exists()


def _lines_until(stream, text: str, seconds: float) -> str:
    """The lines on `stream` up to and including the first holding `text` (or up to its end); fails the test past
    `seconds` (a bounded wait; a warning printed first does not end it)."""
    import select

    deadline, seen = time.monotonic() + seconds, ""
    while text not in seen:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no line holding {text!r} in {seconds} s; printed: {seen!r}"
        line = stream.readline()
        if not line:  # the end of the stream: the child exited without printing it
            break
        seen += line
    return seen


@needs_compiler
def test_a_live_builder_is_waited_for(tmp_path, monkeypatch):
    """Two processes building the same folder: the second waits for the first (names it) and loads its build."""
    import fcntl

    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    folder = paths.private_dir(paths.home() / "kernels" / "native-fake")
    fd = os.open(folder / "build.flock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    src = _fake_source(tmp_path)
    code = ("from pathlib import Path; from infer_tune import native; "
            f"native.build_library(Path({str(folder)!r}), {_name()!r}, [Path({str(src)!r})]); print('loaded')")
    waiting = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        # hold the lock until the child says it waits (its imports alone take seconds on a loaded host);
        # a child that finished without waiting would close stderr first
        first = _lines_until(waiting.stderr, "waiting for process", seconds=120)
        assert waiting.poll() is None, first
    finally:
        os.close(fd)
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and "loaded" in out, first + err
    assert f"waiting for process {os.getpid()}" in first


# ---- 2. listeners beyond loopback -------------------------------------------------------------------------


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them


def listening_addresses(pid: int) -> list[str]:
    """The local addresses (`HEXIP:HEXPORT`) of `pid`'s listening TCP sockets, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def _report_listeners(rank, world, payload):
    import torch.distributed as dist

    dist.barrier()  # every rank's store and gloo connections are up
    return {"listening": listening_addresses(os.getpid())}


def test_the_multiprocess_rendezvous_listens_on_loopback_only():
    """Spawned ranks (what `experts validate` runs on): torch's TCPStore and gloo listened on every interface."""
    from infer_tune.runners import multiprocess

    readings = multiprocess.launch(_report_listeners, None, procs=2, threads=1)
    listening = [address for reading in readings for address in reading["listening"]]
    assert listening, "the ranks should be listening (store and gloo)"
    assert all(address.split(":")[0] in LOOPBACK for address in listening), listening


@pytest.mark.parametrize(("address", "env", "loopback"), [
    (None, None, True), ("127.0.0.1:6379", None, True), ("localhost:6379", None, True), ("auto", None, True),
    (None, "127.0.0.1:6379", True), ("10.0.0.2:6379", None, False), (None, "10.0.0.2:6379", False),
    ("ray://127.0.0.1:10001", None, False),  # the Ray client opens no listener of its own
])
def test_the_ray_driver_stays_on_loopback_unless_an_address_is_named(monkeypatch, address, env, loopback):
    from infer_tune.executors import ray_init_args

    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ray_init_args(address)
    assert args["address"] == (address or "auto")
    assert (args.get("_node_ip_address") == "127.0.0.1") is loopback


# ---- 10. native ops called with bad arguments; the cache key -----------------------------------------------

NATIVE_CASES = r'''
import sys, torch
from infer_tune import native
native.w4a8()
ops = torch.ops.infer_tune_native
u8 = lambda n: torch.zeros(n, dtype=torch.uint8)
f32 = lambda *s: torch.zeros(*s)

def step_args(**change):
    """A valid one-layer LlamaStep (hidden 64, 2 heads of 32, 1 kv head, group 32, w4a8 head of 16; native/step.py's
    argument layout: 17 parts a layer, the absent ones empty), then `change`."""
    pb = lambda n, k, g=32: (n // 8) * (k // g) * (32 + 4 * g)
    none = torch.zeros(0)
    layer = [f32(64), u8(pb(64, 64)), u8(pb(32, 64)), u8(pb(32, 64)), u8(pb(64, 64)), u8(pb(64, 64)),
             u8(pb(64, 64)), u8(pb(64, 64)), f32(64)] + [none] * 8
    args = dict(weights=layer + [f32(64), u8(pb(16, 64)).view(2, 2, 160)], keys=[f32(1, 1, 8, 32)], values=[f32(1, 1, 8, 32)],
                lengths=[], inv_freq=f32(1, 16), ints=[1, 2, 1, 32, 64, 64, 32, 32, 0, 1, 0, 0],
                floats=[1e-5, 32 ** -0.5, 0.0, 1.0])
    args.update(change)
    return args

def make_step(**change):
    a = step_args(**change)
    s = torch.classes.infer_tune_native.LlamaStep(a["weights"], a["keys"], a["values"], a["lengths"], a["inv_freq"],
                                                  a["ints"], a["floats"])
    return s.step(f32(1, 64), 0)

def ints(**kw):
    names = ["layers", "heads", "kv_heads", "head_dim", "hidden", "inter", "group", "head_group", "act", "ropes",
             "window", "rope"]
    base = step_args()["ints"]
    return [kw.get(n, v) for n, v in zip(names, base)]

cases = {
    "valid step": lambda: make_step(),
    "w4a8_mm group 0": lambda: ops.w4a8_mm(f32(2, 0), torch.zeros(1, 0, 32, dtype=torch.uint8), 0),
    "w4a8_mm group -32": lambda: ops.w4a8_mm(f32(2, 64), torch.zeros(1, 2, 32, dtype=torch.uint8), -32),
    "decode_attention 0 kv heads": lambda: ops.decode_attention(f32(1, 4, 1, 8), f32(1, 0, 5, 8), f32(1, 0, 5, 8), None, 1.0),
    "decode_attention empty cache": lambda: ops.decode_attention(f32(1, 4, 1, 8), f32(1, 2, 0, 8), f32(1, 2, 0, 8), None, 1.0),
    "step 0 layers": lambda: make_step(weights=[f32(64), u8(640).view(2, 2, 160)], keys=[], values=[], ints=ints(layers=0)[:10]),
    "step 0-row cache": lambda: make_step(keys=[f32(0, 1, 8, 32)], values=[f32(0, 1, 8, 32)]),
    "step 0-length cache": lambda: make_step(keys=[f32(1, 1, 0, 32)], values=[f32(1, 1, 0, 32)]),
    "step 0 kv heads": lambda: make_step(keys=[f32(1, 0, 8, 32)], values=[f32(1, 0, 8, 32)], ints=ints(kv_heads=0)),
    "step group 0": lambda: make_step(ints=ints(group=0)),
    "step overflowing sizes": lambda: make_step(ints=ints(hidden=1 << 62, inter=1 << 62)),
    "step undersized q weight": lambda: make_step(weights=step_args()["weights"][:1] + [u8(16)] + step_args()["weights"][2:]),
    "step undersized head": lambda: make_step(weights=step_args()["weights"][:-1] + [u8(320).view(2, 1, 160)]),
    "step position past the cache": lambda: torch.classes.infer_tune_native.LlamaStep(*step_args().values()).step(f32(1, 64), 8),
}
for name, call in cases.items():
    try:
        call()
        print(f"{name}: ran", flush=True)
    except RuntimeError as exc:
        print(f"{name}: raised {str(exc).splitlines()[0][:120]}", flush=True)
'''


@needs_compiler
def test_native_ops_raise_on_bad_arguments_instead_of_crashing():
    """Division by zero (group 0, no kv heads), SIGSEGV (0 layers, a 0-row cache, overflowing sizes) and reads past
    undersized weights, each called directly: a Python error each, the process alive (run apart: a crash would
    take pytest down)."""
    ok, detail = native.available()
    if not ok:
        pytest.skip(detail)
    done = subprocess.run([sys.executable, "-c", NATIVE_CASES], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert done.returncode == 0, f"crashed ({done.returncode}) after {list(lines)}: {done.stderr[-500:]}"
    assert lines.pop("valid step") == "ran"
    assert len(lines) == 13 and all(outcome.startswith("raised") for outcome in lines.values()), lines


def test_the_kernel_cache_key_covers_the_whole_isa():
    """Two CPU generations that differ only in avx512vl / bmi2 / vbmi shared one cached library (SIGILL on the older)."""
    base = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni\n"
    seen = set()
    for extra in ("", " avx512vl", " avx512dq", " bmi2", " avx512vbmi", " amx_tile"):
        info = base.replace("avx512_vnni", "avx512_vnni" + extra)
        seen.add(tuple(native.all_cpu_flags(info)))
    assert len(seen) == 6
    assert native.all_cpu_flags(base.replace("avx2 fma", "fma avx2")) == native.all_cpu_flags(base)


# ---- 13. resource caps and leftovers -------------------------------------------------------------------------


def test_workers_are_capped_by_the_cores(tmp_path):
    from typer.testing import CliRunner

    from infer_tune.cli import app
    from infer_tune.endpoint.config import EndpointConfig, _cores
    from infer_tune.errors import ConfigError

    EndpointConfig(url="http://127.0.0.1:9/v1", workers=_cores())
    with pytest.raises(ConfigError, match=f"at most the {_cores()} cores"):
        EndpointConfig(url="http://127.0.0.1:9/v1", workers=_cores() + 1)
    bad = CliRunner().invoke(app, ["endpoint", "sim", "--endpoint", "http://127.0.0.1:9/v1", "--workers", "100000",
                                   "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "workers must be at most" in bad.output, bad.output
    assert "Traceback" not in bad.output and not (tmp_path / "bad").exists()


def test_killed_runs_scratch_folders_are_removed_by_the_next_run(tmp_path, monkeypatch):
    """A run killed with SIGKILL left ~260 MB of quantized checkpoints in `infer-tune-artifacts-*` each time."""
    import time

    from infer_tune import atomic

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    code = ("import os, signal; from infer_tune import atomic; d = atomic.artifacts_dir(); "
            "(d / 'model.safetensors').write_bytes(b'x' * 4096); print(d, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    left = Path(killed.stdout.strip())
    assert killed.returncode == -9 and left.is_dir() and left.parent == tmp_path
    old_unnamed = tmp_path / "infer-tune-artifacts-abc123"
    new_unnamed = tmp_path / "infer-tune-artifacts-def456"
    live = tmp_path / f"infer-tune-artifacts-{os.getppid()}-x"  # a run still going (pytest's parent)
    for folder in (old_unnamed, new_unnamed, live):
        folder.mkdir()
    os.utime(old_unnamed, (time.time() - 7200, time.time() - 7200))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "infer-tune-artifacts-1-link").symlink_to(target)
    with atomic.scratch() as mine:
        assert mine.name.startswith(f"infer-tune-artifacts-{os.getpid()}-")
        assert not left.exists() and not old_unnamed.exists()
        assert new_unnamed.exists() and live.exists() and target.exists()
        assert (tmp_path / "infer-tune-artifacts-1-link").is_symlink()
    assert not mine.exists()
    if os.getuid() == 0:  # another user's folder is never touched
        foreign = tmp_path / "infer-tune-artifacts-999999-f"
        foreign.mkdir()
        os.chown(foreign, FOREIGN_UID, FOREIGN_UID)
        atomic.clean_stale_artifacts(str(tmp_path))
        assert foreign.exists()
