// NVSHMEM host wrappers and the device kernels of odc_runtime._C.
//
// Conventions: every CUDA / NVSHMEM status is checked and turned into odc::Error (a Python exception via
// bindings.cpp); nothing here calls exit(). Pointers and streams arrive as uint64_t. Kernels are kept small:
// one fetch kernel (peer pointers), one atomic push kernel (peer pointers) and one locked push kernel
// (NVSHMEM RMA, for peers without a peer pointer, i.e. across nodes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "odc_compat.cuh"
#include "odc_ext.h"

namespace odc {
namespace {

bool g_initialized = false;
int g_sm_count = 0;

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

// After a kernel launch or a void NVSHMEM on-stream call: surface launch errors.
void check_launch(const char* what) {
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        throw Error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
    }
}

void require_init(const char* what) {
    if (!g_initialized) throw Error(std::string(what) + ": NVSHMEM is not initialised (call init first)");
}

inline cudaStream_t as_stream(uint64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }
template <typename T>
inline T* as_ptr(uint64_t p) { return reinterpret_cast<T*>(static_cast<uintptr_t>(p)); }

// ---------------------------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// Load 4 consecutive elements (caller guarantees 4*sizeof(T) alignment) and convert them to fp32.
template <typename T>
__device__ __forceinline__ float4 load4(const T* p);
template <>
__device__ __forceinline__ float4 load4<float>(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <>
__device__ __forceinline__ float4 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
    const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(p);
    float2 a = __bfloat1622float2(q[0]), b = __bfloat1622float2(q[1]);
    return make_float4(a.x, a.y, b.x, b.y);
}
template <>
__device__ __forceinline__ float4 load4<__half>(const __half* p) {
    const __half2* q = reinterpret_cast<const __half2*>(p);
    float2 a = __half22float2(q[0]), b = __half22float2(q[1]);
    return make_float4(a.x, a.y, b.x, b.y);
}

// 4-wide fp32 add (result unused) at a (possibly peer) global address aligned to 16 bytes. System scope:
// several GPUs update the same words, and device-scope atomics are only atomic among one GPU's threads.
// sm_90 has a native vector atomic (atom.global.sys.add.v4.f32); older GPUs do 4 scalar atomics.
__device__ __forceinline__ void red_add4(float* p, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd_system(reinterpret_cast<float4*>(p), v);
#else
    atomicAdd_system(p + 0, v.x);
    atomicAdd_system(p + 1, v.y);
    atomicAdd_system(p + 2, v.z);
    atomicAdd_system(p + 3, v.w);
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Peer-pointer tasks (intra-node): one launch handles up to kMaxTasks requests. Block b works on task
// b % ntasks, so consecutive blocks hit different peers (the caller already rotates the peer order), and
// on part b / ntasks of it: the task is cut into `parts` interleaved slices of kVec-element granules.
// ---------------------------------------------------------------------------------------------------------
constexpr int kMaxTasks = 64;
constexpr int kThreads = 256;

struct Task {
    uint64_t dst;
    uint64_t src;
    uint64_t n;  // bytes (fetch) or elements (accumulate)
};
struct TaskBatch {
    int ntasks;
    int parts;
    Task t[kMaxTasks];
};

// Fetch: plain loads from the owner's memory through the peer pointer, plain stores into local memory.
// Ordering: this kernel only reads the owner's region. The owner's writes to it (optimizer step) happen
// before the owner's barrier; our fetch is issued after our barrier on the same stream, and
// nvshmemx_barrier_all_on_stream orders (fence.sys + flag) everything before it on every PE before
// everything after it, so we read the post-step values. No ordering among concurrent fetches is needed.
__global__ void fetch_p2p_kernel(TaskBatch b) {
    const int ti = blockIdx.x % b.ntasks;
    const int part = blockIdx.x / b.ntasks;
    const Task t = b.t[ti];
    char* dst = reinterpret_cast<char*>(t.dst);
    const char* src = reinterpret_cast<const char*>(t.src);
    const uint64_t stride = static_cast<uint64_t>(b.parts) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x;
    if ((t.dst % 16 == 0) && (t.src % 16 == 0)) {
        const uint64_t nv = t.n / 16;
        const int4* s4 = reinterpret_cast<const int4*>(src);
        int4* d4 = reinterpret_cast<int4*>(dst);
        for (uint64_t i = first; i < nv; i += stride) d4[i] = s4[i];
        for (uint64_t i = nv * 16 + first; i < t.n; i += stride) dst[i] = src[i];
    } else {
        for (uint64_t i = first; i < t.n; i += stride) dst[i] = src[i];
    }
}

// Push (intra-node): dst (the owner's fp32 accumulator, through the peer pointer) += float(src) * scale.
// Exactness under concurrency: every update is a single system-scope hardware atomic performed at the owner's
// memory (NVLink/PCIe P2P atomics), so concurrent pushers from any number of PEs never lose an update; fp32
// addition order may differ between runs (non-deterministic rounding, as with any atomic reduction).
// Ordering: the reductions are complete once this kernel has completed; the pusher's later
// nvshmemx_quiet_on_stream / barrier_all_on_stream on the same stream run after the kernel and do a
// system-scope fence before signalling peers, so once the owner leaves the barrier all reductions issued
// before the pusher entered it are visible to the owner. The owner runs no code for this.
template <typename T>
__global__ void accumulate_p2p_kernel(TaskBatch b, float scale, bool vector_atomics) {
    const int ti = blockIdx.x % b.ntasks;
    const int part = blockIdx.x / b.ntasks;
    const Task t = b.t[ti];
    float* dst = reinterpret_cast<float*>(t.dst);
    const T* src = reinterpret_cast<const T*>(t.src);
    const uint64_t stride = static_cast<uint64_t>(b.parts) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x;
    uint64_t done = 0;
    if (vector_atomics && (t.dst % 16 == 0) && (t.src % (4 * sizeof(T)) == 0)) {
        const uint64_t nv = t.n / 4;
        for (uint64_t i = first; i < nv; i += stride) {
            float4 v = load4<T>(src + 4 * i);
            v.x *= scale; v.y *= scale; v.z *= scale; v.w *= scale;
            red_add4(dst + 4 * i, v);
        }
        done = nv * 4;
    }
    for (uint64_t i = done + first; i < t.n; i += stride) atomicAdd_system(dst + i, to_f32(src[i]) * scale);
}

// Push (inter-node): lock + get + add + put. The owner's address space is cut into fixed cells of
// `cell_bytes` (symmetric addresses are identical on every PE, so every pusher cuts the same way); cell c
// is guarded by the lock word locks[hash(c) % nlocks] in the OWNER's symmetric memory. A block handles one
// cell piece at a time with its own scratch slot (scratch is symmetric, as IB RMA requires):
//   1. thread 0 spins on compare_swap(lock, 0 -> 1) at the owner (with backoff);
//   2. blocking get of the piece into the slot (the value every earlier lock holder left, see 4);
//   3. slot += float(src) * scale;
//   4. blocking put back; nvshmem_quiet by every thread => the put is delivered at the owner;
//   5. thread 0 releases the lock with an atomic set 0 at the owner.
// Ordering: 4 happens-before 5 (quiet), 5 happens-before the next holder's 1, which precedes its 2: each
// holder reads the previous holder's result, so no update is lost. Pieces of different cells touch
// disjoint bytes. The pusher's later quiet/barrier on its stream completes everything.
// Deadlock freedom: a block holds at most one lock at a time and, while holding it, waits only for its
// own one-sided get/put/quiet, which complete without any code running on the owner or on other blocks;
// so every lock is released after a bounded amount of work and the spinning blocks eventually acquire it.
// Extra bytes on the wire: 2x the pushed bytes (get + put) plus two small AMOs per piece.
template <typename T>
__global__ void accumulate_locked_kernel(float* dst_sym, const T* src, uint64_t numel, float scale, int pe,
                                         float* scratch, uint64_t cell_bytes, int* locks, int nlocks) {
    float* slot = reinterpret_cast<float*>(reinterpret_cast<char*>(scratch) + blockIdx.x * cell_bytes);
    const uint64_t begin = reinterpret_cast<uintptr_t>(dst_sym);
    const uint64_t end = begin + numel * sizeof(float);
    const uint64_t first_cell = begin / cell_bytes, last_cell = (end - 1) / cell_bytes;
    for (uint64_t c = first_cell + blockIdx.x; c <= last_cell; c += gridDim.x) {
        const uint64_t lo = max(begin, c * cell_bytes), hi = min(end, (c + 1) * cell_bytes);
        const uint64_t e0 = (lo - begin) / sizeof(float), m = (hi - lo) / sizeof(float);
        float* remote = dst_sym + e0;
        int* lock = locks + static_cast<int>((c * 0x9E3779B97F4A7C15ull >> 17) % static_cast<uint64_t>(nlocks));
        if (threadIdx.x == 0) {
            unsigned ns = 64;
            while (nvshmem_int_atomic_compare_swap(lock, 0, 1, pe) != 0) {
                __nanosleep(ns);
                ns = min(ns * 2, 8192u);
            }
            // Acquire side of the lock: the CAS is a relaxed atomic; this fence (with the __syncthreads below)
            // orders the whole block's following get after it. It matters when the get is served by loads
            // through a peer pointer (same-node owner on the locked path), where the previous holder's
            // quiet (fence.sys) + release only pair with a fence on our side.
            __threadfence_system();
        }
        __syncthreads();
        nvshmemx_getmem_block(slot, remote, m * sizeof(float), pe);
        __syncthreads();
        for (uint64_t i = threadIdx.x; i < m; i += blockDim.x) slot[i] += to_f32(src[e0 + i]) * scale;
        __syncthreads();
        nvshmemx_putmem_block(remote, slot, m * sizeof(float), pe);
        nvshmem_quiet();
        __syncthreads();
        if (threadIdx.x == 0) nvshmem_int_atomic_set(lock, 0, pe);
        __syncthreads();  // the slot is reused for the next cell only after the release
    }
}

// NVSHMEM's own job-wide decision (allgathered over all PEs at init) whether every PE reaches every other by
// load/store *atomics* (NVLink, or PCIe P2P with native atomics). When it is false, NVSHMEM itself routes every
// AMO, even to same-node peers, through the network transport, because NIC atomics are only atomic with
// respect to other NIC atomics, not to GPU atomics on the same word.
// (The predicate lives in NVSHMEM's device headers, which are only visible in the device compilation pass;
// odc_compat.cuh picks the form that exists in the NVSHMEM version compiled against.)
__global__ void p2p_atomics_kernel(int* out) {
#ifdef __CUDA_ARCH__
    *out = compat::ldst_atomics_path() ? 1 : 0;
#endif
}

int sm_count() {
    if (g_sm_count == 0) {
        int dev = 0;
        ODC_CUDA_CHECK(cudaGetDevice(&dev));
        ODC_CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
    }
    return g_sm_count;
}

// Split `n` tasks into launches of at most kMaxTasks; `parts` per task so the grid is ~4 blocks per SM.
template <typename Launch>
void for_batches(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                 const std::vector<uint64_t>& n, uint64_t unit_per_block, Launch launch) {
    if (dst.size() != src.size() || dst.size() != n.size()) throw Error("task lists differ in length");
    const int target_blocks = 4 * sm_count();
    for (size_t base = 0; base < dst.size(); base += kMaxTasks) {
        TaskBatch b{};
        uint64_t max_n = 0;
        for (size_t i = base; i < std::min(dst.size(), base + kMaxTasks); ++i) {
            if (n[i] == 0) continue;
            b.t[b.ntasks++] = Task{dst[i], src[i], n[i]};
            max_n = std::max(max_n, n[i]);
        }
        if (b.ntasks == 0) continue;
        const uint64_t want = (max_n + unit_per_block - 1) / unit_per_block;
        const uint64_t cap = std::max<uint64_t>(1, target_blocks / b.ntasks);
        b.parts = static_cast<int>(std::max<uint64_t>(1, std::min(want, cap)));
        launch(b, b.ntasks * b.parts);
    }
}

}  // namespace

// -------------------------------------------------------------------------------------------------------
// Host API
// -------------------------------------------------------------------------------------------------------
int device_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device / no driver" error
        return 0;
    }
    return n;
}

