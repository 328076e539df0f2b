"""pass@1 runs hostile completions inside the OS sandbox: every escape attempt is contained and
scored as failed, nothing leaks to the host (files, network, processes), nothing hangs the run."""

from __future__ import annotations

import os
import socket
import textwrap
import threading
from pathlib import Path

import pytest

from infer_tune.metrics import passk, sandbox

# one xdist worker runs every test that starts sandboxed programs (test_sandbox.py checks none is left running)
pytestmark = pytest.mark.xdist_group("sandbox")

PROBLEM = {
    "task_id": "Toy/0",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


@pytest.fixture(scope="module")
def box():
    found = sandbox.find()
    if not isinstance(found, sandbox.Sandbox):
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the sandbox tests: {found}")
        pytest.skip(f"no sandbox here: {found}")
    return found


@pytest.fixture()
def listener():
    """A TCP server on loopback that records every connection it gets."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    seen.append(conn.recv(100))
                except OSError:
                    seen.append(b"")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], seen
    stop.set()
    thread.join(2)
    server.close()


def body(code: str) -> str:
    """A completion: the hostile code, then the right answer only if the code got its way."""
    return textwrap.indent(textwrap.dedent(code).strip() + "\nreturn a + b\n", "    ")


def program_processes(grace_s: float = 5.0) -> list[int]:
    """PIDs of processes still running a sandboxed program.py after `grace_s` (killed namespaces
    are torn down by the kernel asynchronously; none may survive)."""
    import time

    deadline = time.monotonic() + grace_s
    while (found := _program_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _program_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"program.py" in cmdline and b"pytest" not in cmdline:
                found.append(int(entry.name))
    return found


HOME_MARKER = Path.home() / "infer-tune-sandbox-escape-test"


def home_entries() -> set[str]:
    """Names in the real home (minus the way to the Python install, which the sandbox mounts)."""
    python_prefix = Path(sandbox._interpreter()[1])
    mounted = {python_prefix.relative_to(Path.home()).parts[0]} if python_prefix.is_relative_to(Path.home()) else set()
    return set(os.listdir(Path.home())) - mounted or {"(empty home)"}


def hostile(marker: Path, secret: Path, port: int) -> dict[str, str]:
    write = f"echo pwned > {marker}"
    check = f"assert open({str(marker)!r}).read().strip() == 'pwned'"
    return {
        "posix.system": body(f"import posix\nposix.system({write!r})\n{check}"),
        "ctypes libc.system": body(f"import ctypes\nctypes.CDLL(None).system({write.encode()!r})\n{check}"),
        "os.posix_spawn": body(f"import os\npid = os.posix_spawn('/bin/sh', ['sh', '-c', {write!r}], {{}})\n"
                               f"os.waitpid(pid, 0)\n{check}"),
        "importlib.reload(os)": body(f"import importlib, os\nos = importlib.reload(os)\nos.system({write!r})\n{check}"),
        "_socket": body(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.sendall(b'pwned')"),
        "socket to loopback": body(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2).sendall(b'x')"),
        "socket to the internet": body("import socket\nsocket.create_connection(('1.1.1.1', 53), 2)"),
        "read a host secret": body(f"assert open({str(secret)!r}).read() == 'id_rsa'"),
        "read the real home": body(f"import os\nassert set(os.listdir({str(Path.home())!r})) & {home_entries()!r}"),
        "write into the real home": body(f"open({str(HOME_MARKER)!r}, 'w').write('pwned')"),
        "write outside tmp": body(f"open({str(marker)!r}, 'w').write('pwned')\n{check}"),
        "write into /usr": body("open('/usr/pwned', 'w').write('x')"),
        "fork bomb": body("import os\nwhile True:\n    os.fork()"),
        "10 GB on stderr": body("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(10240):\n"
                                "    sys.stderr.write(chunk)\n    sys.stderr.flush()"),
        "setsid grandchild": body(f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3)\n"
                                  f"    open({str(marker)!r}, 'w').write('pwned')\n    time.sleep(600)\n"
                                  "assert False, 'parent gives up; the grandchild must not outlive the run'"),
    }


def test_hostile_completions_are_contained(box, tmp_path, listener):
    port, seen = listener
    marker = tmp_path / "escaped"
    home = tmp_path / "home" / ".ssh"
    home.mkdir(parents=True)
    secret = home / "id_rsa"
    secret.write_text("id_rsa")
    cases = hostile(marker, secret, port)
    items = passk.evaluate([PROBLEM] * len(cases), list(cases.values()), timeout_s=20.0)
    outcome = {name: item.status for name, item in zip(cases, items, strict=True)}
    assert all(status in ("failed", "timeout") for status in outcome.values()), outcome
    assert outcome["fork bomb"] == "failed" and outcome["10 GB on stderr"] == "failed", outcome
    escaped_home = HOME_MARKER.exists()
    HOME_MARKER.unlink(missing_ok=True)
    assert not marker.exists() and not escaped_home, "a sandboxed program wrote to the host"
    assert seen == [], "a sandboxed program reached a host socket"
    assert not (Path("/usr") / "pwned").exists()
    assert program_processes() == [], "a sandboxed process outlived its run"
    assert all(len(item.detail) <= 500 for item in items)


def test_honest_completions_still_score(box):
    items = passk.evaluate([PROBLEM] * 3, ["    return a + b\n", "    return a - b\n",
                                           "    import os, tempfile\n    open('scratch', 'w').write('ok')\n"
                                           "    assert tempfile.gettempdir() == '/tmp'\n    return a + b\n"],
                           timeout_s=30.0)
    assert [i.status for i in items] == ["passed", "failed", "passed"], items
    assert "AssertionError" in items[1].detail


def test_canonical_humaneval_solutions_pass_in_the_sandbox(box):
    """The sandbox does not break honest programs: HumanEval's own solutions all pass in it."""
    from infer_tune.suites import SuiteSpec, load_suite

    problems = load_suite(SuiteSpec("code", limit=16))
    items = passk.evaluate(problems, [p.reference for p in problems], timeout_s=30.0)
    assert [i.task_id for i in items if not i.passed] == []


CTRL_C_CHILD = """
import os, signal, sys, threading
from infer_tune.metrics import passk
problem = {problem!r}
program = passk.build_program(problem["prompt"], "    import time\\n    time.sleep(600)\\n", problem["test"], "add")
# a process started in the background by a shell inherits SIGINT ignored: Ctrl-C as a terminal delivers it
signal.signal(signal.SIGINT, signal.default_int_handler)
timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
timer.start()
try:
    passk.run_program(program, timeout_s=60.0)
except KeyboardInterrupt:
    sys.exit(0)
finally:
    timer.cancel()
sys.exit(3)  # the program ran to its end: Ctrl-C did not stop it
"""


def test_ctrl_c_kills_the_sandboxed_program(box):
    """Ctrl-C while a sandboxed program runs: KeyboardInterrupt reaches the caller and no program survives. In a
    process of its own: a SIGINT sent to the test worker itself can take the worker down with it (xdist reads it
    as a crashed node)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", CTRL_C_CHILD.format(problem=PROBLEM)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert program_processes() == []


def test_no_sandbox_refuses_with_the_install_command(monkeypatch):
    monkeypatch.setattr(sandbox, "_found", {os.geteuid(): "bubblewrap is not installed (`apt-get install bubblewrap`)"})
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap"):
        passk.pass_at_1([PROBLEM], ["    return a + b\n"])
    # unsafe mode is explicit, and still scores (rlimits + prelude only)
    assert passk.pass_at_1([PROBLEM], ["    return a + b\n"], timeout_s=30.0, isolation="unsafe") == 1.0


def test_cli_execute_refuses_without_a_sandbox(monkeypatch, tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from infer_tune.cli import app

    monkeypatch.setattr(sandbox, "_found", {os.geteuid(): "bubblewrap is not installed (`apt-get install bubblewrap`)"})
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir), "--suite", "code", "--execute",
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "apt-get install bubblewrap" in lines[0] and "unsafe" in lines[0]
    assert not out.exists()


# --------------------------------------------------------------------------- issue 21: as root, and gaming
def namespace_and_kernel_attacks() -> dict[str, str]:
    """Completions that try what the kernel offers besides files and sockets; each must fail."""
    import platform

    from infer_tune.metrics import seccomp

    nr = seccomp.ARCHES.get(platform.machine(), (0, {}))[1]
    libc = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    return {
        "nested user namespace, then a tmpfs": body(
            f"{libc}import os\nuid, gid = os.getuid(), os.getgid()\nassert libc.unshare(0x10000000 | 0x20000) == 0\n"
            "open('/proc/self/setgroups', 'w').write('deny')\nopen('/proc/self/uid_map', 'w').write(f'0 {uid} 1')\n"
            "open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')\n"
            "os.makedirs('/tmp/m')\n"
            "assert libc.mount(b'none', b'/tmp/m', b'tmpfs', 0, b'size=21g') == 0\n"
            "open('/tmp/m/big', 'wb').write(b'x' * (512 << 10))"),
        "mount over /tmp": body(f"{libc}assert libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0"),
        "SysV shared memory": body(f"{libc}assert libc.shmget(0, 1 << 30, 0o1000 | 0o600) >= 0"),
        "SysV message queue": body(f"{libc}assert libc.msgget(0, 0o1000 | 0o600) >= 0"),
        "ptrace": body(f"{libc}assert libc.ptrace(0, 0, 0, 0) == 0"),
        "keyring write": body(f"{libc}assert libc.syscall({nr.get('add_key', -1)}, b'user', b'infer-tune-test', "
                              "b'secret', 6, -4) > 0"),  # KEY_SPEC_USER_KEYRING
        "keyring read": body(f"{libc}assert libc.syscall({nr.get('request_key', -1)}, b'user', b'infer-tune-test', "
                             "None, 0) > 0"),
        "bpf": body(f"{libc}assert libc.syscall({nr.get('bpf', -1)}, 0, None, 0) >= 0"),
        "fill /tmp past its size": body("for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * ((1 << 20) - 1))"),
        "sys.exit(0) before check": "    import sys\n    sys.exit(0)\n",
        "atexit os._exit(0)": "    import atexit, os\n    atexit.register(lambda: os._exit(0))\n    return a - b\n",
        "os._exit(0) from check": "    import os\n    os._exit(0)\n",
        "print a guessed marker": "    print('passed')\n    print('0' * 32)\n    import sys\n    sys.exit(0)\n",
    }


def test_kernel_attacks_and_exit_status_games_fail(box):
    import tempfile

    cases = namespace_and_kernel_attacks()
    before = set(os.listdir(tempfile.gettempdir()))
    items = passk.evaluate([PROBLEM] * len(cases), list(cases.values()), timeout_s=20.0)
    outcome = {name: (item.status, item.detail) for name, item in zip(cases, items, strict=True)}
    assert all(status == "failed" for status, _ in outcome.values()), outcome
    assert "no completion marker" in outcome["sys.exit(0) before check"][1]
    assert "No space left" in outcome["fill /tmp past its size"][1] or "File too large" in \
        outcome["fill /tmp past its size"][1], outcome
    assert {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("infer-tune-")} == set()
    assert program_processes() == []


def test_sandbox_description_says_how_it_runs(box):
    assert "seccomp filter" in box.description and "MiB /tmp" in box.description
    if os.geteuid() == 0 and box.mode == "userns":
        assert box.start_as == sandbox.NOBODY  # bwrap itself runs unprivileged: a fresh user namespace


def test_seccomp_program_is_well_formed():
    from infer_tune.metrics import seccomp

    for machine in seccomp.ARCHES:
        prog = seccomp.program(machine)
        assert len(prog) % 8 == 0 and 20 < len(prog) // 8 < 255
        first = struct_unpack(prog[:8])
        assert first == (seccomp.LD_ABS_W, 0, 0, seccomp.OFF_ARCH)
        assert struct_unpack(prog[-16:-8])[3] == seccomp.RET_ALLOW
        assert struct_unpack(prog[-8:])[3] == seccomp.RET_ERRNO | seccomp.EPERM
    with pytest.raises(seccomp.Unsupported):
        seccomp.program("mips")


def struct_unpack(insn: bytes) -> tuple[int, int, int, int]:
    import struct

    return struct.unpack("=HBBI", insn)


def test_stale_staging_folders_are_removed_but_live_ones_kept(tmp_path):
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"infer-tune-passk-{gone.pid}-abc"
    live = tmp_path / f"infer-tune-passk-{os.getpid()}-def"
    old = tmp_path / "infer-tune-passk-k2j3h4"  # an older infer-tune's name, no pid: kept while recent
    target = tmp_path / "elsewhere"
    for folder in (dead, live, old, target):
        folder.mkdir()
        (folder / "program.py").write_text("x")
    (tmp_path / f"infer-tune-passk-{gone.pid}-link").symlink_to(target)
    removed = passk.clean_stale_staging(str(tmp_path))
    assert removed == [str(dead)] and live.exists() and old.exists() and (target / "program.py").exists()
    os.utime(old, (0, 0))
    assert passk.clean_stale_staging(str(tmp_path)) == [str(old)]


def test_a_killed_parent_leaves_no_staging_behind(box, tmp_path):
    """SIGKILL of infer-tune mid-program: the sandbox path never names a file in the temp directory, and an
    unsafe run's folder is removed by the next evaluation."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = ("import sys\nfrom infer_tune.metrics import passk\n"
            "program = passk.build_program('def add(a, b):\\n', '    import time\\n    time.sleep(60)\\n', "
            "'def check(c):\\n    c(1, 2)\\n', 'add')\n"
            "print('start', flush=True)\npasskw = passk.run_program(program, timeout_s=50, isolation=sys.argv[1])\n")
    for isolation in ("sandbox", "unsafe"):
        parent = subprocess.Popen([sys.executable, "-c", code, isolation], env=env, stdout=subprocess.PIPE)
        assert parent.stdout.readline().strip() == b"start"
        time.sleep(2)
        parent.kill()
        parent.wait()
        left = [p.name for p in tmp_path.iterdir() if p.name.startswith("infer-tune-")]
        if isolation == "sandbox":
            assert left == []
        else:
            assert len(left) == 1 and passk.clean_stale_staging(str(tmp_path)) == [str(tmp_path / left[0])]
    assert program_processes() == []


