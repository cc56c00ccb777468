"""One configuration tree for a training run: a TOML file mapped onto the project's own dataclasses, every field
overridable from the command line, the resolved tree saved in the run directory (docs/training.md, "Configuration").

    [model] ModelConfig    [engine] EngineConfig    [hints] HintsConfig    [shaping] ShapingConfig    [run] RunConfig
    [sft] SFTConfig (`shipyard sft`)                                                               (new here)
    [rollout] SchedulerConfig    [episode] EpisodeConfig, [episode.loop] LoopConfig
    [trainer] TrainConfig, [trainer.optim] OptimConfig (the optimiser), [trainer.policy] PolicyLossConfig,
              [trainer.distill] DistillConfig (the hints' self-distillation), [trainer.lora] LoraConfig (adapters)
    [curriculum] CurriculumConfig    [synth] SynthConfig    [ray] RayConfig (optional: present = rollouts on Ray)

Every section but the five new ones is the dataclass its component already takes: a field added there is a TOML key
and a command-line option with no change here.

**Reading a file.** `tomllib` parses it; `_Reader` walks the dataclasses' type hints and builds each table. TOML is
typed, so a value of the wrong type is an error, never coerced (`lr = "1e-5"` is a string); an unknown key is an
error with the close match (difflib) and the keys the table takes; a dataclass's own `__post_init__` check is
reported with its section. Relative paths in a file are relative to the file, on the command line to the working
directory; the resolved tree holds absolute paths.

**Overrides** are tyro's: `tyro.cli(RLConfig, default=<the tree from the file>, args=overrides)` takes `--SECTION.KEY
VALUE` for any field at any depth (`--trainer.optim.lr 1e-5`), a tuple's values in a row, `None` for an optional
field, `true`/`false` for a boolean (a registry rule; tyro's own spelling is `True`/`False`). tyro rebuilds every
dataclass through its constructor, so `__post_init__` checks run on overridden values too. Its boxed errors are
captured and re-raised as one-line `ConfigError`s; unknown flags come back from it (`return_unknown_args`) and get
a close-match suggestion here.

**Derived defaults** follow other settings unless the file or the command line sets them, computed from the final
values (so `--model.name X` changes what follows the model):

    episode.loop.untagged_calls     wire_defaults(model.name): what `episode_config` does for every episode (the
    episode.loop.tags               model evaluated instead, for `shipyard eval --model M`: `load_config`'s policy)
    vllm.python                     $SHIPYARD_VLLM_PYTHON, else .venv-vllm/bin/python in the working directory
    trainer.seed, rollout.run_seed  run.seed
    run.tasks                       run.dir / "tasks"
    ray.device, ray.tokenizer       engine.device, the engine's tokenizer (a different explicit value is an error)
    ray.allowed_roots               (run.tasks,): the environment servers may snapshot the task set

Resolution is a fixed point: build from the file with the derived defaults, apply the overrides, recompute the derived
values from the result, repeat while they change (the longest chain, run.dir → run.tasks → ray.allowed_roots, takes
three rounds). The episode settings finally go through `episode_config`, the one configuration path of an episode.

**Saving.** `save_config` writes TOML (tomli-w): every field explicit except None ones (TOML has no null; every
optional field of the tree defaults to None, and saving refuses one that does not), so `load_config` reads it back
to an equal tree.

**Imports.** This module imports torch (TrainConfig lives in shipyard.train.trainer): fine for `shipyard train`. It
never imports Ray: RayConfig's module imports ray, so `RLConfig.ray` is typed Any (tyro takes the section's options
from the instance) and RayConfig is imported only for a file with a [ray] section — without Ray, a ConfigError
saying what to install.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import math
import os
import re
import sys
import tomllib
import types
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import tomli_w
import torch  # imported by shipyard.train.trainer anyway
import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from shipyard.errors import UsageError
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.vllm_server import VLLMConfig, default_python
from shipyard.rollout.episode import EpisodeConfig, episode_config, wire_defaults
from shipyard.rollout.scheduler import SchedulerConfig
from shipyard.tasks.curriculum import CurriculumConfig
from shipyard.tasks.synth import SynthConfig
from shipyard.train.trainer import TrainConfig

PROG = "shipyard train CONFIG.toml"
NO_FILE = "the defaults"  # what a tree read from no file names as its source
HELP = ("Every field of the configuration tree as --SECTION.KEY VALUE, its value in the file (or its default) shown "
        "(docs/training.md, \"Configuration\").")
MAX_ROUNDS = 5  # of the derived-defaults fixed point; the longest dependency chain needs 3


class ConfigError(UsageError):
    """A configuration the user must fix: the message says where (the file or the command line), which key, and what
    is allowed."""


def _check_device(key: str, value: str) -> None:
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None


@dataclass
class ModelConfig:
    name: str = DEFAULT_MODEL  # the policy: a bundled name, a local directory, a .gguf file, a hub id, random:tiny
    tokenizer: str | None = None  # for engines that see only ids (openai:, replay:); None: the model's (name)

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith(("openai:", "replay:")):
            raise ValueError(f"model.name names the policy's weights (a bundled name, a model directory, a .gguf "
                             f"file or a hub id), got {self.name!r}; servers go in [engine] kind = 'openai:URL'")


@dataclass
class EngineConfig:
    # "local" (model.name in this process) | "vllm" (servers shipyard starts: [vllm]) | "openai:URL[,URL…]" |
    # "replay:FILE.jsonl"
    kind: str = "local"
    device: str = "cpu"  # where a local engine puts the model

    def __post_init__(self) -> None:
        if self.kind.startswith("openai:"):
            urls = [u.strip() for u in self.kind.removeprefix("openai:").split(",") if u.strip()]
            if not urls:
                raise ValueError("engine.kind 'openai:' needs at least one URL: 'openai:http://HOST:8000/v1' or "
                                 "'openai:http://A:8000/v1,http://B:8000/v1' (one engine per server, routed)")
            for url in urls:
                parts = urllib.parse.urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    raise ValueError(f"engine.kind: {url!r} is not an http(s) URL (write http://HOST:PORT/v1)")
        elif self.kind not in ("local", "vllm") and not (self.kind.startswith("replay:")
                                                         and len(self.kind) > len("replay:")):
            raise ValueError(f"engine.kind must be 'local', 'vllm' (servers shipyard starts, [vllm]), "
                             f"'openai:URL[,URL…]' (vLLM, SGLang, shipyard serve) or 'replay:FILE.jsonl', got "
                             f"{self.kind!r}")
        _check_device("engine.device", self.device)


HINT_DETECTORS = ("call_format", "ungrounded", "rejected_edit", "unread_edit", "repeated_failure", "test_edit",
                  "serial_calls", "verbose_step", "finished")  # shipyard.rl.hints says what each finds


def check_detectors(names: Sequence[str]) -> None:
    unknown = sorted(set(names) - set(HINT_DETECTORS))
    if unknown:
        raise ValueError(f"unknown hint detectors {unknown}: the detectors are {', '.join(HINT_DETECTORS)}")


@dataclass
class HintsConfig:
    # Targeted-feedback hints (shipyard.rl.hints): detectors read each trajectory and write a short hint at the turn
    # that went wrong; a hinted teacher's distribution is distilled into the policy there ([trainer.distill] holds
    # how; its `enabled` follows this one). Off: no hints, no distillation term, no teacher model kept.
    enabled: bool = False
    max_turns: int = 2  # hinted turns per rollout (the earliest with findings)
    verbose_words: int = 120  # verbose_step: words of prose allowed in a turn that only explores
    detectors: tuple[str, ...] = HINT_DETECTORS  # which run (all by default)
    # An optional critic model that reviews each episode and may add hints (shipyard.rl.critic): a model name as for
    # [model] (bundled, local directory, hub id) or "openai:URL" (a server), with its tokenizer where it needs one.
    critic: str = ""
    critic_tokenizer: str | None = None
    critic_max_hints: int = 2

    def __post_init__(self) -> None:
        check_detectors(self.detectors)
        if self.max_turns < 1 or self.verbose_words < 1 or self.critic_max_hints < 1:
            raise ValueError(f"hints.max_turns, hints.verbose_words and hints.critic_max_hints must be >= 1, got "
                             f"{self.max_turns}, {self.verbose_words} and {self.critic_max_hints}")


@dataclass
class ShapingConfig:
    # Terms added to the grader's reward before the advantages (shipyard.rollout.advantages); 0 turns a term off.
    grounded: float = 0.0  # GroundedCalls.coef: + grounded * (grounded tool calls / calls), whatever the verdict
    placeholder: float = 0.0  # GroundedCalls.placeholder_coef: - placeholder * (calls copying a placeholder / calls)
    grounded_target: int = 3  # GroundedCalls.target: distinct grounded calls that earn the whole `grounded`
    untagged_credit: float = 0.0  # GroundedCalls.untagged_credit: share of `grounded` for a call grounded but untagged
    parallel: float = 0.0  # ParallelBonus.coef: + parallel * (mean calls per turn - 1) / 3, on solved rollouts only
    effort: float = 0.0  # EffortCalibration.coef: group-relative effort cost (Kimi k1.5's length reward), by tier
    effort_turn_tokens: int = 256  # EffortCalibration.turn_tokens: a turn's cost in sampled tokens
    effort_tier_scale: tuple[float, ...] = (1.0, 0.5, 0.25)  # EffortCalibration.tier_scale: the cost's scale by tier

    def __post_init__(self) -> None:
        if not 0 <= self.untagged_credit <= 1:
            raise ValueError("shaping.untagged_credit must be in [0, 1]")
        if self.grounded_target < 1:
            raise ValueError("shaping.grounded_target must be at least 1")
        coefs = (self.grounded, self.placeholder, self.parallel, self.effort, *self.effort_tier_scale)
        if not all(math.isfinite(v) for v in coefs) or min(coefs) < 0:
            raise ValueError("shaping coefficients (and effort_tier_scale) must be finite and >= 0 (a negative one "
                             "would reward the behaviour it names)")
        if self.effort_turn_tokens < 0 or not self.effort_tier_scale:
            raise ValueError("shaping.effort_turn_tokens must be >= 0 and effort_tier_scale non-empty")


@dataclass
class RunConfig:
    dir: Path = Path("runs/default")  # the run directory (config, metrics, checkpoints, export)
    tasks: Path | None = None  # the task set (`shipyard synth`); default <dir>/tasks
    synth_from: Path | None = None  # a repository to synthesize the task set from when `tasks` holds none
    held_out: tuple[str, ...] = ()  # task ids evaluated and never trained on ...
    held_out_count: int = 0  # ... or this many, chosen with `seed` from the task set
    held_out_projects: tuple[str, ...] = ()  # every task of these projects held out too (with `held_out`'s ids)
    steps: int = 20  # trainer steps
    seed: int = 0
    eval_every: int = 0  # held-out evaluation every N steps (0: only before the first step and after the last)
    eval_samples: int = 1  # samples per held-out task
    evaluate: bool = True  # the held-out evaluations (false: none — the split is still recorded and never trained on)
    checkpoint_every: int = 1  # steps between checkpoints
    # the newest checkpoints kept (older ones are deleted once a newer one is complete); 0: every one. A full
    # fine-tune's checkpoint holds the weights and AdamW's two moments: 7.5 GB for a 0.5B, 90 GB for a 7B
    keep_checkpoints: int = 2
    export: bool = True  # write the policy as a Hugging Face model directory with each checkpoint
    zero_flagged: bool = False  # a rollout a reward-hacking monitor flags gets reward 0 (flags are always logged)
    world_size: int = 1  # trainer ranks (FSDP2): the loop's process and world_size - 1 more (shipyard.rl.ranks)
    device: str = "cpu"  # the trainer's device
    resume: bool = False  # continue the run in `dir` from its latest checkpoint
    max_minutes: float | None = None  # wall-time budget: no step is started that would not fit (then eval, checkpoint)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.checkpoint_every < 1 or self.eval_samples < 1 or self.world_size < 1:
            raise ValueError("steps, checkpoint_every, eval_samples and world_size must be at least 1")
        if self.eval_every < 0 or self.held_out_count < 0 or self.keep_checkpoints < 0:
            raise ValueError("eval_every, held_out_count and keep_checkpoints must be >= 0")
        if self.max_minutes is not None and not (math.isfinite(self.max_minutes) and self.max_minutes > 0):
            raise ValueError(f"run.max_minutes must be a positive number of minutes, not {self.max_minutes}")
        if self.held_out and self.held_out_count:
            raise ValueError("give held_out (task ids) or held_out_count (how many to pick), not both")
        if self.held_out_projects and self.held_out_count:
            raise ValueError("give held_out_projects (whole projects) or held_out_count (how many tasks to pick), not "
                             "both")
        _check_device("run.device", self.device)
        if self.world_size > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(f"run.device = {self.device!r} with run.world_size = {self.world_size}: give \"cuda\" "
                             f"(rank r trains on cuda:r) or \"cpu\"")


@dataclass
class SFTConfig:
    """`shipyard sft` (shipyard.rl.sft): where the demonstrations come from and how long to train on them."""

    sources: tuple[str, ...] = ("gold",)  # "gold" (the training tasks' gold patches, replayed) and/or rollout files
    epochs: int = 2  # passes over the demonstrations
    batch_size: int = 8  # demonstrations per trainer step
    # The learning rate of SFT (None: trainer.optim.lr). One config file serves the cold start and RL after it, and
    # the two want different rates (SFT ~1e-5 full fine-tuning, RL a few 1e-6 for a 0.5B; LoRA ~10× both).
    lr: float | None = None
    # Batches of demonstrations of similar length (shipyard.rl.sft.batches): less padding in the trainer's
    # shared-prefix micro-batches, when trainer.micro_batch_tokens holds a whole batch (~22% fewer positions on the
    # learning pool's gold demonstrations). Off: every batch a uniform draw.
    group_by_length: bool = False

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"sft.lr must be a positive learning rate, not {self.lr}")
        if not self.sources:
            raise ValueError("sft.sources is empty: give \"gold\" and/or rollout files (shipyard eval --rollouts)")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("sft.epochs and sft.batch_size must be at least 1")


@dataclass
class RLConfig:
    """The whole run (module docstring). `ray` is typed Any so that this module imports without Ray; tyro takes the
    section's options from the RayConfig instance a [ray] section makes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: SchedulerConfig = field(default_factory=SchedulerConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    trainer: TrainConfig = field(default_factory=TrainConfig)
    hints: HintsConfig = field(default_factory=HintsConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the servers of engine.kind = "vllm"
    ray: Any = None  # RayConfig: rollouts on Ray, when the file has a [ray] section (None: in this process)


def engine_tokenizer(model: ModelConfig, engine: EngineConfig) -> str | None:
    """The tokenizer an engine is given: the model's own for servers and replays unless one is named."""
    return model.tokenizer or (None if engine.kind == "local" else model.name)


def engine_spec(config: RLConfig) -> tuple[str, dict[str, Any]]:
    """(name, keyword arguments) for `shipyard.models.resolve.make_engine(name, **kwargs)`; a local engine gets the
    trainer's LoRA adapter attached when `[trainer.lora]` is on, so that the adapter pushes apply to it."""
    name = config.model.name if config.engine.kind == "local" else config.engine.kind
    return name, {"device": config.engine.device, "tokenizer": engine_tokenizer(config.model, config.engine),
                  "lora": config.trainer.lora}


# --- reading TOML onto dataclasses -----------------------------------------------------------------------------------

def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        out += _leaf_keys(hints[f.name], key + ".") if is_dataclass(hints[f.name]) else [key]
    return out


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "a table"}
    kind = names.get(type(value), f"a {type(value).__name__}")
    if isinstance(value, dict):
        return kind
    text = repr(value)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _describe(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
        return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
    if is_dataclass(tp):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path (a string)",
            dict: "a table"}.get(tp, repr(tp))


