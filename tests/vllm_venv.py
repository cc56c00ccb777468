"""Where the tests against real vLLM servers (`-m vllm`) find vLLM's own venv: $SHIPYARD_VLLM_PYTHON, else
.venv-vllm/bin/python at the repository root (`bash scripts/install-vllm.sh .venv-vllm`); and the model they serve."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("SHIPYARD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def vllm_python() -> Path:
    """The venv's python; the calling test module is skipped without it — unless $SHIPYARD_REQUIRE_VLLM is set (CI),
    where a missing venv is an error."""
    import pytest

    if not os.access(PYTHON, os.X_OK):
        if os.environ.get("SHIPYARD_REQUIRE_VLLM"):
            raise RuntimeError(f"$SHIPYARD_REQUIRE_VLLM is set but {PYTHON} is not vLLM's venv python")
        pytest.skip(f"no vLLM venv at {PYTHON} (docs/training.md, 'vLLM servers')", allow_module_level=True)
    return PYTHON


def served_model(directory: Path, dtype=None):
    """The tiny random Qwen2 the vLLM tests serve (hidden 256, 2 layers: a head dimension of 64, which vLLM's CPU
    attention takes), saved with its tokenizer as an HF directory in `dtype` (default bf16, as servers load it);
    its tokenizer."""
    import torch

    from shipyard.models.resolve import tiny_model

    m, tok = tiny_model(seed=0, hidden=256, layers=2)
    m.to(dtype or torch.bfloat16).save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok
