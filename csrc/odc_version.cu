// See odc_version.h. Host code only; compiled by nvcc because NVSHMEM's headers need it.
#include "odc_version.h"

#include "odc_compat.cuh"

namespace odc {

std::tuple<int, int, int> nvshmem_version_compiled() {
    return {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

std::tuple<int, int, int> nvshmem_version_runtime() {
    int major = 0, minor = 0, patch = 0;
    // Answered by the loaded libnvshmem_host.so.3 from its own build constants; valid before nvshmem init.
    nvshmemx_vendor_get_version_info(&major, &minor, &patch);
    return {major, minor, patch};
}

}  // namespace odc
