"""The launcher of vLLM servers (`shipyard.models.vllm_server`) without vLLM: what it refuses, and a server that dies
while starting. The servers themselves are tested in test_vllm.py (-m vllm)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from servers import alive, wait_for

from shipyard.errors import UsageError
from shipyard.models.vllm_server import EXTENSION_MODULE, ServerStartError, VLLMConfig, VLLMServers
from shipyard.rl.build import vllm_settings
from shipyard.rl.config import ConfigError, RLConfig


def test_a_python_that_is_not_there_is_a_clear_error_before_anything_starts(tmp_path):
    with pytest.raises(UsageError, match="install-vllm.sh"):
        VLLMServers(VLLMConfig(python=tmp_path / "nope" / "python", max_model_len=64), tmp_path, tmp_path / "logs")


def test_a_server_that_exits_while_starting_fails_the_start_with_its_log(tmp_path):
    """This venv has no vLLM: the server exits at once ("No module named vllm"); the start says so, with the log's
    end, and leaves no socket directory behind."""
    servers = VLLMServers(VLLMConfig(python=sys.executable, max_model_len=64, start_timeout=120), tmp_path,
                          tmp_path / "logs")
    with pytest.raises(ServerStartError, match="(?s)exited with code 1 while starting.*No module named"):
        servers.start()
    assert servers.procs == [] and (tmp_path / "logs" / "vllm-0.log").exists()


def test_cpu_servers_prefill_whole_prompts_and_gpu_servers_split_their_gpus(tmp_path):
    cpu = VLLMServers(VLLMConfig(python=sys.executable, max_model_len=4096), tmp_path, tmp_path)
    command = cpu.command(tmp_path / "0.sock")
    assert "--no-enable-chunked-prefill" in command and command[command.index("--max-num-batched-tokens") + 1] == "4096"
    assert f"{EXTENSION_MODULE}.ShipyardWorker" in command and "--uds" in command
    gpu = VLLMServers(VLLMConfig(python=sys.executable, max_model_len=4096, servers=2, gpus=(4, 5, 6, 7),
                                 gpus_per_server=2), tmp_path, tmp_path)
    assert [gpu.environment(i)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["4,5", "6,7"]
    assert "--no-enable-chunked-prefill" not in gpu.command(tmp_path / "0.sock")


def test_lora_servers_take_adapters_at_run_time_of_the_next_rank_vllm_offers(tmp_path):
    from shipyard.models.lora import LoraConfig

    def flags(rank: int):
        servers = VLLMServers(VLLMConfig(python=sys.executable, max_model_len=64), tmp_path, tmp_path,
                              LoraConfig(enabled=True, rank=rank))
        command = servers.command(tmp_path / "0.sock")
        env = servers.environment(0)
        return command[command.index("--max-lora-rank") + 1], "--enable-lora" in command, \
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]

    assert flags(16) == ("16", True, "True") and flags(2) == ("8", True, "True") and flags(1)[0] == "1"
    plain = VLLMServers(VLLMConfig(python=sys.executable, max_model_len=64), tmp_path, tmp_path, LoraConfig())
    assert "--enable-lora" not in plain.command(tmp_path / "0.sock")  # LoRA off: a full-weight server
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.environment(0)
    with pytest.raises(UsageError, match="rank <= 512"):
        VLLMServers(VLLMConfig(python=sys.executable, max_model_len=64), tmp_path, tmp_path,
                    LoraConfig(enabled=True, rank=600))


def test_the_servers_context_is_the_episodes_budget_and_never_shorter():
    config = RLConfig()
    budget = config.episode.loop.max_tokens
    assert vllm_settings(config).max_model_len == budget
    longer = replace(config, vllm=replace(config.vllm, max_model_len=budget * 2))
    assert vllm_settings(longer).max_model_len == budget * 2
    with pytest.raises(ConfigError, match="shorter than the episodes' context budget"):
        vllm_settings(replace(config, vllm=replace(config.vllm, max_model_len=budget // 2)))


def test_servers_on_ray_are_one_per_engine_actor_and_anything_else_is_refused_before_the_run_starts():
    from shipyard.models.lora import LoraConfig
    from shipyard.rl.build import check_engine
    from shipyard.rl.config import EngineConfig
    from shipyard.rollout.ray_transport import RayConfig

    vllm = replace(RLConfig(), engine=EngineConfig(kind="vllm"))
    check_engine(vllm)
    check_engine(replace(vllm, trainer=replace(vllm.trainer, lora=LoraConfig(enabled=True))))  # adapters are pushed
    on_ray = replace(vllm, ray=RayConfig(engines=2, env_servers=0))
    check_engine(on_ray)  # two engine actors, a server each
    for wrong in ({"servers": 2}, {"gpus": (0,)}, {"urls": ("http://x:8000",)}):
        with pytest.raises(ConfigError, match="each of ray.engines engine actors starts one vLLM server"):
            check_engine(replace(on_ray, vllm=replace(on_ray.vllm, **wrong)))


def test_nccl_pushes_are_refused_before_the_run_starts_where_they_cannot_work():
    from shipyard.models.lora import LoraConfig
    from shipyard.rl.build import check_engine
    from shipyard.rl.config import EngineConfig
    from shipyard.rollout.ray_transport import RayConfig

    base = RLConfig()
    nccl = replace(base, engine=EngineConfig(kind="vllm", device="cuda"), run=replace(base.run, device="cuda"),
                   vllm=replace(base.vllm, gpus=(4, 5), servers=2, transfer="nccl"))
    check_engine(nccl)
    wrong = {"LoRA run pushes its adapter": replace(nccl, trainer=replace(nccl.trainer, lora=LoraConfig(enabled=True))),
             "set run.device": replace(nccl, run=replace(nccl.run, device="cpu")),
             "holds GPU 0": replace(nccl, vllm=replace(nccl.vllm, gpus=(0, 5))),
             "with \\[ray\\]": replace(nccl, ray=RayConfig(engines=2, env_servers=0))}
    for why, config in wrong.items():
        with pytest.raises(ConfigError, match=why):
            check_engine(config)


def fake_vllm_python(tmp_path: Path) -> Path:
    """A "python" (a shell script, as a venv's can be) whose `vllm.entrypoints.openai.api_server` is
    tests/models/fake_vllm.py: the launcher's own start-up line runs as it does with vLLM."""
    here = Path(__file__).resolve().parent
    api = tmp_path / "pkg" / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True)
    for d in (api, api.parent, api.parent.parent):
        (d / "__init__.py").write_text("")
    (api / "api_server.py").write_text(f"import sys\nsys.path.insert(0, {str(here)!r})\n"
                                       "from fake_vllm import serve_as_vllm\nserve_as_vllm(sys.argv[1:])\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'pkg'}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def test_a_run_killed_outright_takes_its_servers_with_it(tmp_path):
    """The process that started the servers is SIGKILLed (as the OOM killer did to a run): its server gets SIGTERM
    from the kernel (`shipyard.lifetime.die_with_parent`) instead of outliving it. The server is
    tests/models/fake_vllm.py behind a package named vllm, so the launcher's own start-up line runs as it does with
    vLLM."""
    python = fake_vllm_python(tmp_path)
    run = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from shipyard.models.vllm_server import VLLMConfig, VLLMServers
servers = VLLMServers(VLLMConfig(python=Path({str(python)!r}), max_model_len=64, start_timeout=120), Path('.'),
                      Path({str(tmp_path / 'logs')!r}))
servers.start()
print(servers.procs[0].pid, flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    server = int(run.stdout.readline())
    try:
        run.kill()
        run.wait()
        # the kernel's signal, then the server's exit: an event, polled
        assert wait_for(lambda: not alive(server), 60), "the server outlived the process that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server, signal.SIGKILL)  # the fake's child that ignores SIGTERM, and the server if it lingers


def test_a_server_restarted_from_a_thread_that_ends_outlives_that_thread(tmp_path):
    """The kernel's parent-death signal follows the thread that forks: a server restarted from a short-lived thread
    (an agent's, in `bench`'s drive) was killed when that thread ended. Servers fork from the process's launcher."""
    servers = VLLMServers(VLLMConfig(python=fake_vllm_python(tmp_path), max_model_len=64, start_timeout=120),
                          tmp_path, tmp_path / "logs")
    try:
        servers.start()
        worker = threading.Thread(target=servers.restart, args=(0,))
        worker.start()
        worker.join()
        restarted = servers.procs[0]
        # the kernel signals as the thread exits: once its task is gone, a server tied to it has its SIGTERM
        assert wait_for(lambda: not Path(f"/proc/self/task/{worker.native_id}").exists(), 30)
        assert not wait_for(lambda: not alive(restarted.pid), 3), f"the restarted server ended: {restarted.poll()}"
    finally:
        servers.stop()


def test_cpu_servers_compute_in_bfloat16_only_where_the_cpu_has_it(tmp_path):
    """vLLM's CPU backend computes bf16 without AVX512-BF16 hundreds of times slower (1.5-3 generated tokens/s for
    the 0.5B on an AVX2 AMD EPYC): "auto" (the default) is bfloat16 only where this CPU has it; GPU servers pass the
    setting through (vLLM's "auto": the checkpoint's dtype); an explicit bfloat16 is kept, with a warning where slow."""
    import warnings

    from shipyard.models.dtype import native_bfloat16

    def dtype(**kw):
        command = VLLMServers(VLLMConfig(python=sys.executable, max_model_len=64, **kw), tmp_path, tmp_path) \
            .command(tmp_path / "0.sock")
        return command[command.index("--dtype") + 1]

    native = native_bfloat16("cpu")
    assert dtype() == ("bfloat16" if native else "float32") and dtype(dtype="float32") == "float32"
    assert dtype(gpus=(0,)) == "auto"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert dtype(dtype="bfloat16") == "bfloat16"
    assert any("hundreds of times slower" in str(w.message) for w in seen) == (not native)
