"""`shipyard train` with `engine.kind = "vllm"` (a real subprocess): the run starts its vLLM servers from vLLM's own
venv, samples from them, pushes the trainer's weights after every step (the whole model, or with [trainer.lora] the
adapter alone), and stops them when it ends. Marked `vllm` (tests/models/test_vllm.py says how the venv is found)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from servers import needs_sandbox
from tiny_run import CONFIG
from vllm_venv import served_model, vllm_python

pytestmark = [pytest.mark.vllm, needs_sandbox]

PYTHON = vllm_python()


@pytest.mark.parametrize("lora, on_ray", [(False, False), (True, False), (True, True)],
                         ids=["full", "lora", "lora-on-ray"])
def test_two_steps_with_managed_vllm_servers_push_every_step_and_stop_them(taskset, tmp_path, lora, on_ray):
    """On Ray, the one engine actor starts the server on its node (this machine) and the pushes reach it through the
    object store."""
    model_dir = tmp_path / "model"
    served_model(model_dir, torch.float32)  # float32: the trainer's; the servers load it as bf16
    config = tmp_path / "vllm.toml"
    text = CONFIG.format(tasks=taskset[0]).replace('name = "random:tiny"', f'name = "{model_dir}"')
    config.write_text(text.replace("steps = 3", "steps = 2") + f"""
[engine]
kind = "vllm"

[vllm]
python = "{PYTHON}"

kv_cache_gib = 1.0
""" + ("""
[trainer.lora]
enabled = true
rank = 8
""" if lora else "") + ("""
[ray]
num_cpus = 2
engines = 1
workers = 1
concurrency = 4
env_servers = 0
""" if on_ray else ""))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "train", str(config), "--run.dir", str(run)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s.get("step", 0) >= 1 and "engine/policy_version" in s]
    assert [s["engine/policy_version"] for s in trained] == [0, 1]  # batch k sampled by the weights of step k - 1
    assert all(s["time/weight_sync_seconds"] > 0 for s in trained)
    out = subprocess.run(["pgrep", "-f", str(model_dir)], capture_output=True, text=True)
    assert out.stdout.strip() == "", "a vLLM server outlived its run"
    if on_ray:  # sampled by the actor's server; its weights and log are on the actor's node, not in the run
        engines = {json.loads(line)["engine"] for line in (run / "rollouts.jsonl").read_text().splitlines()}
        assert engines == {f"router[vllm:{model_dir}@ray-engine-0]"}  # the rollout worker's router over it
        said = proc.stdout + proc.stderr
        assert "engine actor: starting 1 vLLM server(s)" in said and "restarting" not in said  # it lived its run
        return
    assert sorted(p.name for p in (run / "vllm" / "weights").iterdir()) == ["v2"]  # the last push's, alone
    pushed = sorted(p.name for p in (run / "vllm" / "weights" / "v2").iterdir())
    assert pushed == (["adapter_config.json", "adapter_model.safetensors"] if lora else ["model.safetensors"])
    assert "Application startup complete" in (run / "vllm" / "vllm-0.log").read_text()


def test_the_vllm_cpu_config_runs_as_written_for_two_steps(taskset, tmp_path):
    """configs/vllm-cpu.toml with its own settings (server, KV cache, context, trainer), the tiny served model in
    place of the bundled 0.5B and the fixture's task set in place of the one it synthesizes: what its full run does
    (docs/benchmarks.md records one with the 0.5B), in minutes."""
    from pathlib import Path

    model_dir = tmp_path / "model"
    served_model(model_dir, torch.float32)
    config = Path(__file__).parents[2] / "configs" / "vllm-cpu.toml"
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "train", str(config), "--run.dir", str(run),
                           "--model.name", str(model_dir), "--run.tasks", str(taskset[0]), "--run.steps", "2",
                           "--vllm.python", str(PYTHON)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["engine/policy_version"] for s in steps if "engine/policy_version" in s] == [0, 1]
    assert all(s["time/weight_sync_seconds"] > 0 for s in steps if "engine/policy_version" in s)
    assert {s["step"] for s in steps if "eval/scored" in s} == {0, 2}  # before the first step and after the last
