"""The launcher of vLLM servers (`shipyard.models.vllm_server`) without vLLM: what it refuses, and a server that dies
while starting. The servers themselves are tested in test_vllm.py (-m vllm)."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

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


def test_the_servers_context_is_the_episodes_budget_and_never_shorter():
    config = RLConfig()
    budget = config.episode.loop.max_tokens
    assert vllm_settings(config).max_model_len == budget
    longer = replace(config, vllm=replace(config.vllm, max_model_len=budget * 2))
    assert vllm_settings(longer).max_model_len == budget * 2
    with pytest.raises(ConfigError, match="shorter than the episodes' context budget"):
        vllm_settings(replace(config, vllm=replace(config.vllm, max_model_len=budget // 2)))


def test_what_managed_servers_cannot_do_yet_is_refused_before_the_run_starts():
    from shipyard.models.lora import LoraConfig
    from shipyard.rl.build import check_engine
    from shipyard.rl.config import EngineConfig

    vllm = replace(RLConfig(), engine=EngineConfig(kind="vllm"))
    check_engine(vllm)
    lora = replace(vllm, trainer=replace(vllm.trainer, lora=LoraConfig(enabled=True)))
    with pytest.raises(ConfigError, match="load_lora_adapter are not built yet"):
        check_engine(lora)
    with pytest.raises(ConfigError, match="servers on a Ray cluster are not built yet"):
        check_engine(replace(vllm, ray=object()))
