#!/bin/sh
# The GPU check on a machine with no package registry (see docs/benchmarks.md, "The GPU check").
#
#   scripts/gpu.sh wheels           where PyPI is reachable: download into .gpu-wheels/ (ignored
#                                   by git; carry it with the working tree) the pinned wheels
#                                   the GPU machine lacks: transformers, and bitsandbytes with
#                                   only the machine's CUDA library (3.6 MB, not 43)
#   scripts/gpu.sh check [ARGS...]  on the GPU machine: install them from that folder only, into
#                                   .gpu-env/ (a venv that also sees the machine's own packages,
#                                   torch included), then run python -m h2o_chat.bench gpu ARGS
#
# Variables: PYTHON (wheels: default .venv/bin/python; check: default python3, the
# machine's), GPU_PYTHON_VERSION (the wheels' Python, default 3.12), GPU_CUDA (the CUDA
# library bitsandbytes keeps, default 130), GPU_WHEELS (default .gpu-wheels), GPU_ENV
# (default .gpu-env).
set -eu
cd "$(dirname "$0")/.."

WHEELS=${GPU_WHEELS:-.gpu-wheels}
ENV=${GPU_ENV:-.gpu-env}
# What the check imports that the GPU machine's image lacks at the versions requirements.txt
# pins (it has torch, accelerate, safetensors, tokenizers, psutil and PyYAML; no registry).
PACKAGES="transformers bitsandbytes"

pins() {
    for name in $PACKAGES; do
        line=$(grep -i "^$name==" requirements.txt) || { echo "requirements.txt pins no $name" >&2; exit 1; }
        printf '%s ' "$line"
    done
}

case "${1:-}" in
wheels)
    PYTHON=${PYTHON:-.venv/bin/python}
    mkdir -p "$WHEELS"
    # Binary wheels for the GPU machine's Python on Linux x86_64, whatever runs this; their
    # dependencies are the machine's own.
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_28_x86_64 --dest "$WHEELS" $(pins)
    # bitsandbytes ships a library per CUDA and ROCm version: keep the machine's only.
    "$PYTHON" - "$WHEELS" "libbitsandbytes_cuda${GPU_CUDA:-130}.so" <<'TRIM'
import sys, zipfile
from pathlib import Path
folder, keep = Path(sys.argv[1]), sys.argv[2]
for wheel in folder.glob("bitsandbytes-*.whl"):
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
        dropped = {n for n in source.namelist() if n.endswith(".so") and Path(n).name != keep}
        for name in source.namelist():
            if name in dropped:
                continue
            data = source.read(name)
            if name.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(True)
                                if line.split(b",")[0].decode() not in dropped)
            target.writestr(name, data)
    trimmed.replace(wheel)
TRIM
    du -sh "$WHEELS"
    echo "carry $WHEELS with the working tree, then run: scripts/gpu.sh check"
    ;;
check)
    shift
    PYTHON=${PYTHON:-python3}
    [ -d "$WHEELS" ] || { echo "no $WHEELS here: run 'scripts/gpu.sh wheels' where PyPI is reachable" >&2; exit 2; }
    if [ ! -x "$ENV/bin/python" ]; then
        # A venv of its own, so the machine's packages are never changed; a .pth file puts
        # the machine's site folders after the venv's, so its torch (and pip) are found
        # even where PYTHON is itself a venv.
        "$PYTHON" -m venv --without-pip "$ENV"
        site=$("$ENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
        "$PYTHON" -c "import site; print('\n'.join(site.getsitepackages() + [site.getusersitepackages()]))" \
            > "$site/gpu-machine.pth"
    fi
    "$ENV/bin/python" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
    exec "$ENV/bin/python" -m h2o_chat.bench gpu "$@"
    ;;
*)
    sed -n '2,15p' "$0"
    exit 2
    ;;
esac
