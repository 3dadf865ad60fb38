#!/usr/bin/env bash
# Sets up a virtual environment in .venv, installs hetero with its extras, and runs the main job.
#   TORCH_SPEC   the PyTorch requirement to install (default torch==2.13.0; on machines of this project that
#                resolves to the CPU build). Set it to the build you want, e.g. a CUDA build on a GPU machine.
#   HETERO_NVME_DIR  where swap files go (default: a fresh temporary directory, removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
dir="${HETERO_NVME_DIR:-}"
if [ -z "$dir" ]; then
  dir=$(mktemp -d -p "${TMPDIR:-/var/tmp}" hetero-quickstart.XXXXXX)
  trap 'rm -rf "$dir"' EXIT
fi
# The main job until the ZeRO engine lands: the NVMe tier against the raw disk, on an embedded default size.
.venv/bin/python benchmarks/nvme_bandwidth.py --dir "$dir" --size 1GiB
