#!/usr/bin/env bash
# Build and check the release artefacts of odc_runtime; nothing is uploaded (RELEASING.md has the whole procedure).
#
#   bash .ci/release.sh [OUT]      # default: dist/
#
# 1. refuses a tree with uncommitted changes: an artefact is a commit;
# 2. `python -m build` with ODC_BUILD_EXT=0: the sdist, then the pure wheel odc_runtime-<v>-py3-none-any.whl built
#    from the unpacked sdist (so a file missing from the sdist breaks the wheel here, not on a user's machine);
# 3. the wheel is pure: tagged py3-none-any, no compiled file (its version is odc_runtime.__version__, the dynamic
#    version of pyproject.toml);
# 4. `twine check` on every artefact (metadata and the README as the long description render).
# build and twine live in a cached venv, ${ODC_RELEASE_CACHE:-$HOME/.cache/odc-release}. The NVSHMEM extension
# wheels (one per CUDA major and CPython) are built after this, by the commands of RELEASING.md's step 4.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
venv=${ODC_RELEASE_CACHE:-$HOME/.cache/odc-release}
if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
  echo "release: the tree has uncommitted changes; commit them first" >&2
  exit 1
fi
if ! "$venv/bin/python" -c "import build, twine" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip build twine
fi
rm -rf "$out"
ODC_BUILD_EXT=0 "$venv/bin/python" -m build --outdir "$out" .
wheels=("$out"/odc_runtime-*-py3-none-any.whl)
sdists=("$out"/odc_runtime-*.tar.gz)
if [[ ${#wheels[@]} != 1 || ! -f ${wheels[0]} || ${#sdists[@]} != 1 || ! -f ${sdists[0]} ]]; then
  echo "release: expected one pure wheel and one sdist; got: $(ls "$out")" >&2
  exit 1
fi
wheel=${wheels[0]}
if "$venv/bin/python" -m zipfile -l "$wheel" | grep -E '\.(so|pyd|dll)\b'; then
  echo "release: the pure wheel holds compiled files (above)" >&2
  exit 1
fi
"$venv/bin/python" -m twine check --strict "$out"/*
echo "release: $(ls "$out" | tr '\n' ' ')in $out (git $(git rev-parse --short HEAD)); nothing uploaded"
