"""The engine registry: one dict, `ENGINES`, filled by `register_engine(Engine(...))` (docs/architecture.md,
"The engine axis").

An engine is what executes a model: a result row is (model, technique stack, engine, workload). The
techniques (infer_tune/tuners) say what is done to the model; the engine says what runs it. Each entry
(`Engine`, frozen, built by keyword) declares:

- `name`: the registry key and the result's `engine` (`torch`, `lean`, `slots`, `llama.cpp`, `vllm`,
  `sglang`, `remote`, ...); `aliases`: other names config fields use for it (`hf`, `transformers`: torch).
- `starts`: `"in-process"` (runs in this Python process) or `"server"` (launched on 127.0.0.1, or already
  running: `remote`, driven over HTTP).
- `runner`: the name of the runner (infer_tune/runners) that measures it.
- `techniques`: technique name -> how that technique maps onto the engine's own settings (a line naming the
  settings: `{"quantize": "gguf (the GGUF type served)", ...}`). A technique not in it is not run by the
  engine; `unsupported` names why for the ones worth a reason (`{"speculate": "..."}`).
- `check(part) -> None | reason`: a finer test of one technique config the engine runs (optional), e.g.
  the slot engine serves a kv-cache part only with impl static or dynamic.
- `settings(stack) -> dict` (optional): the stack as the engine's own settings (what `serve` builds).
- `version() -> dict` (optional): what identifies the engine's build, e.g. `{"version": "4.57.1"}` or
  `{"commit": "abc123", "build_number": 6000}`; `{}` when unknown. Never raises.
- `argv(started) -> list[str]` (optional): the command line of a started instance (servers launched here).
- `setting_table`: for a launched server, its launch settings (engines/launch.py `Setting` tables).
- `parse_settings(pairs) -> dict` (optional): an engine run from its own settings (a launched server's table,
  OpenVINO's export and properties): `KEY=VALUE` strings or a mapping -> its checked settings (ConfigError
  naming the bad one). Such an engine's recipe holds `settings` and no configs.
- `scenario`: the module (a dotted name under infer_tune/scenarios) that measures such an engine from its
  settings: `bench(spec, engine, settings, progress=...)` -> the saved rows (its default first when the
  settings differ from it), what `bench --engine E --set ...` and `bench --recipe` of its recipe call.
- `searched_here`: a launched engine whose settings `tune --engine` searches on this host and whose launches
  are measured against its default launch, perplexity by its own tool (a CPU build: llama.cpp).
- `probe(args)` (optional, an in-process engine): build one configuration and decode a few tokens in the calling
  process; `python -m infer_tune.engines.probe NAME ARGS` runs it in a child first, so an engine that dies
  (a signal) or hangs is a crashed row instead of the end of infer-tune (engines/crash.py `run_child`).
- `spelling`: technique -> the word a technique config's `engine` field uses for this engine and keeps in its
  results (`{"batch": "transformers", "speculate": "hf"}`: the torch engine); `spelled(technique)` gives it.
- `serve_here` (optional, a `ServeHere`): how `endpoint reference` / `endpoint/servers.local_server` starts the
  engine as a reference server on 127.0.0.1 (its command line and served model name, the checks of its options,
  the Python modules it needs); endpoint/servers.py only runs the process it is given.
- `selectable`: whether a technique config's `engine` field may name it (speculate's and batch's `engine`
  choose an in-process engine; False for one only reached another way, e.g. `slots`, which `serve` runs and
  batch's `engine: lean` drives).
- `metric_keys`: {key: what it is} of the metrics its rows may carry beyond the core (metrics/schema.py CORE) and
  their technique's `metric_keys`: its namespace (`ResultDocument.add_metrics` refuses an undeclared key).

`supports(stack)` is None when the engine runs every part of `stack` (a technique config, a stack config,
or a list of parts: anything whose parts have a `technique` name), else the reason it does not, as one line.
`resolve(name, technique=...)` gives the canonical name of an engine or alias and, with `technique`, refuses
one that does not run that technique (ConfigError naming the engines that do).

Adding an engine is one module in this package that calls `register_engine(Engine(...))` at import: the
registry imports every module of the package on first use (as the technique registry does), so nothing else
lists engines. This module imports nothing of infer-tune but errors; an engine module keeps torch and
transformers imports inside its functions (the registry is read by `recipe` and `tuners` config checks).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from infer_tune.errors import ConfigError

ENGINES_PACKAGE = "infer_tune.engines"  # every module in it may register engines on import
STARTS = ("in-process", "server")
DEFAULT_ENGINE = "torch"  # the engine of a row no technique part names (the baseline's: eager transformers)
ENDPOINT_ENGINE = "remote"  # the engine of a server measured as it runs (bench --endpoint)
# the engines other layers name (each registered by its own module: engines/inprocess.py, slots.py, launched.py):
# a technique's `runs_on`, a config's `engine` field, a reference server are compared with these, never with a word
TORCH, LEAN, SLOTS, LLAMA_CPP = "torch", "lean", "slots", "llama.cpp"
REFERENCE_ENGINE = LLAMA_CPP  # the reference server `endpoint reference` starts when no --engine is given
# engine -> technique -> the word that technique's config field (and its results) uses for the engine
SPELLING = {TORCH: {"batch": "transformers", "speculate": "hf"}}


def spelled(engine: str, technique: str) -> str:
    """`engine` (a canonical name) as `technique`'s config names it (`SPELLING`, else the name itself)."""
    return SPELLING.get(engine, {}).get(technique, engine)


