#!/usr/bin/env bash
# Compile the NVSHMEM extension odc_runtime._C for sm_80 and sm_90 against the nvidia-nvshmem-cu13 wheel and
# import it (no GPU needed). Idempotent: installs missing build inputs once, then CMake rebuilds incrementally
# in build/ext-<python tag> (a no-op when nothing changed). Run from anywhere; uses the current `python`.
#   env: ODC_CUDA_ARCHS (default "80;90"), ODC_NVSHMEM_WHEEL (default nvidia-nvshmem-cu13), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export ODC_CUDA_ARCHS="${ODC_CUDA_ARCHS:-80;90}"
WHEEL="${ODC_NVSHMEM_WHEEL:-nvidia-nvshmem-cu13}"
start=$(date +%s)

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "build_ext.sh: nvcc not found (install the CUDA toolkit or set CUDA_HOME)" >&2
  exit 1
fi
missing=()
"$PY" -c "import pybind11" 2>/dev/null || missing+=("pybind11>=2.12")
"$PY" - <<'PYEOF' 2>/dev/null || missing+=("$WHEEL")
import importlib.util, os, sys
spec = importlib.util.find_spec("nvidia.nvshmem")
ok = spec and any(os.path.isfile(os.path.join(d, "include", "nvshmem.h")) for d in spec.submodule_search_locations)
sys.exit(0 if ok or os.environ.get("NVSHMEM_HOME") else 1)
PYEOF
if ! cmake --version 2>/dev/null | grep -qE 'version (3\.(2[4-9]|[3-9][0-9])|[4-9]\.)'; then
  missing+=("cmake>=3.24")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "build_ext.sh: installing ${missing[*]}"
  "$PY" -m pip install -q "${missing[@]}"
fi

# setup.py's build_ext drives CMake; ODC_BUILD_EXT=1 turns any failure into an error.
ODC_BUILD_EXT=1 "$PY" setup.py -q build_ext --inplace

"$PY" - <<'PYEOF'
from odc_runtime.transport.nvshmem import load_extension
C = load_extension()
print(f"build_ext.sh: imported {C.__file__} (CUDA devices visible: {C.device_count()})")
PYEOF
echo "build_ext.sh: done in $(( $(date +%s) - start ))s (archs ${ODC_CUDA_ARCHS})"