def test_cgroup_limits_are_written_where_cgroup_v2_is_delegated(tmp_path, monkeypatch):
    """On a fake cgroup v2 tree (this host may be v1): memory (no swap) and pids limits go in the run's own group."""
    from infer_tune.metrics import cgroups

    (tmp_path / "cgroup.controllers").write_text("cpu memory pids")
    (tmp_path / "cgroup.subtree_control").write_text("memory pids")
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own_cgroup", lambda root: root)
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 0)
    group = cgroups.create(1 << 30, 16)
    assert group is not None and group.path.parent == tmp_path
    assert (group.path / "memory.max").read_text() == str(1 << 30) and (group.path / "pids.max").read_text() == "16"
    assert group.path.name.startswith(f"infer-tune-passk-{os.getpid()}-")


# --------------------------------------------------------------------------- the caller's secrets, the token
SECRET = "sk-infer-tune-test-4e1f0c"


def test_the_callers_environment_is_out_of_reach(box, monkeypatch):
    """An API key in the caller's environment: not in the program's os.environ, not in any /proc/<pid>/environ it
    can see (bwrap was pid 1 of the namespace with the caller's whole environment), and no host process in view."""
    monkeypatch.setenv("INFER_TUNE_TEST_API_KEY", SECRET)
    completion = body(f"""
        import os
        seen = repr(dict(os.environ))
        for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
            try:
                seen += open(f'/proc/{{pid}}/environ', 'rb').read().decode(errors='replace')
            except OSError:
                pass
        if {SECRET!r} not in seen and len([p for p in os.listdir('/proc') if p.isdigit()]) < 8:
            return a - b  # contained: nothing of the caller found, only the sandbox's few processes
    """)
    [item] = passk.evaluate([PROBLEM], [completion], timeout_s=20.0)
    assert item.status == "failed", item


