"""The `infer-tune` command: a tiny root that wires command groups (one module each)."""

from __future__ import annotations

import os
import warnings

import typer

from infer_tune.cli import bench as bench_cmd
from infer_tune.cli import compare as compare_cmd
from infer_tune.cli import env_cmd, models_cmd
from infer_tune.cli import kv_cache as kv_cache_cmd
from infer_tune.cli import leaderboard as leaderboard_cmd
from infer_tune.cli import quantize as quantize_cmd


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


app = typer.Typer(
    name="infer-tune",
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


def main() -> None:
    app()
