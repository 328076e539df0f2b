"""The `infer-tune` command: a tiny root that wires command groups (one module each) and maps errors once.

Exit codes: 0 success, 1 regression (`compare --fail-if` only), 2 bad input (one `error:` line),
3 internal error (one line plus the path of a log file holding the traceback), 130 interrupted.
`--debug` on any command shows the traceback instead.
"""

from __future__ import annotations

import os
import warnings

import typer
from typer.core import TyperGroup

from infer_tune.cli import bench as bench_cmd
from infer_tune.cli import compare as compare_cmd
from infer_tune.cli import env_cmd, models_cmd, output
from infer_tune.cli import kv_cache as kv_cache_cmd
from infer_tune.cli import leaderboard as leaderboard_cmd
from infer_tune.cli import quantize as quantize_cmd
from infer_tune.cli import speculate as speculate_cmd
from infer_tune.errors import InferTuneError

INTERNAL_ERROR = 3


def _quiet_libraries() -> None:
    """Keep stdout clean for --json and stderr readable: library chatter is not our output."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
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
        except Exception as exc:
            if output.state.debug or type(exc).__module__.startswith("click"):
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


@app.callback()
def root() -> None:
    """Apply real LLM-inference optimizations to a real model; measure speed and quality drift in one leaderboard."""
    _quiet_libraries()


app.command("bench")(bench_cmd.bench)
app.command("env")(env_cmd.env)
app.add_typer(models_cmd.app, name="models")
app.command("leaderboard")(leaderboard_cmd.leaderboard)
app.command("compare")(compare_cmd.compare)
app.command("quantize")(quantize_cmd.quantize)
app.command("kv-cache")(kv_cache_cmd.kv_cache)
app.add_typer(speculate_cmd.app, name="speculate")


def main() -> None:
    app()