FRAME_ATTACKS = {
    "the caller's frame": "    return a - b\nimport os, sys\nprint(sys._getframe(1).f_locals['token'].decode())\n"
                          "sys.stdout.flush()\nos._exit(0)\n",
    "every frame and fd": ("    return a - b\nimport os, re, sys\nfound = []\nframe = sys._getframe(0)\n"
                           "while frame is not None:\n"
                           "    found += [v.decode() if isinstance(v, bytes) else v for v in frame.f_locals.values()"
                           " if isinstance(v, (bytes, str)) and re.fullmatch(rb'[0-9a-f]{32}' if isinstance(v, bytes)"
                           " else r'[0-9a-f]{32}', v.strip())]\n    frame = frame.f_back\n"
                           "for fd in range(64):\n    try:\n        found.append(os.pread(fd, 128, 0).decode().strip())\n"
                           "    except (OSError, UnicodeDecodeError):\n        pass\n"
                           "print('\\n'.join(found))\nsys.stdout.flush()\nos._exit(0)\n"),
}


@pytest.mark.parametrize("isolation", ["sandbox", "unsafe"])
def test_the_token_is_out_of_reach_of_the_programs_frames(request, isolation):
    """`sys._getframe(1).f_locals['token']` read the harness's token and printed it: scored passed."""
    if isolation == "sandbox":
        request.getfixturevalue("box")
    items = passk.evaluate([PROBLEM] * len(FRAME_ATTACKS), list(FRAME_ATTACKS.values()), timeout_s=20.0,
                           isolation=isolation)
    outcome = {name: (item.status, item.detail) for name, item in zip(FRAME_ATTACKS, items, strict=True)}
    assert all(status == "failed" for status, _ in outcome.values()), outcome
    honest = passk.evaluate([PROBLEM], ["    return a + b\n"], timeout_s=20.0, isolation=isolation)
    assert honest[0].status == "passed", honest


