#!/usr/bin/env bash
# Compatibility run: the FSDP2 integration, both examples and a short bench/comm.py on the oldest and the newest
# supported torch (the main CI run covers the torch pinned in .ci/run). CPU only: gloo + the host transport.
#
#   bash .ci/compat.sh                       # torch 2.9.1 and 2.15.0
#   ODC_COMPAT_TORCH="2.11.0 2.14.1" bash .ci/compat.sh
#   bash .ci/compat.sh --prepare             # only create the cached venvs (.ci/run does this in the background)
#
# This machine's pip caps torch at 2.14.1 (a `constraint` file in /etc/xdg/pip/pip.conf). The torch install below
# lifts it for that one command with PIP_CONSTRAINT=/dev/null (an environment variable overrides the config file's
# value; the other settings, e.g. /etc/pip.conf's `cert`, still apply). Elsewhere it changes nothing.
#
# Each torch gets its own virtual environment under ${ODC_COMPAT_CACHE:-$HOME/.cache/odc-compat}/torch-X.Y.Z,
# created on the first run and reused while its torch imports with the expected version (the PyPI wheels are CUDA
# builds of several GB with their nvidia-* dependencies; they run on the CPU). odc_runtime is installed into it
# from this checkout (editable, without the extension) on every run, so the venv always tests this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
cache=${ODC_COMPAT_CACHE:-$HOME/.cache/odc-compat}
versions=${ODC_COMPAT_TORCH:-"2.9.1 2.15.0"}
prepare=0
[[ ${1:-} == --prepare ]] && prepare=1
mkdir -p "$cache"

for v in $versions; do
  t0=$(date +%s)
  venv="$cache/torch-$v"
  if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    echo "compat: creating $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$v"
  fi
  if (( prepare )); then echo "compat: torch $v venv ready in $(( $(date +%s) - t0 ))s"; continue; fi
  ODC_BUILD_EXT=0 "$venv/bin/python" -m pip install -q -e ".[test]"
  "$venv/bin/python" -c "import torch, odc_runtime.fsdp; print('compat: torch', torch.__version__, 'ready')"
  echo "compat: torch $v installed in $(( $(date +%s) - t0 ))s"

  # FSDP2 in ODC mode (incl. the per-version check of the FSDP2 internals odc_runtime.fsdp._compat reads) and
  # both examples (examples/sft.py: same losses in collective and ODC mode).
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_fsdp.py tests/test_hsdp.py tests/test_examples.py
  # The SymmetricMemory wrapper's detection against this torch's private module (seconds; the multi-rank tests of
  # that file run in the main CI run).
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_symm_torch.py -k "not create"
  # The collective rows use all_gather_into_tensor / reduce_scatter_tensor (present in every supported torch).
  "$venv/bin/python" bench/comm.py --sizes 1M --nproc 2 --repeats 3 --warmup 1 --plot none \
    --json "$cache/comm-$v.json"
  echo "compat: torch $v done in $(( $(date +%s) - t0 ))s"
done
echo "compat: done in $(( $(date +%s) - start ))s"
