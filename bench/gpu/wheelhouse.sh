#!/usr/bin/env bash
# The service's dependencies as wheels, for a GPU machine that has CUDA torch and no internet
# (the device tool's): bench/gpu/run.sh installs them from bench/gpu/wheelhouse/ beside that
# machine's torch. One folder per CPython minor version, since the machine's is not known here.
#
#   bash bench/gpu/wheelhouse.sh            # then carry bench/gpu/wheelhouse to the machine
set -euo pipefail
cd "$(dirname "$0")"
python=../../.venv/bin/python
# The [project] dependencies of pyproject.toml (numpy comes with the machine's torch).
mapfile -t requirements < <("$python" - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("../../pyproject.toml", "rb"))["project"]["dependencies"]))
PY
)
for version in 3.11 3.12 3.13; do
    echo "wheelhouse: CPython $version"
    "$python" -m pip download -q --dest "wheelhouse/cp${version/./}" --only-binary=:all: \
        --python-version "$version" --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        "${requirements[@]}"
done
du -sh wheelhouse