std::string get_unique_id() {
    if (device_count() == 0) throw Error("get_unique_id: no CUDA device is visible");
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    ODC_NVSHMEM_CHECK(nvshmemx_get_uniqueid(&uid));
    return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

void init(const std::string& uid_bytes, int rank, int nranks, int device) {
    if (g_initialized) throw Error("init: NVSHMEM is already initialised in this process");
    // Validate everything we can before NVSHMEM sees it: some of its internal failures still exit().
    const int ndev = device_count();
    if (ndev == 0) throw Error("init: no CUDA device is visible (NVSHMEM needs one GPU per process)");
    if (device < 0 || device >= ndev)
        throw Error("init: device " + std::to_string(device) + " out of range (" + std::to_string(ndev) + " visible)");
    if (nranks < 1 || rank < 0 || rank >= nranks) throw Error("init: bad rank/nranks");
    if (uid_bytes.size() != sizeof(nvshmemx_uniqueid_t))
        throw Error("init: unique id has " + std::to_string(uid_bytes.size()) + " bytes, expected " +
                    std::to_string(sizeof(nvshmemx_uniqueid_t)));
    ODC_CUDA_CHECK(cudaSetDevice(device));
    ODC_CUDA_CHECK(cudaFree(nullptr));  // create / bind the primary context now, with a checked status
    nvshmemx_uniqueid_t uid;
    std::memcpy(&uid, uid_bytes.data(), sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    ODC_NVSHMEM_CHECK(nvshmemx_set_attr_uniqueid_args(rank, nranks, &uid, &attr));
    // nvshmemx_init_attr() is a static inline wrapper that exit()s on failure: call what it calls and throw.
    int provided = 0;
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    ODC_NVSHMEM_CHECK(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID,
                                           &attr, version));
    g_initialized = true;
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks) {
        throw Error("init: NVSHMEM PE numbering (" + std::to_string(nvshmem_my_pe()) + "/" +
                    std::to_string(nvshmem_n_pes()) + ") differs from the requested rank " +
                    std::to_string(rank) + "/" + std::to_string(nranks));
    }
}