@dataclass(frozen=True)
class ServeHere:
    """How an engine is started as a reference server on loopback (`Engine.serve_here`).

    `command(model_ref, port, *, continuous_batching, threads, context_tokens, parallel, extra_args)` ->
    (argv, the model name the server answers to); `check(parallel)` raises ConfigError (one line) when the
    options cannot be served here; `missing()` -> the Python modules its server needs that are not installed,
    installed by `pip install 'infer-tune[EXTRA]'`."""

    command: Callable[..., tuple[list[str], str]]
    check: Callable[[int], None]
    missing: Callable[[], list[str]]
    extra: str


@dataclass(frozen=True)
class Engine:
    """One registry entry (see the module docstring)."""

    name: str
    starts: Literal["in-process", "server"]
    runner: str
    description: str = ""
    techniques: Mapping[str, str] = field(default_factory=dict)
    unsupported: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = None
    settings: Callable[[Any], dict] | None = None
    version: Callable[[], dict] | None = None
    argv: Callable[[Any], list[str]] | None = None
    setting_table: Mapping[str, Any] | None = None
    parse_settings: Callable[[Any], dict] | None = None
    scenario: str | None = None
    probe: Callable[[dict], None] | None = None
    spelling: Mapping[str, str] = field(default_factory=dict)
    serve_here: ServeHere | None = None
    selectable: bool = True
    searched_here: bool = False
    # {key: what it is} of the metrics this engine's rows may carry beyond the core and their technique's
    # (metrics/schema.py): its server's counters, the figures its scenario adds
    metric_keys: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise TypeError("an engine needs a name")
        if self.starts not in STARTS:
            raise TypeError(f"engine {self.name}: starts must be one of {', '.join(STARTS)}, got {self.starts!r}")

    def runs(self, technique: str) -> bool:
        return technique in self.techniques

    def spelled(self, technique: str) -> str:
        """This engine as `technique`'s config field names it (its `spelling`, else its name)."""
        return self.spelling.get(technique, self.name)

    def supports(self, stack: Any) -> str | None:
        """None when this engine runs every part of `stack`, else why not (one line)."""
        for part in parts_of(stack):
            name = getattr(part, "technique", part if isinstance(part, str) else "")
            if name not in self.techniques:
                why = self.unsupported.get(name) or f"it runs {', '.join(self.techniques) or 'no technique'}"
                return f"engine {self.name} does not run {name}: {why}"
            if self.check is not None and not isinstance(part, str):
                why = self.check(part)
                if why:
                    return why
        return None

    @property
    def takes_settings(self) -> bool:
        """Whether this engine runs from its own settings (`parse_settings`, measured by its `scenario`)."""
        return self.parse_settings is not None and self.scenario is not None

    def identity(self) -> dict:
        """The engine's version facts (`version()`), {} when it has none or they cannot be read."""
        if self.version is None:
            return {}
        try:
            return {k: v for k, v in (self.version() or {}).items() if v is not None}
        except Exception:  # noqa: BLE001 (a version probe never fails a run)
            return {}


