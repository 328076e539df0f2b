"""The `infer-tune` command: a tiny root that wires command groups (one module each) and maps errors once.

Exit codes: 0 success, 1 regression (`compare` only), 2 bad input (one `error:` line),
3 internal error (one line plus the path of a log file holding the traceback), 4 inconclusive
(`compare` only, docs/compare.md), 130 interrupted.
`--debug` on any command shows the traceback instead.
"""

from __future__ import annotations

import errno
import os
import warnings

import typer
from typer.core import TyperGroup

from infer_tune.cli import batch as batch_cmd
from infer_tune.cli import bench as bench_cmd
from infer_tune.cli import compare as compare_cmd
from infer_tune.cli import endpoint as endpoint_cmd
from infer_tune.cli import env_cmd, models_cmd, output
from infer_tune.cli import experts as experts_cmd
from infer_tune.cli import kv_cache as kv_cache_cmd
from infer_tune.cli import leaderboard as leaderboard_cmd
from infer_tune.cli import quantize as quantize_cmd
from infer_tune.cli import serve as serve_cmd
from infer_tune.cli import speculate as speculate_cmd
from infer_tune.cli import tune as tune_cmd
from infer_tune.errors import InferTuneError

INTERNAL_ERROR = 3


def _quiet_libraries() -> None:
    """Keep stdout clean for --json and stderr readable: library chatter is not our output."""
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    for name in ("datasets", "huggingface_hub", "transformers", "torch", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # their errors come back to us as exceptions
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass


def _write_crash_log(exc: BaseException) -> str:
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="infer-tune-crash-", suffix=".log")
    with os.fdopen(fd, "w") as handle:
        handle.write("".join(traceback.format_exception(exc)))
    return path


def _is_click_error(exc: BaseException) -> bool:
    """A click (or typer's vendored click) ClickException: a usage error of the command line."""
    return any(cls.__name__ == "ClickException" and cls.__module__.startswith(("click", "typer._click"))
               for cls in type(exc).__mro__)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise on the closed pipe."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # an unusable environment (exit 2), not a bug of infer-tune


class ErrorMappingGroup(TyperGroup):
    """The root group: every command's errors become one line and an exit code, here and only here."""

    def invoke(self, ctx):
        output.state.debug = False
        try:
            return super().invoke(ctx)
        except InferTuneError as exc:
            if output.state.debug:
                raise
            output.error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            output.error("interrupted; finished runs are kept, rerun with --resume to continue")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort):
            raise
        except BrokenPipeError:  # `infer-tune ... | head`: the reader left; nothing went wrong here
            _silence_stdout()
            raise typer.Exit(0) from None
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in DISK_FULL and not output.state.debug:
                where = f" writing {exc.filename}" if exc.filename else ""
                output.error(f"the disk is full{where} ({exc.strerror or 'no space left on device'}): nothing "
                             "half-written was kept and earlier results are intact; free some space and rerun (with "
                             "--resume where the command has it)")
                raise typer.Exit(2) from None
            if _is_click_error(exc) and not output.state.debug:  # bad flags or values: bad input, one line
                message = " ".join(exc.format_message().split())
                output.error(f"{message} (see {ctx.command_path} {ctx.invoked_subcommand or ''} --help)"
                             .replace("  ", " "))
                raise typer.Exit(2) from None
            if output.state.debug or _is_click_error(exc):
                raise
            where = _write_crash_log(exc)
            output.error(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                         f"(traceback in {where}; rerun with --debug to see it)")
            raise typer.Exit(INTERNAL_ERROR) from None


app = typer.Typer(
    name="infer-tune",
    cls=ErrorMappingGroup,
    help="Apply real LLM-inference optimizations to a real model; measure speed and quality drift in one leaderboard.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _no_writes_for_others() -> None:
    """Nothing infer-tune creates is writable by the group or others, whatever the umask (`umask 000` made a
    pulled model, GGUF folders and run folders world-writable: another account could swap what is loaded,
    run or reported). Reading stays as the umask allows (CI artifacts); the home is private anyway."""
    os.umask(os.umask(0o077) | 0o022)


@app.callback()
def root() -> None:
    """Apply real LLM-inference optimizations to a real model; measure speed and quality drift in one leaderboard."""
    from infer_tune import results

    _no_writes_for_others()
    _quiet_libraries()
    results.set_warning_handler(output.warn)  # a result file skipped while listing: one warning line


app.command("bench")(bench_cmd.bench)
app.command("env")(env_cmd.env)
app.add_typer(models_cmd.app, name="models")
app.command("leaderboard")(leaderboard_cmd.leaderboard)
app.command("compare")(compare_cmd.compare)
app.command("quantize")(quantize_cmd.quantize)
app.command("kv-cache")(kv_cache_cmd.kv_cache)
app.add_typer(batch_cmd.app, name="batch")
app.add_typer(endpoint_cmd.app, name="endpoint")
app.add_typer(experts_cmd.app, name="experts")
app.command("tune")(tune_cmd.tune)
app.add_typer(speculate_cmd.app, name="speculate")
app.command("serve")(serve_cmd.serve)


def main() -> None:
    app()
