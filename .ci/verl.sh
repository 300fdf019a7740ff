#!/usr/bin/env bash
# The real-veRL test: tests/test_verl_real.py (veRL's own actor worker, stock vs ODC, 2 gloo ranks on the CPU) and
# tests/test_integrations_verl.py, in a virtual environment holding veRL next to the CPU torch of .ci/run.
#
#   bash .ci/verl.sh                                   # veRL 0.9.1, torch 2.13.0
#   ODC_VERL_VERSION=0.9.0 bash .ci/verl.sh            # another 0.9.x
#   bash .ci/verl.sh --prepare                         # only create the cached venv (.ci/run: in the background)
#
# The venv lives under ${ODC_VERL_CACHE:-$HOME/.cache/odc-verl}/verl-V-torch-T, created on the first run (about
# 2 GB: ray, transformers, hydra, pyarrow, ...; 13 min here on a loaded 2-core VM) and reused while veRL and torch
# import with the expected versions. torch is installed first from the CPU wheel, so veRL's `torch` requirement is
# already met and pip pulls no CUDA build (checked below). veRL 0.9.1 imports uvicorn and fastapi without
# declaring them; they are added. odc_runtime is installed from this checkout (editable, no extension) every run.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
verl_version=${ODC_VERL_VERSION:-0.9.1}
torch_version=2.13.0
venv="${ODC_VERL_CACHE:-$HOME/.cache/odc-verl}/verl-$verl_version-torch-$torch_version"
check="import sys, torch, verl; sys.exit(torch.__version__.split('+')[0] != '$torch_version' or verl.__version__ != '$verl_version' or torch.version.cuda is not None)"

if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "verl: creating $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_version"
  "$venv/bin/python" -m pip install -q "verl==$verl_version" uvicorn fastapi "torch==$torch_version"
  "$venv/bin/python" -c "$check" || { echo "verl: torch was replaced (a CUDA build?) or veRL is not $verl_version"; exit 1; }
fi
if [[ ${1:-} == --prepare ]]; then echo "verl: venv ready in $(( $(date +%s) - start ))s"; exit 0; fi
ODC_BUILD_EXT=0 "$venv/bin/python" -m pip install -q -e ".[test]"
"$venv/bin/python" -c "import torch, verl; print('verl: veRL', verl.__version__, 'torch', torch.__version__, 'ready')"
echo "verl: installed in $(( $(date +%s) - start ))s"

ODC_REQUIRE_VERL=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_verl_real.py \
  tests/test_integrations_verl.py
echo "verl: done in $(( $(date +%s) - start ))s"
