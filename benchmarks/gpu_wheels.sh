#!/usr/bin/env bash
# The wheels a GPU machine without internet lacks for benchmarks/gpu_check.py (docs/gpu-check.md, "A machine without
# internet"): downloaded here for CPython 3.12 on x86_64 Linux, whatever this machine runs, then copied over.
#
#   benchmarks/gpu_wheels.sh [DIR]            # default .whl (git-ignored); PY=python3.12 to pick the pip
#
# There: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
#        export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail

DIR=${1:-.whl}
PY=${PY:-python3}
# Exactly the list that worked on the first GPU run (2026-11-26, H100, Python 3.12.3, torch 2.11.0+cu130).
WHEELS=(
    omegaconf==2.4.0
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
    imagecodecs==2026.3.6 simplejpeg==1.9.0 tifffile==2026.3.3
    openslide-python==1.4.7 openslide-bin==4.0.1.2
    shapely==2.2.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
)

mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "${WHEELS[@]}"

# Only the listed wheels count (DIR may hold others from earlier runs).
files=()
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    version=${spec#*==}
    stem=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
    match=$(find "$DIR" -maxdepth 1 -iname "${stem}-${version}-*.whl" | head -n 1)
    if [ -z "$match" ]; then
        echo "gpu_wheels: $spec not in $DIR" >&2
        exit 1
    fi
    files+=("$match")
done
bytes=$(stat -c %s "${files[@]}" | awk '{s += $1} END {print s}')
echo "${#files[@]} wheels in $DIR: $bytes bytes ($(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}') MiB)"
