// NVSHMEM version compatibility for odc_runtime._C: one source tree for every NVSHMEM from 3.3 through 3.8
// (cu12 and cu13 wheels). Internal (nvshmemi_*) device symbols are used only here, each one guarded by the
// NVSHMEM_VENDOR_*_VERSION macros of the headers the extension is compiled against.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#define ODC_NVSHMEM_VERSION_CODE(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))
#define ODC_NVSHMEM_VERSION                                                                      \
    ODC_NVSHMEM_VERSION_CODE(NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,        \
                             NVSHMEM_VENDOR_PATCH_VERSION)

#if ODC_NVSHMEM_VERSION < ODC_NVSHMEM_VERSION_CODE(3, 3, 0)
#error "odc_runtime._C needs NVSHMEM 3.3 or newer (pip install nvidia-nvshmem-cu13, or -cu12)"
#endif

namespace odc {
namespace compat {

#ifdef __CUDA_ARCH__
// Whether NVSHMEM decided, job-wide at init, that every PE reaches every other PE with load/store atomics.
// NVSHMEM has no public API for this decision. From 3.7.2 its headers expose the predicate
// nvshmemi_use_ldst_atomics_path(); older releases (3.3.x-3.6.x, e.g. 3.4.5 which torch 2.11-2.14 pin) do not
// have it, and their own AMO paths test the device state directly. 3.7.2's predicate is exactly
// `nvshmemi_device_state_d.job_connectivity <= NVSHMEMI_JOB_GPU_LDST_ATOMICS`, and both the field and the
// enum value exist in every release from 3.3, so below 3.7.2 the same expression is evaluated here.
__device__ inline bool ldst_atomics_path() {
#if ODC_NVSHMEM_VERSION >= ODC_NVSHMEM_VERSION_CODE(3, 7, 2)
    return nvshmemi_use_ldst_atomics_path();
#else
    return nvshmemi_device_state_d.job_connectivity <= NVSHMEMI_JOB_GPU_LDST_ATOMICS;
#endif
}
#endif

}  // namespace compat
}  // namespace odc
