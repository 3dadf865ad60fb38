#!/usr/bin/env bash
# Sets up a virtual environment in .venv, installs hetero with its extras, and runs the main job.
#   TORCH_SPEC   what pip installs PyTorch from (default torch==2.13.0; on machines of this project that resolves
#                to the CPU build). Set it to the build you want, pip's options included, e.g. PyTorch's selector's
#                TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" (or .../whl/cu126).
# Extra arguments go to examples/train_gpt.py (e.g. --steps 50, --zero-stage 2, --nvme-dir /mnt/nvme).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Split into words: a spec with an --index-url was one argument before, which pip refused as a requirement.
read -r -a torch_spec <<< "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q "${torch_spec[@]}"
.venv/bin/python -m pip install -q -e ".[dev]"
# The main job: a small GPT trained on the shipped corpus with ZeRO-3 and optimizer states on NVMe (a temporary
# directory unless --nvme-dir is given), with a progress bar and a closing table of memory per tier.
.venv/bin/python examples/train_gpt.py "$@"
