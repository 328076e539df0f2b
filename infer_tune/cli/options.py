"""The shared option group: declared once, used by every measuring command (`@measuring_command`).

A measuring command is written as `def cmd(opts: MeasureOptions, <its own options>)`; the decorator
adds every common option to its signature (so `--help` lists them, spelled the same everywhere),
collects them into one `MeasureOptions`, records which were given on the command line (a recipe's
values yield only to those), and checks their ranges with one clear line naming the flag.
Other shared options (`Json`, `Debug`, ...) are `Annotated` aliases used directly.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from infer_tune.errors import ConfigError


def _set_debug(value: bool) -> bool:
    from infer_tune.cli import output

    output.state.debug = output.state.debug or bool(value)
    return value


Model = Annotated[str, typer.Option("--model", "-m", help="Built-in alias (smollm2-135m), Hugging Face id, checkpoint dir or .gguf file.")]
Weights = Annotated[str, typer.Option("--weights", help=(
    "pretrained (the checkpoint's), or random / random:SEED: the model built from its architecture's config with "
    "seeded random weights, no download (a preset such as llama-3.2-1b, a config.json or a Hugging Face id; "
    "quality columns are n/a)."))]
Suite = Annotated[str, typer.Option("--suite", "-s", help="`chat` (ShareGPT), `code` (HumanEval), a .jsonl/.csv/.parquet file or a dataset name.")]
Limit = Annotated[int, typer.Option("--limit", "-n", help="Number of prompts, picked deterministically by --seed.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per request (pinned for timing).")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Requests per generate call (left-padded).")]
Threads = Annotated[int | None, typer.Option("--threads", help="torch intra-op threads (default: OMP_NUM_THREADS when set, else physical cores).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed for prompt sampling and bootstrap.")]
Warmup = Annotated[int, typer.Option("--warmup", help="Untimed warmup generate calls (the first is reported as first_call_ms).")]
MinIterations = Annotated[int, typer.Option("--min-iterations", help=(
    "Minimum timed passes over the workload (rounds, when candidates are measured beside the baseline; at least 3)."))]
MinDuration = Annotated[float, typer.Option("--min-duration", help="Minimum timed seconds; passes repeat until both minimums are met.")]
TargetCI = Annotated[float, typer.Option("--target-ci", help=(
    "Interleaved rounds stop when every speedup's 95% interval is within +-this % (half-width)."))]
MaxRounds = Annotated[int, typer.Option("--max-rounds", help="Most interleaved rounds before giving up on --target-ci.")]
MaxRoundSeconds = Annotated[float, typer.Option("--max-round-seconds", help=(
    "Time budget of one sweep's rounds (s); a sweep that misses --target-ci in it is flagged noisy."))]
# latency objectives of the serving commands (batch serve-sim, endpoint sim, bench --endpoint): goodput counts the
# requests that meet all of those given (metrics/saturation.py)
SloTtft = Annotated[float | None, typer.Option("--slo-ttft-ms", help="Goodput SLO: TTFT at most this many ms (from arrival).")]
SloTpot = Annotated[float | None, typer.Option("--slo-tpot-ms", help="Goodput SLO: TPOT at most this many ms.")]
SloE2e = Annotated[float | None, typer.Option("--slo-e2e-ms", help="Goodput SLO: end-to-end latency at most this many ms (from arrival).")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Runs directory; each run writes OUT/<run-id>/result.json.")]
Json = Annotated[bool, typer.Option("--json", help="Print only the result document(s) as JSON on stdout.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.", callback=_set_debug, is_eager=True)]
Lang = Annotated[str, typer.Option("--lang", help="Language of chat prompts: en, zh, ja, ko, ru or any.")]
PromptField = Annotated[str, typer.Option("--prompt-field", help="Prompt column of a file/dataset suite.")]
ReferenceField = Annotated[str | None, typer.Option("--reference-field", help="Reference column of a file/dataset suite.")]
ChatTemplate = Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Wrap prompts in the model's chat template when it has one.")]
MaxPromptTokens = Annotated[int, typer.Option("--max-prompt-tokens", help="Skip prompts longer than this (in tokens).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.")]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda or auto.")]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the checkpoint (off by default).")]
Ppl = Annotated[bool, typer.Option("--ppl/--no-ppl", help="Teacher-forced perplexity on the references.")]
Resume = Annotated[bool, typer.Option("--resume", help="Skip configs whose result (same model, config, workload, protocol, machine) is already in --out.")]
Execute = Annotated[bool, typer.Option("--execute", help=(
    "code suite: run HumanEval's tests on the outputs (pass@1) inside bubblewrap. Isolated: network (none), "
    "filesystem (only /usr, /bin, /lib*, the Python install, read-only; a private writable /tmp; no home, no "
    "working dir, no /etc), processes (own PID namespace, killed whole at the timeout or Ctrl-C), identity "
    "(nobody / no capabilities), limits (1 GiB memory, CPU seconds, 1 MiB files and stderr, 64 files, 16 "
    "processes). Not isolated: the kernel, CPU time up to the timeout. Refuses where bubblewrap cannot run "
    "(apt-get install bubblewrap)."))]
UnsafeExecute = Annotated[bool, typer.Option("--unsafe-execute", help=(
    "With --execute where no sandbox works: run the generated code as you, with your files and network, "
    "under rlimits only. Never for untrusted models."))]


@dataclass
class MeasureOptions:
    """The common options of every measuring command, after parsing."""

    model: str = "smollm2-135m"
    weights: str = "pretrained"
    suite: str = "chat"
    limit: int = 8
    max_new_tokens: int = 64
    batch_size: int = 1
    threads: int | None = None
    seed: int = 0
    warmup: int = 1
    min_iterations: int = 2
    min_duration: float = 5.0
    target_ci: float = 2.0
    max_rounds: int = 20
    max_round_seconds: float = 300.0
    out: Path = Path("runs")
    lang: str = "en"
    prompt_field: str = "prompt"
    reference_field: str | None = None
    chat_template: bool = True
    max_prompt_tokens: int = 512
    dtype: str = "auto"
    device: str = "cpu"
    trust_remote_code: bool = False
    ppl: bool = True
    resume: bool = False
    json_out: bool = False
    debug: bool = False
    explicit: frozenset[str] = field(default_factory=frozenset)

    def check(self) -> None:
        """Range checks with the flag's own name (the library's messages name config fields)."""
        for flag, value, low in (("--limit", self.limit, 1), ("--max-new-tokens", self.max_new_tokens, 1),
                                 ("--batch-size", self.batch_size, 1), ("--max-prompt-tokens", self.max_prompt_tokens, 1),
                                 ("--warmup", self.warmup, 0), ("--min-iterations", self.min_iterations, 1)):
            if value < low:
                raise ConfigError(f"{flag} must be >= {low}, got {value}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        from infer_tune import weights
        from infer_tune.suites import LANGS

        try:
            weights.parse(self.weights)
        except ConfigError:
            raise ConfigError(f"--weights must be pretrained, random or random:SEED, got '{self.weights}'") from None

        if self.lang not in LANGS:
            raise ConfigError(f"--lang must be one of {', '.join(LANGS)}, got '{self.lang}'")
        if not 0 <= self.min_duration < float("inf"):
            raise ConfigError(f"--min-duration must be a finite number of seconds >= 0, got {self.min_duration}")
        if not 0 < self.target_ci < 100:
            raise ConfigError(f"--target-ci must be a percentage in (0, 100), got {self.target_ci}")
        if self.max_rounds < 2:
            raise ConfigError(f"--max-rounds must be >= 2, got {self.max_rounds}")
        if not 0 <= self.max_round_seconds < float("inf"):
            raise ConfigError(f"--max-round-seconds must be a finite number of seconds >= 0, got {self.max_round_seconds}")

    def workload_values(self) -> dict[str, Any]:
        return dict(suite=self.suite, limit=self.limit, seed=self.seed, max_new_tokens=self.max_new_tokens,
                    batch_size=self.batch_size, chat_template=self.chat_template,
                    max_prompt_tokens=self.max_prompt_tokens, lang=self.lang, prompt_field=self.prompt_field,
                    reference_field=self.reference_field)

    def protocol_values(self) -> dict[str, Any]:
        return dict(warmup=self.warmup, min_iterations=self.min_iterations, min_duration_s=self.min_duration,
                    target_half_width_pct=self.target_ci, max_rounds=self.max_rounds,
                    max_duration_s=self.max_round_seconds)

    def given(self, values: dict[str, Any], renames: dict[str, str] | None = None) -> dict[str, Any]:
        """The subset of `values` whose options were given on the command line."""
        renames = renames or {"min_duration_s": "min_duration", "target_half_width_pct": "target_ci",
                              "max_duration_s": "max_round_seconds"}
        return {k: v for k, v in values.items() if renames.get(k, k) in self.explicit}


# option name -> its Annotated type, in the order --help lists them
COMMON: dict[str, Any] = {
    "model": Model, "weights": Weights, "suite": Suite, "limit": Limit, "max_new_tokens": MaxNewTokens, "batch_size": BatchSize,
    "threads": Threads, "seed": Seed, "warmup": Warmup, "min_iterations": MinIterations,
    "min_duration": MinDuration, "target_ci": TargetCI, "max_rounds": MaxRounds,
    "max_round_seconds": MaxRoundSeconds, "out": Out, "lang": Lang, "prompt_field": PromptField,
    "reference_field": ReferenceField, "chat_template": ChatTemplate, "max_prompt_tokens": MaxPromptTokens,
    "dtype": Dtype, "device": Device, "trust_remote_code": TrustRemoteCode, "ppl": Ppl, "resume": Resume,
    "json_out": Json, "debug": Debug,
}


PANEL = "Common options (every measuring command)"


def _in_panel(annotation: Any) -> Any:
    """The same Annotated option, listed under PANEL in --help."""
    from copy import copy

    base, info = typing.get_args(annotation)
    info = copy(info)
    info.rich_help_panel = PANEL
    return Annotated[base, info]


def measuring_command(**defaults: Any):
    """Give `fn(opts: MeasureOptions, ...)` every common option; `defaults` change a default for this command.

    A parameter of `fn` annotated `typer.Context` receives the command's context (e.g. a group callback
    reading `invoked_subcommand`).
    """
    base = {f.name: f.default for f in dataclasses.fields(MeasureOptions) if f.name != "explicit"}
    unknown = set(defaults) - set(base)
    if unknown:
        raise TypeError(f"unknown common options: {', '.join(sorted(unknown))}")
    base.update(defaults)

    def decorator(fn):
        hints = typing.get_type_hints(fn, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(fn).parameters.values() if p.name != "opts"]
        # a parameter annotated typer.Context gets the command's context (typer injects only one)
        context_names = [p.name for p in own if p.annotation is typer.Context]
        own = [p for p in own if p.name not in context_names]
        common = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=_in_panel(annotation),
                                    default=base[name])
                  for name, annotation in COMMON.items()]
        context = inspect.Parameter("typer_context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + common + [context]

        def command(**kwargs: Any) -> Any:
            ctx = kwargs.pop("typer_context")
            explicit = frozenset(name for name in COMMON
                                 if ctx.get_parameter_source(name) is not None
                                 and ctx.get_parameter_source(name).name not in ("DEFAULT", "DEFAULT_MAP"))
            opts = MeasureOptions(**{name: kwargs.pop(name) for name in COMMON}, explicit=explicit)
            opts.check()
            return fn(opts, **kwargs, **dict.fromkeys(context_names, ctx))

        command.__name__, command.__doc__, command.__module__ = fn.__name__, fn.__doc__, fn.__module__
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorator
