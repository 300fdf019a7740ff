#!/usr/bin/env bash
# Compile the NVSHMEM extension odc_runtime._C in place against the NVSHMEM installed in this environment (the
# nvidia-nvshmem wheel, or NVSHMEM_HOME), import it, compare its compile-time and run-time NVSHMEM versions and
# check that the loadable fatbin holds machine code for every requested architecture (no GPU needed).
# Idempotent: installs missing build inputs once, then CMake rebuilds incrementally in
# build/ext-<python tag>-nvshmem<version> (a no-op when nothing changed). Run from anywhere; uses `python`.
#   env: ODC_CUDA_ARCHS (default: CMakeLists.txt's 80-real;90-real;100-real;120-real), ODC_BUILD_JOBS,
#        ODC_NVSHMEM_WHEEL (installed when the environment has no NVSHMEM; default: the version torch pins,
#        else nvidia-nvshmem-cu13), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
start=$(date +%s)

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && [ -z "${CUDACXX:-}" ]; then
  echo "build_ext.sh: nvcc not found (install the CUDA toolkit or set CUDA_HOME)" >&2
  exit 1
fi
# The wheel to install if the environment has none: what the installed torch pins, else the newest cu13.
WHEEL="${ODC_NVSHMEM_WHEEL:-$("$PY" -c '
import importlib.util
spec = importlib.util.spec_from_file_location("loc", "odc_runtime/_nvshmem_locate.py")
loc = importlib.util.module_from_spec(spec); spec.loader.exec_module(loc)
pin = loc.torch_nvshmem_pin()
print(f"nvidia-nvshmem-{pin[0]}=={pin[1]}" if pin else "nvidia-nvshmem-cu13>=3.3,<4")
')}"
missing=()
"$PY" -c "import pybind11" 2>/dev/null || missing+=("pybind11>=2.12")
"$PY" - <<'PYEOF' 2>/dev/null || missing+=("$WHEEL")
import importlib.util, sys
spec = importlib.util.spec_from_file_location("loc", "odc_runtime/_nvshmem_locate.py")
loc = importlib.util.module_from_spec(spec); spec.loader.exec_module(loc)
sys.exit(0 if loc.nvshmem_homes() else 1)
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
import subprocess, sys
from odc_runtime.transport.nvshmem import check_version, load_extension
C = load_extension()
v = check_version(C)  # raises unless the loaded libnvshmem_host.so.3 is the release _C was compiled against
print(f"build_ext.sh: imported {C.__file__} (NVSHMEM {'.'.join(map(str, v))}, CUDA devices visible: {C.device_count()})")
sys.exit(subprocess.call([sys.executable, ".ci/build_check_archs.py", C.__file__]))
PYEOF
echo "build_ext.sh: done in $(( $(date +%s) - start ))s (archs ${ODC_CUDA_ARCHS:-default})"