def parts_of(stack: Any) -> list:
    """A stack's parts: `stack.parts()` for a technique config, the items of a list, or the one name."""
    if stack is None:
        return []
    if isinstance(stack, str):
        return [stack]
    if hasattr(stack, "parts"):
        return list(stack.parts())
    if isinstance(stack, Iterable):
        return [p for s in stack for p in parts_of(s)]
    return [stack]


class _Registry(dict[str, Engine]):
    """`ENGINES`: a dict that imports the package's engine modules before it is first read."""

    _loaded = False

    def _load(self) -> None:
        if not _Registry._loaded:
            _Registry._loaded = True
            load_engines()

    def __getitem__(self, key):
        self._load()
        try:
            return dict.__getitem__(self, key)
        except KeyError:
            raise ConfigError(f"no engine named {key!r}; engines: {', '.join(sorted(self))}") from None

    def __contains__(self, key) -> bool:
        self._load()
        return dict.__contains__(self, key)

    def __iter__(self):
        self._load()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._load()
        return dict.__len__(self)

    def get(self, key, default=None):
        self._load()
        return dict.get(self, key, default)

    def keys(self):
        self._load()
        return dict.keys(self)

    def values(self):
        self._load()
        return dict.values(self)

    def items(self):
        self._load()
        return dict.items(self)


ENGINES = _Registry()  # name -> Engine


def register_engine(engine: Engine) -> Engine:
    """Add `engine` to `ENGINES` (a second entry of the same name replaces the first: a test's stand-in)."""
    dict.__setitem__(ENGINES, engine.name, engine)
    return engine


def unregister_engine(name: str) -> None:
    """For tests that register a throwaway engine."""
    dict.pop(ENGINES, name, None)


def load_engines() -> None:
    """Import every module of infer_tune/engines (a new engine is a new module there)."""
    import pkgutil

    package = importlib.import_module(ENGINES_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{ENGINES_PACKAGE}.{info.name}")


def engine_of(config: Any) -> str:
    """The engine a technique config runs on: the last part (highest phase) whose `runs_on()` names one (lean:
    the lean loop, batch engine lean: the slots, llama-cpp: llama.cpp), else `DEFAULT_ENGINE`."""
    for part in reversed(parts_of(config)):
        runs_on = getattr(part, "runs_on", None)
        name = runs_on() if callable(runs_on) else None
        if name:
            return name
    return DEFAULT_ENGINE


def names() -> list[str]:
    return sorted(ENGINES)


def resolve(name: str, *, technique: str | None = None, starts: str | None = None, where: str = "engine") -> str:
    """The canonical engine name of `name` (an engine or one of its aliases). With `technique` (a config's
    `engine` field): only a selectable engine that runs it; with `starts`: only engines that start so.
    ConfigError otherwise, naming what is allowed (each engine's name and aliases)."""

    def fits(engine: Engine) -> bool:
        return ((technique is None or (engine.selectable and engine.runs(technique)))
                and (starts is None or engine.starts == starts))

    found = next((e for e in ENGINES.values() if name == e.name or name in e.aliases), None)
    if found is None or not fits(found):
        allowed = [n for e in ENGINES.values() if fits(e) for n in (e.name, *e.aliases)]
        raise ConfigError(f"{where} must be one of {', '.join(allowed)}, got {name!r}")
    return found.name


def config_engine(value: str, *, technique: str, where: str = "engine") -> str:
    """A technique config's `engine` field checked against the registry: an in-process engine (or alias) that
    runs `technique` (ConfigError otherwise). Returns it as the config spells that engine (the engine's
    `spelling` for `technique`, e.g. speculate's "hf" for torch, which its results keep)."""
    return ENGINES[resolve(value, technique=technique, starts="in-process", where=where)].spelled(technique)


def served_here() -> dict[str, Engine]:
    """Every name and alias `endpoint/servers.local_server` can start -> its engine (one with `serve_here`), the
    engines in name order."""
    return {n: e for e in sorted(ENGINES.values(), key=lambda e: e.name) if e.serve_here is not None
            for n in (e.name, *e.aliases)}
