// Shared by the .cu files of odc_runtime._C: status checks (CUDA and NVSHMEM errors become odc::Error, never
// exit()), pointer/stream casts, the task descriptors the launchers pass to the kernels, and the device helpers
// every protocol uses: the one abort-poll spin that every wait for another PE goes through, and the byte copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "odc_ext.h"

namespace odc {

#define ODC_CUDA_CHECK(expr)                                                                     \
    do {                                                                                         \
        cudaError_t err__ = (expr);                                                              \
        if (err__ != cudaSuccess) {                                                              \
            std::ostringstream os__;                                                             \
            os__ << #expr << " failed: " << cudaGetErrorName(err__) << " (" << cudaGetErrorString(err__) \
                 << ") at " << __FILE__ << ":" << __LINE__;                                      \
            throw Error(os__.str());                                                             \
        }                                                                                        \
    } while (0)

#define ODC_NVSHMEM_CHECK(expr)                                                                  \
    do {                                                                                         \
        int st__ = (expr);                                                                       \
        if (st__ != 0) {                                                                         \
            std::ostringstream os__;                                                             \
            os__ << #expr << " failed with NVSHMEM status " << st__ << " at " << __FILE__ << ":"  \
                 << __LINE__;                                                                    \
            throw Error(os__.str());                                                             \
        }                                                                                        \
    } while (0)

// After a kernel launch: surface launch errors (and sticky errors of earlier asynchronous work).
void check_launch(const char* what);
// Every host entry point after init starts here (runtime.cu owns the "initialised" state).
void require_init(const char* what);

inline cudaStream_t as_stream(uint64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }
template <typename T>
inline T* as_ptr(uint64_t p) { return reinterpret_cast<T*>(static_cast<uintptr_t>(p)); }

constexpr int kMaxTasks = 64;  // requests per launch
constexpr int kThreads = 256;  // threads per block of the data kernels

// Peer-pointer tasks (one NVLink domain): plain loads/stores or GPU atomics through peer pointers.
struct Task {
    uint64_t dst;
    uint64_t src;
    uint64_t n;  // bytes (copy) or elements (push)
};
struct TaskBatch {
    int ntasks;
    int parts;  // blocks per task
    Task t[kMaxTasks];
};

// Cell tasks (NVSHMEM network operations, cut into cells of `cell_bytes`): `offset` is the *symmetric offset* of
// the peer's region in the heap arena, the same number on every PE; the kernels form NVSHMEM's symmetric address
// as heap_base (this PE's arena) + offset, and derive anything shared between PEs (cells, locks) from the offset
// alone, never from an address: every PE reserves its own virtual range for the heap, so bases differ.
struct CellTask {
    uint64_t offset;  // symmetric offset at the peer (accumulator / parameter / inbox region)
    uint64_t local;   // ordinary device memory of the caller (source / destination)
    uint64_t n;       // elements (push: of the owner's fp32 or int64 accumulator) or bytes (fetch, put)
    uint64_t first;   // index of the task's first item
    int pe;
};
struct CellBatch {
    int ntasks;
    uint64_t total;   // items
    uint64_t rotate;  // block 0 starts at this item, so PEs start on different cells
    CellTask t[kMaxTasks];
};

#ifdef __CUDACC__
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

__device__ __forceinline__ bool abort_raised(const volatile uint32_t* abort) { return *abort != 0; }

// The one wait loop of every protocol (barrier, cell locks, signal waits): spin with exponential back-off up to
// `max_ns` until `ready()` holds; return false, without waiting further, once the host raised the abort word
// (host-mapped memory, so a running kernel sees it). One thread per call.
template <typename Ready>
__device__ __forceinline__ bool wait_or_abort(Ready ready, const volatile uint32_t* abort, unsigned max_ns) {
    unsigned ns = 32;
    while (!ready()) {
        if (abort_raised(abort)) return false;
        __nanosleep(ns);
        ns = min(ns * 2, max_ns);
    }
    return true;
}

__device__ __forceinline__ int find_task(const CellBatch& b, uint64_t item) {
    int ti = 0;
    while (ti + 1 < b.ntasks && b.t[ti + 1].first <= item) ++ti;
    return ti;
}

// Copy n bytes with the threads first, first + stride, ...: the widest word both ends allow. 16-byte words when
// dst and src are congruent modulo 16 (a head of up to 15 bytes first), else 4-byte words when both are 4-byte
// aligned (fp32 at any element offset), else 2-byte words when both are 2-byte aligned (bf16/fp16 rows at odd
// element offsets, common in the hierarchical protocol's rows), else bytes.
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, uint64_t n, uint64_t first, uint64_t stride) {
    const uint64_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    uint64_t head = 0, words = 0;
    if ((d - s) % 16 == 0) {
        head = min(n, (16 - d % 16) % 16);
        words = (n - head) / 16;
        const int4* s4 = reinterpret_cast<const int4*>(src + head);
        int4* d4 = reinterpret_cast<int4*>(dst + head);
        for (uint64_t i = first; i < words; i += stride) d4[i] = s4[i];
        words *= 16;
    } else if ((d | s) % 4 == 0) {
        words = n / 4;
        for (uint64_t i = first; i < words; i += stride)
            reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
        words *= 4;
    } else if ((d | s) % 2 == 0) {
        words = n / 2;
        for (uint64_t i = first; i < words; i += stride)
            reinterpret_cast<uint16_t*>(dst)[i] = reinterpret_cast<const uint16_t*>(src)[i];
        words *= 2;
    }
    for (uint64_t i = first; i < head; i += stride) dst[i] = src[i];
    for (uint64_t i = head + words + first; i < n; i += stride) dst[i] = src[i];
}
#endif

}  // namespace odc
