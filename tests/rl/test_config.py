"""`shipyard.rl.config`: one TOML file onto the project's dataclasses, overrides from the command line (tyro), the
resolved config saved and read back. Hostile input first: every way a file or an override can be wrong must say
which file, which key and what is allowed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.lora import LoraConfig
from shipyard.rl.config import ConfigError, RLConfig, engine_spec, load_config, save_config
from shipyard.rl.plan import plan
from shipyard.rollout.demo import EXAMPLE_REPO

ROOT = Path(__file__).resolve().parents[2]
CPU, GPU = ROOT / "configs" / "cpu.toml", ROOT / "configs" / "gpu-node.toml"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# --- the file ------------------------------------------------------------------------------------------------------

def test_missing_file_names_it(tmp_path):
    message = error(tmp_path / "nope.toml")
    assert "nope.toml" in message and "does not exist" in message


def test_malformed_toml_gives_the_line(tmp_path):
    path = write(tmp_path, "[run]\nsteps = 3\nseed = = 4\n")
    message = error(path)
    assert str(path) in message and "line 3" in message


def test_unknown_key_is_named_with_a_close_match_and_the_allowed_keys(tmp_path):
    message = error(write(tmp_path, "[trainer.optim]\nlrr = 1e-5\n"))
    assert "run.toml" in message and "trainer.optim.lrr" in message
    assert "did you mean 'lr'" in message and "warmup_steps" in message  # the allowed keys are listed


def test_unknown_section_suggests_the_right_one(tmp_path):
    message = error(write(tmp_path, "[trainr]\nseed = 1\n"))
    assert "'trainr'" in message and "did you mean 'trainer'" in message


def test_a_key_in_the_wrong_section_points_to_where_it_lives(tmp_path):
    message = error(write(tmp_path, "[trainer]\nlr = 1e-5\n"))
    assert "trainer.lr" in message and "trainer.optim.lr" in message


@pytest.mark.parametrize(("text", "wanted"), [
    ('[trainer.optim]\nlr = "fast"\n', "trainer.optim.lr must be a number, got a string 'fast'"),
    ("[rollout]\ngroup_size = 2.5\n", "rollout.group_size must be an integer, got a float 2.5"),
    ('[trainer]\nmxfp8 = "true"\n', "trainer.mxfp8 must be true or false, got a string 'true'"),
    ("[curriculum]\nband = [0.1]\n", "curriculum.band must be a list of 2"),
    ('[trainer.optim]\nname = "sgd"\n', "trainer.optim.name must be one of 'muon', 'adamw', got 'sgd'"),
    ("trainer = 3\n", "trainer must be a table"),
    ("[trainer.optim.lr]\nx = 1\n", "trainer.optim.lr must be a number, got a table"),
    ("[run]\nheld_out = [1, 2]\n", "run.held_out[0] must be a string, got an integer 1"),
])
def test_wrong_types_say_what_is_allowed(tmp_path, text, wanted):
    message = error(write(tmp_path, text))
    assert wanted in message and "run.toml" in message


@pytest.mark.parametrize(("text", "section", "said"), [
    ("[rollout]\ngroup_size = 0\n", "[rollout]", "group_size and groups_per_step must be at least 1"),
    ("[trainer.optim]\nlr = -1.0\n", "[trainer.optim]", "lr and grad_clip must be > 0"),
    ('[trainer.distill]\nsupport = "sampled"\ndivergence = "jsd"\n', "[trainer.distill]", "sampled-token support"),
    ('[engine]\nkind = "sglang"\n', "[engine]", "'vllm' (servers shipyard starts"),
    ('[vllm]\nservers = 0\n', "[vllm]", "vllm.servers and vllm.gpus_per_server must be >= 1"),
    ('[vllm]\ngpus = [0]\nservers = 2\n', "[vllm]", "need 2"),
    ('[engine]\nkind = "openai:"\n', "[engine]", "at least one URL"),
    ('[engine]\ndevice = "gpu"\n', "[engine]", "device"),
    ("[run]\nsteps = 0\n", "[run]", "steps"),
    ('[run]\nheld_out = ["a"]\nheld_out_count = 2\n', "[run]", "held_out_count"),
])
def test_invalid_values_are_the_dataclasses_own_checks_with_the_section(tmp_path, text, section, said):
    message = error(write(tmp_path, text))
    assert "run.toml" in message and section in message and said in message


# --- overrides -----------------------------------------------------------------------------------------------------

def test_unknown_override_flag_suggests_the_close_one(tmp_path):
    message = error(write(tmp_path, ""), ["--trainer.optim.lrr", "1e-5"])
    assert "--trainer.optim.lrr" in message and "--trainer.optim.lr" in message and "command line" in message


def test_override_with_a_bad_value_names_the_flag(tmp_path):
    message = error(write(tmp_path, ""), ["--trainer.optim.lr", "fast"])
    assert "--trainer.optim.lr" in message and "'fast'" in message


def test_override_that_breaks_a_dataclass_check_is_reported(tmp_path):
    message = error(write(tmp_path, ""), ["--rollout.group-size", "0"])
    assert "group_size and groups_per_step must be at least 1" in message and "command line" in message


def test_ray_overrides_need_a_ray_section(tmp_path):
    message = error(write(tmp_path, ""), ["--ray.address", "auto"])
    assert "[ray]" in message


def test_a_stray_argument_is_refused(tmp_path):
    message = error(write(tmp_path, ""), ["--run.steps", "3", "4"])
    assert "'4'" in message


def test_overrides_reach_every_kind_of_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "[trainer.optim]\nlr = 3e-6\n")
    config = load_config(path, ["--trainer.optim.lr", "1e-5", "--trainer.optim.betas", "0.8", "0.99",
                                "--trainer.optim.name", "muon", "--run.resume", "true", "--run.dir", "elsewhere",
                                "--curriculum.band", "0.2", "0.8", "--trainer.policy.norm-length", "512",
                                "--rollout.max_in_flight", "3", "--episode.loop.max-turns", "5",
                                "--run.held-out", "t1", "t2", "--trainer.mxfp8", "True"])
    optim = config.trainer.optim
    assert (optim.lr, optim.betas, optim.name) == (1e-5, (0.8, 0.99), "muon")
    assert config.run.resume is True and config.trainer.mxfp8 is True
    assert config.run.dir == tmp_path / "elsewhere"  # relative on the command line: to the working directory
    assert config.curriculum.band == (0.2, 0.8) and config.trainer.policy.norm_length == 512
    assert config.rollout.max_in_flight == 3 and config.episode.loop.max_turns == 5
    assert config.run.held_out == ("t1", "t2")
    assert load_config(path, ["--trainer.policy.norm-length", "None"]).trainer.policy.norm_length is None


def test_paths_in_the_file_are_relative_to_the_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(ROOT)
    config = load_config(write(tmp_path / "sub", '[run]\ndir = "../runs/a"\nsynth_from = "repo"\n'))
    assert config.run.dir == tmp_path / "runs" / "a" and config.run.synth_from == tmp_path / "sub" / "repo"
    assert config.run.tasks == tmp_path / "runs" / "a" / "tasks"  # derived: <run.dir>/tasks


# --- derived defaults: one setting, one place ----------------------------------------------------------------------

def test_untagged_calls_default_follows_the_final_model(tmp_path):
    bundled = write(tmp_path, f'[model]\nname = "{DEFAULT_MODEL}"\n')
    assert load_config(bundled).episode.loop.untagged_calls == "accept"  # the bundled model's recorded setting
    hub = write(tmp_path, '[model]\nname = "Qwen/Qwen2.5-Coder-7B-Instruct"\n', "hub.toml")
    assert load_config(hub).episode.loop.untagged_calls == "reject"
    assert load_config(bundled, ["--model.name", "Qwen/Qwen2.5-Coder-7B-Instruct"]).episode.loop.untagged_calls \
        == "reject"  # the model chosen on the command line decides, not the file's
    assert load_config(hub, ["--model.name", DEFAULT_MODEL]).episode.loop.untagged_calls == "accept"
    explicit = write(tmp_path, f'[model]\nname = "{DEFAULT_MODEL}"\n[episode.loop]\nuntagged_calls = "reject"\n',
                     "explicit.toml")
    assert load_config(explicit).episode.loop.untagged_calls == "reject"  # the file's choice wins
    assert load_config(explicit, ["--model.name", "x/y"]).episode.loop.untagged_calls == "reject"
    assert load_config(bundled, ["--episode.loop.untagged-calls", "reject"]).episode.loop.untagged_calls == "reject"


def test_tags_default_follows_the_final_model(tmp_path):
    bundled = write(tmp_path, f'[model]\nname = "{DEFAULT_MODEL}"\n')
    assert load_config(bundled).episode.loop.tags == "spelled"  # its tag token's row is untrained
    assert load_config(bundled, ["--model.name", "Qwen/Qwen2.5-Coder-7B-Instruct"]).episode.loop.tags == "token"
    assert load_config(bundled, ["--episode.loop.tags", "token"]).episode.loop.tags == "token"
    with pytest.raises(ConfigError, match="tags"):
        load_config(bundled, ["--episode.loop.tags", "auto"])


def test_an_evaluation_reads_the_tree_with_the_wire_of_the_model_it_evaluates(tmp_path, monkeypatch):
    """`shipyard eval --model M [--config FILE]`: the episodes take M's wire settings unless the file or the command
    line sets them (a vllm:MODEL server writes as MODEL); no file is the defaults; vLLM's python follows
    $SHIPYARD_VLLM_PYTHON unless [vllm] python is set."""
    tiny = write(tmp_path, '[model]\nname = "random:tiny"\n')
    assert load_config(tiny).episode.loop.tags == "token"
    assert load_config(tiny, policy=f"vllm:{DEFAULT_MODEL}").episode.loop.tags == "spelled"
    assert load_config(None, policy=DEFAULT_MODEL).episode.loop.untagged_calls == "accept"
    assert load_config(None, ["--episode.loop.tags", "token"], policy=DEFAULT_MODEL).episode.loop.tags == "token"
    explicit = write(tmp_path, '[episode.loop]\ntags = "token"\n', "explicit.toml")
    assert load_config(explicit, policy=DEFAULT_MODEL).episode.loop.tags == "token"
    assert load_config(None).episode.loop.max_turns == RLConfig().episode.loop.max_turns  # no file: the defaults
    monkeypatch.setenv("SHIPYARD_VLLM_PYTHON", str(tmp_path / "venv" / "bin" / "python"))
    assert load_config(None).vllm.python == tmp_path / "venv" / "bin" / "python"
    assert load_config(write(tmp_path, '[vllm]\npython = "v/bin/python"\n', "v.toml")).vllm.python == \
        tmp_path / "v" / "bin" / "python"
    monkeypatch.delenv("SHIPYARD_VLLM_PYTHON")
    assert load_config(None).vllm.python == Path.cwd() / ".venv-vllm" / "bin" / "python"


def test_an_episode_with_no_turn_or_token_to_spend_is_refused_when_the_config_is_read():
    """`--episode.loop.max_tokens 0` was accepted and every episode stopped before its first turn, scored 0."""
    for key in ("max_turns", "max_tokens", "max_new_tokens"):
        with pytest.raises(ConfigError, match="must be at least 1"):
            load_config(CPU, [f"--episode.loop.{key}", "0"])
    # refused when the configuration is read, not at the first generation minutes later (or, for a grading budget
    # cut to nothing, never: every rollout would score 0)
    for override, says in ((["--episode.grade_timeout", "0.001"], "grade_timeout must be at least 1 second"),
                           (["--episode.loop.temperature", "-1"], "temperature must be 0 (greedy) or a finite"),
                           (["--episode.loop.temperature", "inf"], "temperature must be 0 (greedy) or a finite"),
                           (["--episode.loop.wall_time", "0"], "wall_time must be > 0"),
                           (["--rollout.rollout_time_budget", "0"], "rollout_time_budget"),
                           (["--episode.loop.top_p", "7"], "top_p must be in (0, 1]"),
                           (["--episode.loop.max_failed_turns", "0"], "max_failed_turns"),
                           (["--episode.loop.overview_entries", "-1"], "overview_entries at least 0")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(CPU, override)


def test_seeds_follow_run_seed_unless_set(tmp_path):
    config = load_config(write(tmp_path, "[run]\nseed = 7\n"), ["--run.seed", "9"])
    assert config.trainer.seed == config.rollout.run_seed == 9
    config = load_config(write(tmp_path, "[run]\nseed = 7\n[trainer]\nseed = 1\n", "own.toml"))
    assert (config.trainer.seed, config.rollout.run_seed) == (1, 7)


def test_ray_device_and_tokenizer_come_from_engine_and_model_and_may_not_disagree(tmp_path):
    pytest.importorskip("ray")
    text = '[model]\ntokenizer = "tok"\n[engine]\ndevice = "cuda"\n[ray]\naddress = "auto"\n'
    config = load_config(write(tmp_path, text))
    assert (config.ray.device, config.ray.tokenizer, config.ray.address) == ("cuda", "tok", "auto")
    assert config.ray.allowed_roots == (config.run.tasks,)  # the environment servers may snapshot the task set
    assert load_config(write(tmp_path, text), ["--engine.device", "cuda:1"]).ray.device == "cuda:1"
    message = error(write(tmp_path, text + 'device = "cpu"\n', "clash.toml"))
    assert "ray.device" in message and "engine.device" in message


# --- saving the resolved config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("example", [CPU, GPU])
def test_the_resolved_config_round_trips(tmp_path, example):
    config = load_config(example, ["--trainer.optim.lr", "1.25e-5", "--run.dir", str(tmp_path / "run"),
                                   "--trainer.policy.norm-length", "300"])
    saved = save_config(config, tmp_path / "run" / "config.toml", note="overrides: --trainer.optim.lr 1.25e-5")
    again = load_config(saved)
    assert again == config
    assert saved.read_text().startswith("# ")  # where it came from, as a comment
    assert save_config(again, tmp_path / "second.toml").read_text() == saved.read_text().split("\n", 1)[1]


def test_default_config_is_valid_and_loading_does_not_change_it(tmp_path):
    path = write(tmp_path, "")
    config = load_config(path)
    assert load_config(path) == config  # the derived defaults settle the same way every time
    assert type(config) is RLConfig and config.model.name == DEFAULT_MODEL and config.ray is None
    # the dataclass defaults, but for the derived ones: the bundled model's recorded wire, the run's task directory
    assert (config.episode.loop.untagged_calls, config.episode.loop.tags) == ("accept", "spelled")
    assert config.run.tasks == Path(os.path.abspath(config.run.dir / "tasks"))
    assert config.trainer == RLConfig().trainer and config.rollout == RLConfig().rollout


# --- the examples --------------------------------------------------------------------------------------------------

def test_cpu_example_is_the_bundled_model_on_cpu_with_adamw_on_the_example_repo():
    config = load_config(CPU)
    assert config.model.name == DEFAULT_MODEL and config.engine.kind == "local" and config.engine.device == "cpu"
    assert config.run.device == "cpu" and config.run.world_size == 1 and config.ray is None
    assert config.trainer.optim.name == "adamw" and not config.trainer.mxfp8
    assert config.rollout.group_size <= 4 and config.run.synth_from == EXAMPLE_REPO
    assert engine_spec(config) == (DEFAULT_MODEL, {"device": "cpu", "tokenizer": None, "lora": LoraConfig()})


def test_a_lora_section_reaches_the_trainer_and_the_local_engine(tmp_path):
    path = write(tmp_path, "[trainer]\ncompute_dtype = \"bfloat16\"\n\n[trainer.lora]\nenabled = true\nrank = 1\n")
    config = load_config(path, ["--trainer.lora.alpha", "8"])
    assert config.trainer.lora == LoraConfig(enabled=True, rank=1, alpha=8.0)
    assert engine_spec(config)[1]["lora"] == config.trainer.lora  # the engine gets the adapter the pushes fill
    save_config(config, tmp_path / "saved.toml")
    assert load_config(tmp_path / "saved.toml") == config
    assert "lora.rank must be >= 1" in error(write(tmp_path, "[trainer.lora]\nenabled = true\nrank = 0\n"))
    assert "AdamW" in error(write(tmp_path, "[trainer.lora]\nenabled = true\n[trainer.optim]\nname = \"muon\"\n"))


def test_the_cpu_examples_lora_command_line_loads():
    line = next(line for line in CPU.read_text().splitlines() if "--trainer.lora.enabled" in line)
    config = load_config(CPU, line.split("configs/cpu.toml", 1)[1].split())
    # "auto": the base is loaded in float32 and frozen in bf16 by the trainer where the CPU has bf16 arithmetic
    assert config.trainer.lora.enabled and config.trainer.compute_dtype == "auto"
    assert config.trainer.optim.lr == 10 * load_config(CPU).trainer.optim.lr


def test_gpu_node_example_is_managed_vllm_muon_mxfp8_and_hints_and_checks_here():
    """`shipyard train --check configs/gpu-node.toml` passes on this GPU-less machine and names what the run would
    start: the ranks rank 0 starts itself (not torchrun), the vLLM servers and their GPUs; and what is missing here."""
    config = load_config(GPU)
    assert config.engine.kind == "vllm" and config.vllm.servers == len(config.vllm.gpus) == 4
    assert not set(config.vllm.gpus) & set(range(config.run.world_size))  # the trainer's GPUs are its own
    assert "7B" in config.model.name and config.trainer.optim.name == "muon" and config.trainer.mxfp8
    assert config.hints.enabled and config.run.device == "cuda" and config.ray is None
    assert "\n#   torchrun" not in GPU.read_text()  # no launch line that contradicts how ranks start
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "train", "--check", str(GPU)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "4 rank(s) — rank 0 is this process (cuda:0); it starts ranks 1..3" in text
    assert "4 vLLM server(s)" in text and "server 3 on GPU(s) 7" in text and "configuration OK" in text
    if not torch.cuda.is_available():
        assert "the trainer needs 4 CUDA device(s); this machine has 0" in text


def test_the_check_of_servers_someone_else_runs_starts_nothing_and_needs_no_venv(tmp_path):
    path = write(tmp_path, '[engine]\nkind = "vllm"\n\n[vllm]\npython = "/nonexistent/python"\n'
                           'urls = ["http://node-2:8000", "http://node-3:8000"]\nweights_dir = "/shared/w"\n')
    found = plan(load_config(path))
    engine = " ".join(line for line in found.lines if line.startswith("engine: "))
    assert "2 vLLM server(s) someone else runs, at http://node-2:8000, http://node-3:8000" in engine
    assert "pushes written to /shared/w/" in engine and not any("venv" in m for m in found.missing_here)


def test_the_check_of_servers_on_ray_names_one_per_engine_actor(tmp_path):
    path = write(tmp_path, '[engine]\nkind = "vllm"\n\n[vllm]\npython = "/nonexistent/python"\n\n'
                           '[ray]\naddress = "auto"\nengines = 3\nengine_gpus = 2\nenv_servers = 0\n')
    found = plan(load_config(path))
    engine = " ".join(line for line in found.lines if line.startswith("engine: "))
    assert "3 vLLM server(s)" in engine and "one started by each Ray engine actor on its node, on 2 GPU(s)" in engine
    assert any("/nonexistent/python is not there" in m for m in found.missing_here)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_every_checked_in_config_passes_the_check_of_what_it_would_start(name):
    found = plan(load_config(ROOT / "configs" / name))
    assert found.lines[0].startswith("model: ") and any(line.startswith("engine: ") for line in found.lines)



# --- imports: no Ray unless asked for ------------------------------------------------------------------------------

BLOCK_RAY = "import sys; sys.modules['ray'] = None\n"  # `import ray` now raises ImportError, as if not installed


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_without_ray_the_module_imports_and_loads_configs_without_a_ray_section(tmp_path):
    ray_toml = write(tmp_path, '[ray]\naddress = "auto"\n')
    proc = _python(BLOCK_RAY + f"""
