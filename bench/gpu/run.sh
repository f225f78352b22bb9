#!/usr/bin/env bash
# On a GPU machine with CUDA torch and no internet: install the service beside that torch from
# the wheelhouse (bench/gpu/wheelhouse.sh, carried along) and run the GPU page copy's check.
# Results: $OUT/cuda-check.json (the device tool's folder) or bench/results/.
#
#   bash bench/gpu/run.sh [cuda_check's options]
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi -L
version=$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
venv=${TMPDIR:-/tmp}/cuda-check-venv
python3 -m venv --system-site-packages "$venv"  # keeps the machine's CUDA torch
"$venv/bin/pip" install -q --no-index --find-links "bench/gpu/wheelhouse/cp$version" \
    -r <("$venv/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
"$venv/bin/pip" install -q --no-index --no-deps --no-build-isolation -e .
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
PATH="$venv/bin:$PATH" "$venv/bin/python" -m bench.gpu.cuda_check "$@"
