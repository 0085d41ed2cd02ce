#!/bin/sh
# The GPU check on a machine with no package registry (see docs/benchmarks.md, "The GPU check").
#
#   scripts/gpu.sh wheels           where PyPI is reachable: download the pinned wheels the check
#                                   needs beside the GPU machine's own torch into .gpu-wheels/
#                                   (ignored by git; carry it with the working tree)
#   scripts/gpu.sh check [ARGS...]  on the GPU machine: install them from that folder only, into
#                                   .gpu-env/ (a venv that also sees the machine's own packages,
#                                   torch included), then run python -m h2o_chat.bench gpu ARGS
#
# Variables: PYTHON (wheels: default .venv/bin/python, whose installed versions the wheels
# follow; check: default python3, the machine's), GPU_PYTHON_VERSION (the wheels' Python,
# default 3.12), GPU_WHEELS (default .gpu-wheels), GPU_ENV (default .gpu-env).
set -eu
cd "$(dirname "$0")/.."

WHEELS=${GPU_WHEELS:-.gpu-wheels}
ENV=${GPU_ENV:-.gpu-env}
# What the check imports beyond torch (which the GPU machine has, with CUDA, and which is
# far too big to carry), at the versions requirements.txt pins. accelerate takes
# device_map; gguf reads the embedded model's file where that package is installed.
PACKAGES="transformers tokenizers safetensors PyYAML psutil gguf accelerate"

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
    # Binary wheels for the GPU machine's Python on Linux x86_64, whatever runs this.
    target="--only-binary=:all: --python-version ${GPU_PYTHON_VERSION:-3.12} --platform manylinux2014_x86_64
            --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --dest $WHEELS"
    all=$(pins)
    # accelerate depends on torch: without its dependencies, the machine's torch serves.
    accelerate=$(printf '%s\n' $all | grep -i '^accelerate==')
    rest=$(printf '%s\n' $all | grep -vi '^accelerate==')
    # Every dependency at the version installed here, where it is (what the tests ran with).
    "$PYTHON" -m pip freeze --exclude-editable > "$WHEELS/constraints.txt"
    "$PYTHON" -m pip download $target -c "$WHEELS/constraints.txt" $rest
    "$PYTHON" -m pip download $target --no-deps "$accelerate"
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
    "$ENV/bin/python" -m pip install --no-index --find-links "$WHEELS" $(pins)
    exec "$ENV/bin/python" -m h2o_chat.bench gpu "$@"
    ;;
*)
    sed -n '2,15p' "$0"
    exit 2
    ;;
esac