from shipyard.rl.config import ConfigError, load_config
assert load_config({str(CPU)!r}).ray is None
try:
    load_config({str(ray_toml)!r})
except ConfigError as e:
    print("ERROR", e)
print("RAY IMPORTED" if sys.modules.get("ray") else "NO RAY")
print("TORCH", "torch" in sys.modules)
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NO RAY" in proc.stdout and "pip install 'shipyard[ray]'" in proc.stdout and "[ray]" in proc.stdout


def test_importing_and_loading_a_cpu_config_does_not_start_or_import_ray():
    proc = _python(f"import sys\nfrom shipyard.rl.config import load_config\nload_config({str(CPU)!r})\n"
                   "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


# --- the CLI path: typer passes the unparsed options through ---------------------------------------------------------

def test_typer_passes_extra_options_through_to_load_config(tmp_path):
    app = typer.Typer()
    seen: list[RLConfig] = []

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def train(ctx: typer.Context, config: Path = typer.Argument(...)) -> None:
        seen.append(load_config(config, ctx.args))

    @app.command()
    def other() -> None:  # a second command, so typer keeps `train` as a subcommand name
        pass

    path = write(tmp_path, "[trainer.optim]\nlr = 3e-6\n")
    result = CliRunner().invoke(app, ["train", str(path), "--trainer.optim.lr", "1e-5", "--run.steps", "3"])
    assert result.exit_code == 0, result.output
    assert seen[0].trainer.optim.lr == 1e-5 and seen[0].run.steps == 3
    # `--help` after CONFIG is typer's own; after `--` it reaches tyro, which lists every configuration option
    result = CliRunner().invoke(app, ["train", str(path), "--", "--help"])
    assert result.exit_code == 0 and "--trainer.optim.lr" in result.output and len(seen) == 1


def test_help_lists_every_option_and_exits_zero(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        load_config(write(tmp_path, ""), ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.optim.lr" in out and "--episode.loop.max-turns" in out and "--run.resume {true,false}" in out


@pytest.mark.parametrize(("content", "said"), [(b"[run]\nsteps = \xff\n", "not UTF-8"), (None, "is a directory"),
                                               ("fifo", "not a regular file")])
def test_unreadable_files_are_named(tmp_path, content, said):
    path = tmp_path / "bad.toml"
    if content is None:
        path.mkdir()
    elif content == "fifo":  # opening it would wait for a writer forever
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    message = error(path)
    assert str(path) in message and said in message


def test_a_saved_config_reads_back_the_same_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(CPU, ["--run.dir", "here"])
    saved = save_config(config, tmp_path / "config.toml")
    monkeypatch.chdir(ROOT)
    assert load_config(saved) == config and config.run.dir == tmp_path / "here"


def test_saving_refuses_a_none_that_would_read_back_as_something_else(tmp_path):
    config = load_config(CPU)
    config.run.synth_from = None  # defaults to None: left out, reads back the same
    save_config(config, tmp_path / "ok.toml")
    config.model.name = None  # defaults to a name: left out, it would read back as that name
    with pytest.raises(ValueError, match="model_config.name|ModelConfig.name"):
        save_config(config, tmp_path / "bad.toml")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_every_checked_in_config_loads(name):
    """A config the docs tell users to run is a valid tree."""
    config = load_config(ROOT / "configs" / name)
    if name == "cpu-sft.toml":
        assert config.sft.sources == ("gold",) and config.run.held_out_count == 2