bool initialized() { return g_initialized; }
int my_pe() { require_init("my_pe"); return nvshmem_my_pe(); }
int n_pes() { require_init("n_pes"); return nvshmem_n_pes(); }
int team_shared_n_pes() { require_init("team_shared_n_pes"); return nvshmem_team_n_pes(NVSHMEM_TEAM_SHARED); }

uint64_t malloc_(uint64_t bytes) {
    require_init("malloc");
    void* p = nvshmem_malloc(static_cast<size_t>(bytes));
    if (p == nullptr && bytes > 0) throw Error("nvshmem_malloc(" + std::to_string(bytes) + ") returned NULL");
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

void free_(uint64_t p) { require_init("free"); nvshmem_free(as_ptr<void>(p)); }

uint64_t ptr(uint64_t addr, int pe) {
    require_init("ptr");
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(nvshmem_ptr(as_ptr<void>(addr), pe)));
}

bool p2p_atomics() {
    require_init("p2p_atomics");
    int* d = nullptr;
    int h = 0;
    ODC_CUDA_CHECK(cudaMalloc(&d, sizeof(int)));
    p2p_atomics_kernel<<<1, 1>>>(d);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d);
    ODC_CUDA_CHECK(err);
    return h != 0;
}

void barrier_all() {
    require_init("barrier_all");
    nvshmem_barrier_all();
    ODC_CUDA_CHECK(cudaGetLastError());
}

