#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything megatron-tokenweave needs, then install
# this package into it. On a CPU machine: torch 2.13.0 (CPU build), megatron-core 0.19.2 (its
# metadata asks for Python >= 3.12; it runs on 3.11, so it goes in with --no-deps
# --ignore-requires-python), triton (megatron-core imports it), pytest, ruff, and what Megatron's
# static engine and Flask text generation server import (tqdm, flask, flask-restful), psutil
# (Megatron's distributed checkpoint writer), and matplotlib (the benchmarks' plots, which the
# tests draw from synthetic results).
# Never installs TransformerEngine (it breaks `import megatron.core` on machines without CUDA).
# TOKENWEAVE_VENV picks the folder (default .venv); PYTHON the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")"
venv=${TOKENWEAVE_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
"$py" -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
"${pip[@]}" numpy packaging pytest ruff triton tqdm flask flask-restful matplotlib psutil
"$py" -c "import megatron.core, sys; sys.exit(not megatron.core.__version__.startswith('0.19.2'))" 2>/dev/null \
  || "${pip[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
"${pip[@]}" --no-build-isolation --no-deps -e .
"$py" -c "import megatron.core, torch, megatron_tokenweave as tw; \
print('ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__, \
'| megatron-tokenweave', tw.__version__)" 2>&1 | grep '^ready'
