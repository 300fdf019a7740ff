#!/usr/bin/env bash
# Compile odc_runtime._C against other NVSHMEM releases than the installed one and import each build in a fresh
# process with that release's libnvshmem_host.so.3 (no GPU needed), to keep every supported NVSHMEM building.
#   .ci/build_ext_matrix.sh [FLAVOR==VERSION ...]      default: cu13==3.4.5 (what torch 2.11-2.14 pin)
# Each wheel is downloaded once (pip download, build/nvshmem/wheels) and unpacked to build/nvshmem/<flavor>-<ver>;
# each build has its own CMake tree (build/ext-<python tag>-nvshmem<ver>, incremental) and output directory
# (build/ext-matrix/<flavor>-<ver>), so the in-place odc_runtime/_C used by the tests is left alone.
#   env: ODC_CUDA_ARCHS (default "80-real;90-real": sm_80 compiles the scalar-atomics push path and sm_90 the
#        vector one, i.e. every arch-dependent branch of csrc/; API differences between NVSHMEM releases show in
#        any one arch, so the full default set is built only by .ci/build_ext.sh), ODC_BUILD_JOBS, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
ARCHS="${ODC_CUDA_ARCHS:-80-real;90-real}"
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=("cu13==3.4.5")
"$PY" -c "import pybind11" 2>/dev/null || "$PY" -m pip install -q "pybind11>=2.12"

for spec in "${specs[@]}"; do
  start=$(date +%s)
  flavor="${spec%%==*}"; ver="${spec##*==}"
  [[ "$flavor" =~ ^cu1[0-9]$ && "$ver" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "bad spec $spec (want cu13==3.4.5)" >&2; exit 2; }
  home="$PWD/build/nvshmem/$flavor-$ver/nvidia/nvshmem"
  if [ ! -f "$home/include/nvshmem.h" ]; then
    "$PY" -m pip download -q --no-deps -d build/nvshmem/wheels "nvidia-nvshmem-$flavor==$ver"
    "$PY" - "$flavor" "$ver" <<'PYEOF'
import glob, sys, zipfile
flavor, ver = sys.argv[1:]
whl, = glob.glob(f"build/nvshmem/wheels/nvidia_nvshmem_{flavor}-{ver}-*.whl")
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.filename.startswith("nvidia/nvshmem/"):
            z.extract(info, f"build/nvshmem/{flavor}-{ver}")
PYEOF
  fi
  out="build/ext-matrix/$flavor-$ver"
  NVSHMEM_HOME="$home" ODC_BUILD_EXT=1 ODC_CUDA_ARCHS="$ARCHS" \
    "$PY" setup.py -q build_ext --build-lib "$out" --build-temp "$out/tmp"
  so=$(ls "$out"/odc_runtime/_C*.so)
  # Import in a process without torch (a CUDA torch would load its own NVSHMEM first).
  NVSHMEM_HOME="$home" "$PY" - "$so" "$ver" <<'PYEOF'
import ctypes, importlib.util, os, sys
so, want = sys.argv[1], tuple(int(x) for x in sys.argv[2].split("."))
spec = importlib.util.spec_from_file_location("loc", "odc_runtime/_nvshmem_locate.py")
loc = importlib.util.module_from_spec(spec); spec.loader.exec_module(loc)
ctypes.CDLL(loc.host_libraries(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))[0], mode=ctypes.RTLD_GLOBAL)
spec = importlib.util.spec_from_file_location("odc_runtime._C", so)
C = importlib.util.module_from_spec(spec); spec.loader.exec_module(C)
built, running = tuple(C.nvshmem_version_compiled()), tuple(C.nvshmem_version_runtime())
assert built == running == want, (built, running, want)
assert "torch" not in sys.modules
print(f"build_ext_matrix.sh: {so}: NVSHMEM {built} compiled == loaded, {C.device_count()} CUDA devices")
PYEOF
  "$PY" .ci/build_check_archs.py "$so" "$ARCHS"
  echo "build_ext_matrix.sh: $spec done in $(( $(date +%s) - start ))s (archs $ARCHS)"
done
