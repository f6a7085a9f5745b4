#!/usr/bin/env bash
# Create /work/main/.venv-trl (TRL's own venv for benchmarks/trainer_vs_trl.py) if it is missing.
#
# TRL pins its own transformers/accelerate, so it lives apart from our .venv. torch is installed first at the same
# version as ours (the machine's pip configuration serves the local 2.13.0 CPU wheel), so both sides of the comparison
# run the same kernels. Idempotent: an existing venv that imports trl is left as it is.
# Usage: benchmarks/trl_venv.sh [VENV_DIR]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-trl}"
torch_version="${TORCH_VERSION:-2.13.0}"

if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import trl" 2>/dev/null; then
    echo "$venv: trl $("$venv/bin/python" -c 'import trl; print(trl.__version__)') already installed"
    exit 0
fi

python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "torch==$torch_version"
"$venv/bin/pip" install --quiet trl
"$venv/bin/python" -c "import torch, transformers, trl; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| trl', trl.__version__)"
