#!/usr/bin/env bash
# Triton matrix: every kernel compiled and its ordering checked under each Triton a supported torch pins (the
# table in docs/fsdp.md, "The Triton each torch pins"), with no GPU. Per line:
#   - tests/test_ptx.py: the PTX ordering check of every kernel for sm_80/90/100 (those the line can target), the
#     mutation check, and every kernel compiled the way its launcher calls it (odc_runtime.kernels.launch_check:
#     Triton's own argument specialization, a fake driver whose launch does nothing); tests/test_launch.py: the
#     cached launch path (kernels/launch.py) against this line's runner, or its fallback to Triton's own path;
#   - on the oldest and the newest line, also the kernels under the Triton interpreter: tests/test_kernels.py and a
#     short symm-cpu subset (fetch/push/barrier, put_signal/wait, the quantising push).
#
#   bash .ci/triton.sh                       # every line (run in the CI venv: `source .venv/bin/activate`)
#   bash .ci/triton.sh --skip-own            # not the line this venv has installed (.ci/run: its own test run has it)
#   bash .ci/triton.sh --prepare             # only install the missing lines (.ci/run does this in the background)
#   ODC_TRITON_LINES="3.6.0" bash .ci/triton.sh
#
# Each line is one `pip install --no-deps --target` of its wheel (no other dependency; about 10 s and 650 MB) under
# ${ODC_TRITON_CACHE:-$HOME/.cache/odc-triton}/X, reused while it imports as X, and put in front of this venv's
# site-packages with PYTHONPATH (child processes of the tests inherit it). A line that cannot be installed fails.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# torch 2.9.0 pins 3.5.0 and 2.9.1 3.5.1; 2.10-2.11 3.6.0; 2.12.0 3.7.0, 2.12.1-2.13.0 3.7.1; 2.14.1 3.8; 2.15.0 3.9.
lines=${ODC_TRITON_LINES:-"3.5.1 3.6.0 3.7.1 3.8.0 3.9.0"}
cache=${ODC_TRITON_CACHE:-$HOME/.cache/odc-triton}
prepare=0 skip_own=0
for arg in "$@"; do
  case $arg in
    --prepare) prepare=1 ;;
    --skip-own) skip_own=1 ;;
    *) echo "triton: unknown argument $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$cache"
own=$(python -c "import triton; print(triton.__version__)" 2>/dev/null || echo none)

version_at() {  # the triton version importable with PYTHONPATH=$1 (empty: the venv's own)
  PYTHONPATH=$1 python -c "import triton; print(triton.__version__)" 2>/dev/null || echo none
}

overlay_for() {  # prints the PYTHONPATH entry that gives triton $1 (empty: the venv's own), installing it if missing
  local v=$1 dir="$cache/$1"
  if [[ $v == "$own" ]]; then return; fi
  if [[ $(version_at "$dir") != "$v" ]]; then
    echo "triton: installing $v into $dir" >&2
    rm -rf "$dir" "$dir.partial"
    if ! python -m pip install -q --no-deps --target "$dir.partial" "triton==$v" >&2; then
      echo "triton: FAILED to install triton $v; every line of the matrix must be checked (.ci/triton.sh)" >&2
      return 1
    fi
    mv "$dir.partial" "$dir"
    [[ $(version_at "$dir") == "$v" ]] || { echo "triton: $dir does not import as triton $v" >&2; return 1; }
  fi
  echo "$dir"
}

read -r -a all <<<"$lines"
oldest=${all[0]} newest=${all[${#all[@]}-1]}
for v in "${all[@]}"; do
  t0=$(date +%s)
  overlay=$(overlay_for "$v")
  if (( prepare )); then echo "triton: $v ready in $(( $(date +%s) - t0 ))s"; continue; fi
  if (( skip_own )) && [[ $v == "$own" ]]; then
    echo "triton: $v is this venv's own: the main test run checks it"; continue
  fi
  export PYTHONPATH=$overlay
  got=$(version_at "$overlay")
  [[ $got == "$v" ]] || { echo "triton: expected $v, imported $got" >&2; exit 1; }
  echo "triton: $v (${overlay:-this venv})"
  python -m pytest -q -p no:cacheprovider tests/test_ptx.py tests/test_launch.py
  if [[ $v == "$oldest" || $v == "$newest" ]]; then
    python -m pytest -q -p no:cacheprovider tests/test_kernels.py
    python -m pytest -q -p no:cacheprovider tests/test_symm_cpu.py \
      -k "fetch_push_sync_all_dtypes or put_signal or deterministic_precision"
  fi
  unset PYTHONPATH
  echo "triton: $v done in $(( $(date +%s) - t0 ))s"
done
echo "triton: done in $(( $(date +%s) - start ))s"
