"""A process that imports infer-tune once, then runs CLI commands in forked children: a test can SIGKILL a
command at any point without paying the import (torch, transformers: seconds) for each kill.

Protocol (one JSON line each way): the test writes `{"argv": [...], "log": path}` (the child's stdout and
stderr go to `log`). For each command this process writes `{"pid": N}` when the child is forked and `{"pid": N, "status": S}` when
it ended (S: exit code, or -signal). An empty line ends it."""

from __future__ import annotations

import json
import os
import sys

import infer_tune.cli  # noqa: F401 (imported before any fork: what the children share)


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 1
            try:
                infer_tune.cli.app(request["argv"], prog_name="infer-tune")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"pid": pid, "status": code}), flush=True)


if __name__ == "__main__":
    main()