void barrier_all_on_stream(uint64_t stream) {
    require_init("barrier_all_on_stream");
    nvshmemx_barrier_all_on_stream(as_stream(stream));
    check_launch("nvshmemx_barrier_all_on_stream");
}

void quiet_on_stream(uint64_t stream) {
    require_init("quiet_on_stream");
    nvshmemx_quiet_on_stream(as_stream(stream));
    check_launch("nvshmemx_quiet_on_stream");
}

void buffer_register(uint64_t addr, uint64_t bytes) {
    require_init("buffer_register");
    ODC_NVSHMEM_CHECK(nvshmemx_buffer_register(as_ptr<void>(addr), static_cast<size_t>(bytes)));
}

void buffer_unregister(uint64_t addr) {
    require_init("buffer_unregister");
    ODC_NVSHMEM_CHECK(nvshmemx_buffer_unregister(as_ptr<void>(addr)));
}

void finalize() {
    if (!g_initialized) return;
    g_initialized = false;
    nvshmem_finalize();
}

void fetch_p2p(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
               const std::vector<uint64_t>& nbytes, uint64_t stream) {
    require_init("fetch_p2p");
    for_batches(dst, src, nbytes, 64 * 1024, [&](const TaskBatch& b, int blocks) {
        fetch_p2p_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(b);
        check_launch("fetch_p2p_kernel");
    });
}

