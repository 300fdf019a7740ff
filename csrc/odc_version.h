// NVSHMEM versions seen by odc_runtime._C: the headers/static device library it was compiled against, and the
// libnvshmem_host.so.3 that is actually loaded in this process (torch CUDA builds load their own copy first).
// The two must match (odc_runtime.transport.nvshmem.check_version compares them before init).
#pragma once

#include <tuple>

namespace odc {

std::tuple<int, int, int> nvshmem_version_compiled();  // NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION
std::tuple<int, int, int> nvshmem_version_runtime();   // nvshmemx_vendor_get_version_info(); no init needed

}  // namespace odc