# --------------------------------------------------------------------------- one memory limit for the whole program
MULTIPLY = body("""
    import os
    pids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            block = bytearray(300 << 20)  # touched: counted by the memory controller
            for i in range(0, len(block), 4096):
                block[i] = 1
            os._exit(0)
        pids.append(pid)
    if not all(os.waitpid(pid, 0)[1] == 0 for pid in pids):
        return a - b  # a child was stopped: the limit held for the program as a whole
""")


def test_the_memory_limit_holds_for_the_whole_program_or_says_it_does_not(box):
    """3 children of 300 MiB under a 512 MiB limit: where a cgroup (v2, or v1 as on hybrid hosts) holds the whole
    sandbox, one is killed; where none can, the sandbox and the row say `per process`."""
    status, detail = passk.run_program(build := passk.build_program(PROBLEM["prompt"], MULTIPLY, PROBLEM["test"],
                                                                     PROBLEM["entry_point"]),
                                       timeout_s=60.0, memory_bytes=512 << 20)
    assert build
    if box.cgroup:
        assert status == "failed", (status, detail)
        assert box.memory_limit in ("cgroup v1", "cgroup v2") and "no cgroup" not in box.description
    else:
        assert status == "passed" and box.memory_limit == "per process" and "per-process limits" in box.description
    assert passk.memory_limit() == box.memory_limit


def test_cgroup_v1_limits_are_written_where_v1_memory_is_writable(tmp_path, monkeypatch):
    """On a fake v1 tree (memory with memsw, pids): the run's groups get the limits; v2 absent."""
    from infer_tune.metrics import cgroups

    for controller in ("memory", "pids"):
        (tmp_path / controller / "own").mkdir(parents=True)
    (tmp_path / "memory" / "own" / "x").mkdir()
    monkeypatch.setattr(cgroups, "parent", lambda: None)
    monkeypatch.setattr(cgroups, "_v1_dir", lambda controller: tmp_path / controller / "own")
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 0)
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # what the kernel does: a new memory cgroup comes with its files
        real_mkdir(self, *args, **kwargs)
        if self.parent.parent.name == "memory":
            (self / "memory.memsw.limit_in_bytes").write_text("0")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert cgroups.kind() == "v1"
    group = cgroups.create(1 << 30, 16)
    assert group is not None and group.version == 1
    assert (group.path / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (group.path / "memory.memsw.limit_in_bytes").read_text() == str(1 << 30)
    assert (group.extra[0] / "pids.max").read_text() == "16"
    assert group.procs == [str(group.path / "cgroup.procs"), str(group.extra[0] / "cgroup.procs")]