// Inter-node fetch, staged: the destination is ordinary device memory (not symmetric, not registered), which
// IB RMA cannot target; so get into the symmetric scratch, then copy on the same stream.
// Ordering: nvshmemx_getmem_on_stream is a blocking get in stream order (data is in `scratch` before the
// next operation on the stream starts), and the copy that follows reads it; the next chunk's get is issued
// after that copy in the same stream, so the scratch is never overwritten while being read. The caller
// serialises every user of the scratch on one stream.
void get_staged(uint64_t dst, uint64_t src_sym, uint64_t nbytes, int pe, uint64_t scratch,
                uint64_t scratch_bytes, uint64_t stream) {
    require_init("get_staged");
    if (scratch_bytes == 0) throw Error("get_staged: empty scratch buffer");
    for (uint64_t off = 0; off < nbytes; off += scratch_bytes) {
        const uint64_t n = std::min(scratch_bytes, nbytes - off);
        nvshmemx_getmem_on_stream(as_ptr<void>(scratch), as_ptr<void>(src_sym + off), n, pe, as_stream(stream));
        check_launch("nvshmemx_getmem_on_stream");
        ODC_CUDA_CHECK(cudaMemcpyAsync(as_ptr<void>(dst + off), as_ptr<void>(scratch), n,
                                       cudaMemcpyDeviceToDevice, as_stream(stream)));
    }
}

void accumulate_p2p(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                    const std::vector<uint64_t>& numel, int src_dtype, float scale, bool vector_atomics,
                    uint64_t stream) {
    require_init("accumulate_p2p");
    for_batches(dst, src, numel, 16 * 1024, [&](const TaskBatch& b, int blocks) {
        cudaStream_t s = as_stream(stream);
        switch (src_dtype) {
            case kFloat32: accumulate_p2p_kernel<float><<<blocks, kThreads, 0, s>>>(b, scale, vector_atomics); break;
            case kBFloat16: accumulate_p2p_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(b, scale, vector_atomics); break;
            case kFloat16: accumulate_p2p_kernel<__half><<<blocks, kThreads, 0, s>>>(b, scale, vector_atomics); break;
            default: throw Error("accumulate_p2p: unknown dtype code " + std::to_string(src_dtype));
        }
        check_launch("accumulate_p2p_kernel");
    });
}

void accumulate_locked(uint64_t dst_sym, uint64_t src, uint64_t numel, int src_dtype, float scale, int pe,
                       uint64_t scratch, uint64_t scratch_bytes, uint64_t cell_bytes, uint64_t locks,
                       int nlocks, uint64_t stream) {
    require_init("accumulate_locked");
    if (numel == 0) return;
    if (cell_bytes == 0 || cell_bytes % 16 != 0 || scratch_bytes < cell_bytes || nlocks <= 0)
        throw Error("accumulate_locked: bad scratch/cell/lock configuration");
    if (dst_sym % sizeof(float) != 0) throw Error("accumulate_locked: destination not 4-byte aligned");
    const uint64_t cells = (dst_sym + numel * 4 - 1) / cell_bytes - dst_sym / cell_bytes + 1;
    const int blocks = static_cast<int>(std::min<uint64_t>(cells, scratch_bytes / cell_bytes));
    cudaStream_t s = as_stream(stream);
    float* d = as_ptr<float>(dst_sym);
    float* sc = as_ptr<float>(scratch);
    int* lk = as_ptr<int>(locks);
    switch (src_dtype) {
        case kFloat32:
            accumulate_locked_kernel<float><<<blocks, kThreads, 0, s>>>(d, as_ptr<const float>(src), numel, scale, pe, sc, cell_bytes, lk, nlocks);
            break;
        case kBFloat16:
            accumulate_locked_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(d, as_ptr<const __nv_bfloat16>(src), numel, scale, pe, sc, cell_bytes, lk, nlocks);
            break;
        case kFloat16:
            accumulate_locked_kernel<__half><<<blocks, kThreads, 0, s>>>(d, as_ptr<const __half>(src), numel, scale, pe, sc, cell_bytes, lk, nlocks);
            break;
        default: throw Error("accumulate_locked: unknown dtype code " + std::to_string(src_dtype));
    }
    check_launch("accumulate_locked_kernel");
}

}  // namespace odc