@dataclass
class _Reader:
    """Turns one file's tables into dataclasses; says which file in every error."""

    source: Path
    derived: dict[str, Any]

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def wrong(self, key: str, tp: Any, value: Any) -> ConfigError:
        return self.error(f"{key} must be {_describe(tp)}, got {_kind(value)}")

    def unknown(self, section: str, name: str, names: list[str]) -> ConfigError:
        key = f"{section}.{name}" if section else name
        # The exact key in another section says more than a near spelling here ('lr' under [trainer] is
        # trainer.optim.lr, not trainer.lora).
        elsewhere = [k for k in _leaf_keys(RLConfig) if k.rsplit(".", 1)[-1] == name]
        close = difflib.get_close_matches(name, names, n=1)
        if elsewhere:
            hint = f"; it belongs elsewhere: did you mean {' or '.join(elsewhere)}?"
        else:
            hint = f"; did you mean '{close[0]}'?" if close else ""
        where = f"[{section}]" if section else "the top level"
        return self.error(f"unknown key '{key}'{hint} ({where} takes: {', '.join(names)})")

    def path(self, text: str) -> Path:
        return Path(os.path.abspath(self.source.parent / Path(text).expanduser()))

    def build(self, cls: type, table: Any, section: str) -> Any:
        if not isinstance(table, dict):
            raise self.error(f"{section} must be a table ([{section}]), got {_kind(table)}")
        hints = get_type_hints(cls)
        names = [f.name for f in fields(cls) if f.init]
        for name in table:
            if name not in names:
                raise self.unknown(section, name, names)
        kwargs = {}
        for name in names:
            key = f"{section}.{name}" if section else name
            if name in table:
                kwargs[name] = self.value(hints[name], table[name], key)
            elif key in self.derived:
                kwargs[name] = self.derived[key]
            elif is_dataclass(hints[name]):  # built here, so that derived defaults inside it apply
                kwargs[name] = self.build(hints[name], {}, key)
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as e:
            raise self.error(f"[{section}] {e}") from None

    def value(self, tp: Any, value: Any, key: str) -> Any:
        origin, args = get_origin(tp), get_args(tp)
        if origin in (Union, types.UnionType):  # TOML has no null: an optional field is either absent or a value
            options = [a for a in args if a is not type(None)]
            for option in options:
                try:
                    return self.value(option, value, key)
                except ConfigError:
                    if len(options) == 1:
                        raise
            raise self.error(f"{key} must be {' or '.join(_describe(a) for a in options)}, got {_kind(value)}")
        if origin is Literal:
            if any(value == a and type(value) is type(a) for a in args):
                return value
            raise self.error(f"{key} must be {_describe(tp)}, got {value!r}")
        if is_dataclass(tp):
            return self.build(tp, value, key)
        if origin is tuple:
            if not isinstance(value, list):
                raise self.wrong(key, tp, value)
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self.value(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise self.wrong(key, tp, value)
            return tuple(self.value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
        checks = {bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
                  int: lambda v: isinstance(v, int) and not isinstance(v, bool),
                  float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
                  Path: lambda v: isinstance(v, str), dict: lambda v: isinstance(v, dict)}
        base = origin or tp
        if base in checks:
            if not checks[base](value):
                raise self.wrong(key, tp, value)
            return float(value) if base is float else self.path(value) if base is Path else value
        if tp is Any:
            return value
        raise TypeError(f"{key}: the configuration reader does not handle fields of type {tp!r}")  # a bug here


def _ray_config(reader: _Reader) -> type:
    try:
        from shipyard.rollout.ray_transport import RayConfig
    except ImportError as e:
        raise reader.error(f"the [ray] section needs Ray, which is not importable here ({e}): pip install "
                           "'shipyard[ray]', or remove [ray] to run the rollouts in this process") from None
    return RayConfig


def _from_file(table: dict, reader: _Reader) -> RLConfig:
    rest = {k: v for k, v in table.items() if k != "ray"}
    config = reader.build(RLConfig, rest, "")
    if "ray" in table:
        config.ray = reader.build(_ray_config(reader), table["ray"], "ray")
    return config


def _derived(model: ModelConfig, engine: EngineConfig, run: RunConfig, tasks: Path,
             policy: str | None) -> dict[str, Any]:
    """The derived defaults (module docstring) from the settings they follow; `tasks`: the task set in effect,
    `policy`: the model whose wire settings the episodes take (None: model.name)."""
    wire = wire_defaults(policy or model.name)
    return {"episode.loop.untagged_calls": wire.untagged_calls, "episode.loop.tags": wire.tags,
            "vllm.python": Path(os.path.abspath(default_python())),
            "trainer.seed": run.seed, "rollout.run_seed": run.seed,
            "run.tasks": Path(os.path.abspath(run.dir / "tasks")),
            "ray.device": engine.device, "ray.tokenizer": engine_tokenizer(model, engine),
            "ray.allowed_roots": (tasks,)}


# --- overrides (tyro) ------------------------------------------------------------------------------------------------

_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _toml_bool(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    """Booleans on the command line as in TOML: true/false (any case)."""
    if info.type is not bool:
        return None

    def parse(args: list[str]) -> bool:
        if args[0].lower() not in ("true", "false"):
            raise ValueError(f"expected true or false, got {args[0]!r}")
        return args[0].lower() == "true"

    return PrimitiveConstructorSpec(nargs=1, metavar="{true,false}", instance_from_str=parse,
                                    is_instance=lambda v: isinstance(v, bool),
                                    str_from_instance=lambda v: [str(v).lower()])


_BOX = re.compile(r"\x1b\[[0-9;]*m|[│┃─━╭╮╰╯┏┓┗┛]")


def _tyro_message(text: str) -> str:
    """tyro's boxed error as one line: its title and text, without rules, borders and the pointer to --help."""
    lines = [line.strip() for line in _BOX.sub("", text).splitlines()]
    kept = [line for line in lines if line and set(line) - set("-=+|") and not line.startswith("For full helptext")]
    text = " ".join(kept[1:] if len(kept) > 1 else kept)  # the first line is the box's title ("Value error")
    return re.sub(r"\s+", " ", text.replace("Argument helptext:", "— expected:")).strip() or "rejected by tyro"


def _unknown_override(token: str, config: RLConfig) -> ConfigError:
    if not token.startswith("-"):
        return ConfigError(f"command line: unexpected argument {token!r} (overrides are --SECTION.KEY VALUE, "
                           "a list takes its values in a row: --curriculum.band 0.2 0.8)")
    flag = token.split("=", 1)[0]
    name = flag.lstrip("-").replace("-", "_")
    if name.split(".")[0] == "ray" and config.ray is None:
        return ConfigError(f"command line: {flag}: this configuration has no [ray] section, so no Ray options; add "
                           "[ray] to the file (address = \"auto\" joins a running cluster) to run rollouts on Ray")
    keys = _leaf_keys(RLConfig) + (_leaf_keys(type(config.ray), "ray.") if config.ray is not None else [])
    close = difflib.get_close_matches(name, keys, n=1)
    hint = f"; did you mean --{close[0]}?" if close else "; every field is --SECTION.KEY (docs/training.md)"
    return ConfigError(f"command line: unknown option {flag}{hint}")


def _override(config: RLConfig, overrides: list[str], prog: str = PROG) -> RLConfig:
    """tyro applied to `config` (a fresh tree, not reused). --help prints the options (as `prog`'s) and exits 0."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            result, unknown = tyro.cli(RLConfig, default=config, args=overrides, return_unknown_args=True, prog=prog,
                                       description=HELP, registry=_REGISTRY, config=(tyro.conf.FlagConversionOff,))
    except SystemExit as e:
        if e.code in (0, None):  # --help
            sys.stdout.write(captured.getvalue())
            raise
        raise ConfigError(f"command line: {_tyro_message(captured.getvalue())}") from None
    if unknown:
        raise _unknown_override(unknown[0], config)
    return result


def _absolute(obj: Any) -> None:
    """Relative paths (from the command line or the defaults) made absolute against the working directory."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            _absolute(value)
        elif isinstance(value, Path):
            setattr(obj, f.name, Path(os.path.abspath(value.expanduser())))
        elif isinstance(value, tuple) and value and all(isinstance(v, Path) for v in value):
            setattr(obj, f.name, tuple(Path(os.path.abspath(v.expanduser())) for v in value))


# --- the entry points ------------------------------------------------------------------------------------------------

def read_toml(path: Path) -> dict:
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or device: open() would block or stream
        raise ConfigError(f"{path}: not a regular file; give a TOML file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: the configuration file does not exist (examples: configs/*.toml)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # TOMLDecodeError says where: (at line L, column C)
        raise ConfigError(f"{path}: not valid TOML: {'not UTF-8: ' if isinstance(e, UnicodeDecodeError) else ''}{e}") \
            from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                policy: str | None = None, prog: str = PROG) -> RLConfig:
    """The resolved configuration of `path` (None: the defaults alone) with command-line `overrides`
    (`--trainer.optim.lr 1e-5`, …) applied; `policy` names the model the episodes are of when it is not model.name
    (`shipyard eval --model`: its wire settings are the derived defaults). ConfigError, naming the file or the command
    line and the key, for anything wrong. `prog` names the command in --help's usage line."""
    path = Path(path) if path is not None else None
    table = read_toml(path) if path is not None else {}
    reader = _Reader(path or Path(NO_FILE), {})  # no file: relative paths are the working directory's
    first = {name: reader.build(cls, table.get(name, {}), name)
             for name, cls in (("model", ModelConfig), ("engine", EngineConfig), ("run", RunConfig))}
    run = first["run"]
    reader.derived = _derived(first["model"], first["engine"], run,
                              run.tasks or Path(os.path.abspath(run.dir / "tasks")), policy)
    for _ in range(MAX_ROUNDS):
        config = _override(_from_file(table, reader), list(overrides), prog) if overrides else \
            _from_file(table, reader)
        _absolute(config)
        derived = _derived(config.model, config.engine, config.run, config.run.tasks, policy)
        if derived == reader.derived:
            break
        reader.derived = derived
    else:
        raise RuntimeError(f"the derived defaults of {path} did not settle in {MAX_ROUNDS} rounds")  # a bug here
    return _finish(config, path or NO_FILE, bool(overrides), policy)


def _finish(config: RLConfig, path: Path | str, overridden: bool, policy: str | None) -> RLConfig:
    where = f"{path}{' with the command-line overrides' if overridden else ''}"
    if config.ray is not None:
        tokenizer = engine_tokenizer(config.model, config.engine)
        if config.ray.device != config.engine.device:
            raise ConfigError(f"{where}: ray.device ({config.ray.device!r}) differs from engine.device "
                              f"({config.engine.device!r}); set the device once, in [engine]")
        if config.ray.tokenizer != tokenizer:
            raise ConfigError(f"{where}: ray.tokenizer ({config.ray.tokenizer!r}) differs from the engine's "
                              f"({tokenizer!r}); set the tokenizer once, as model.tokenizer")
    loop = config.episode.loop
    try:  # the one configuration path of an episode (shipyard.rollout.episode)
        config.episode = episode_config(
            policy or config.model.name, **{f.name: getattr(loop, f.name) for f in fields(loop)},
            **{f.name: getattr(config.episode, f.name) for f in fields(config.episode) if f.name != "loop"})
    except ValueError as e:
        raise ConfigError(f"{where}: [episode] {e}") from None
    return config


def _to_toml(value: Any) -> Any:
    if is_dataclass(value):
        out = {}
        for f in fields(value):
            item = getattr(value, f.name)
            if item is not None:
                out[f.name] = _to_toml(item)
            elif f.default is not None:  # left out, it would read back as the default: TOML cannot say None here
                raise ValueError(f"{type(value).__name__}.{f.name} is None but defaults to {f.default!r}; TOML has "
                                 "no null to write it with")
        return out
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_to_toml(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_toml(v) for k, v in value.items() if v is not None}
    return value


def save_config(config: RLConfig, path: str | Path, note: str | None = None) -> Path:
    """Write the resolved `config` as TOML that `load_config` reads back to an equal config (`note`: a first comment
    line, e.g. the command line it came from). Written beside and renamed, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = tomli_w.dumps(_to_toml(config))
    if note:
        text = "".join(f"# {line}\n" for line in note.splitlines()) + text
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path

