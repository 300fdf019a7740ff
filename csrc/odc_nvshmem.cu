// NVSHMEM host wrappers (init only) and the device kernels of odc_runtime._C.
//
// Conventions: every CUDA / NVSHMEM status is checked and turned into odc::Error (a Python exception via
// bindings.cpp); nothing here calls exit(). Pointers and streams arrive as uint64_t. After init no NVSHMEM host
// function is called: barrier, quiet, remote gets and pushes are our own kernels (launched and checked with our
// CUDA runtime), and every loop that waits for another PE also polls the engine's abort word, which lives in
// host-mapped memory so that the host can end the wait of a kernel that is already running.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>

#include "odc_compat.cuh"
#include "odc_ext.h"

namespace odc {
namespace {

bool g_initialized = false;

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

int current_sm_count() {
    int dev = 0, n = 0;
    ODC_CUDA_CHECK(cudaGetDevice(&dev));
    ODC_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
}

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

__device__ __forceinline__ bool abort_raised(const volatile uint32_t* abort) { return *abort != 0; }

// ---------------------------------------------------------------------------------------------------------
// Own barrier (replaces nvshmemx_barrier_all_on_stream, whose host part blocks the CPU until every PE arrives
// when several PEs share a GPU, and whose device part cannot be interrupted).
//
// State: epochs[q] in every PE's symmetric memory = the last barrier epoch PE q announced to this PE. Every PE
// calls the same barriers in the same order (the Python side numbers them), so epoch k means "barrier #k".
//
// Protocol of barrier #k on PE p (one block, thread t serves peers t, t + blockDim, ...):
//   1. release: thread 0 runs nvshmem_quiet() (this PE's device-initiated puts/AMOs are complete: the locked
//      push and staged get), then every thread runs __threadfence_system();
//   2. announce: nvshmemx_signal_op(&epochs[p], k, SIGNAL_SET, q) for every q (a volatile store through the
//      peer pointer on NVLink, a network AMO otherwise);
//   3. wait: until epochs[q] >= k for every q, polling the abort word between loads; on abort, record what every
//      peer last announced into host-mapped memory and leave;
//   4. acquire: nvshmem_uint64_wait_until(&epochs[q], GE, k) (returns at once, and applies NVSHMEM's own
//      consistency step for data delivered by the network), then __threadfence_system().
//
// Ordering argument. Everything PE q issued on its stream before barrier #k happens-before q's announcement:
// kernels on one stream run in order and a kernel's writes are performed before the next kernel starts; the
// quiet completes q's remote puts/AMOs (locked pushes); peer-pointer atomics of the fused push are performed
// when that kernel completes; and the system-scope fence makes all of them visible, cumulatively, before the
// announcing store. PE p observes the announcement (load of k) and then fences (acquire), so everything after
// barrier #k on p's stream sees those writes: the owner's accumulator holds every push issued before any PE's
// barrier, and a fetch after the barrier reads every owner's post-step parameters.
//
// Why it cannot deadlock. A PE announces before it waits, so barrier #k completes on every PE as soon as every PE
// has *started* its barrier #k kernel. A PE's barrier kernel starts once the work queued before it on its stream
// has finished; that work is our own kernels (copy, fused push: no waiting at all; locked push: waits only for a
// lock whose holder is resident and finishes after bounded, one-sided work; staged get: one-sided) and the
// user's kernels. So, with every PE alive and calling the same barriers, every barrier completes. A PE that is
// dead or never calls barrier #k leaves the others spinning, and that is exactly what the abort word ends: the
// host polls the barrier's CUDA event against the deadline, raises the abort, and every spinning kernel of this
// engine (barrier, lock spins) leaves within a poll period; the context stays usable. Epochs only grow and a PE
// cannot run more than one barrier ahead of the slowest (it would wait in it), so ">= k" never confuses rounds.
// ---------------------------------------------------------------------------------------------------------
__global__ void barrier_kernel(uint64_t* epochs, uint64_t epoch, int me, int npes, const volatile uint32_t* abort,
                               volatile uint32_t* ctl) {
    __shared__ int s_gave_up;
    if (threadIdx.x == 0) {
        s_gave_up = 0;
        nvshmem_quiet();
    }
    __syncthreads();
    __threadfence_system();
    for (int q = threadIdx.x; q < npes; q += blockDim.x) nvshmemx_signal_op(epochs + me, epoch, NVSHMEM_SIGNAL_SET, q);
    for (int q = threadIdx.x; q < npes; q += blockDim.x) {
        unsigned ns = 32;
        while (nvshmem_signal_fetch(epochs + q) < epoch) {
            if (abort_raised(abort)) {
                s_gave_up = 1;  // benign race: every writer stores 1
                break;
            }
            __nanosleep(ns);
            ns = min(ns * 2, 1024u);
        }
    }
    __syncthreads();
    if (s_gave_up) {
        volatile uint64_t* heard = reinterpret_cast<volatile uint64_t*>(ctl + 2);
        for (int q = threadIdx.x; q < npes; q += blockDim.x) heard[q] = nvshmem_signal_fetch(epochs + q);
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            ctl[1] = 1;
            __threadfence_system();
        }
        return;
    }
    for (int q = threadIdx.x; q < npes; q += blockDim.x) nvshmem_uint64_wait_until(epochs + q, NVSHMEM_CMP_GE, epoch);
    __threadfence_system();
}

__global__ void quiet_kernel() { nvshmem_quiet(); }

// ---------------------------------------------------------------------------------------------------------
// Peer-pointer tasks (intra-node): one launch handles up to kMaxTasks requests. Block b works on task
// b % ntasks, so consecutive blocks hit different peers (the caller already rotates the peer order), and
// on part b / ntasks of it: the task is cut into `parts` interleaved slices.
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

// Copy n bytes with the threads first, first + stride, ...: 16-byte words when dst and src are congruent modulo 16
// (a head of up to 15 bytes first), else 4-byte words when both are 4-byte aligned (fp32 at any element offset),
// else bytes. Element offsets into peers' regions (the hierarchical protocol's rows) make unaligned ends common.
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, uint64_t n, uint64_t first, uint64_t stride) {
    const uint64_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    uint64_t head = 0, words = 0, width = 1;
    if ((d - s) % 16 == 0) {
        head = min(n, (16 - d % 16) % 16);
        width = 16;
    } else if ((d | s) % 4 == 0) {
        width = 4;
    }
    words = (n - head) / width;
    if (width == 16) {
        const int4* s4 = reinterpret_cast<const int4*>(src + head);
        int4* d4 = reinterpret_cast<int4*>(dst + head);
        for (uint64_t i = first; i < words; i += stride) d4[i] = s4[i];
    } else if (width == 4) {
        const uint32_t* s1 = reinterpret_cast<const uint32_t*>(src);
        uint32_t* d1 = reinterpret_cast<uint32_t*>(dst);
        for (uint64_t i = first; i < words; i += stride) d1[i] = s1[i];
    } else {
        words = 0;  // everything below, bytewise
    }
    for (uint64_t i = first; i < head; i += stride) dst[i] = src[i];
    for (uint64_t i = head + words * width + first; i < n; i += stride) dst[i] = src[i];
}

// Fetch: plain loads from the owner's memory through the peer pointer, plain stores into local memory (and, for
// put_signal, the reverse: any byte copy between two addresses this GPU can load/store).
// Ordering: see barrier_kernel (the owner's writes before its barrier are visible after ours).
__global__ void fetch_p2p_kernel(TaskBatch b) {
    const int ti = blockIdx.x % b.ntasks;
    const int part = blockIdx.x / b.ntasks;
    const Task t = b.t[ti];
    const uint64_t stride = static_cast<uint64_t>(b.parts) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x;
    copy_bytes(reinterpret_cast<char*>(t.dst), reinterpret_cast<const char*>(t.src), t.n, first, stride);
}

// Push (one NVLink domain): dst (the owner's fp32 accumulator, through the peer pointer) += float(src) * scale.
// Exactness under concurrency: every update is a single system-scope hardware atomic performed at the owner's
// memory, so concurrent pushers from any number of PEs never lose an update; fp32 addition order may differ
// between runs. Ordering: the reductions are performed when this kernel completes; see barrier_kernel.
template <typename T>
__global__ void accumulate_p2p_kernel(TaskBatch b, float scale, bool vector_atomics) {
    const int ti = blockIdx.x % b.ntasks;
    const int part = blockIdx.x / b.ntasks;
    const Task t = b.t[ti];
    float* dst = reinterpret_cast<float*>(t.dst);
    const T* src = reinterpret_cast<const T*>(t.src);
    const uint64_t stride = static_cast<uint64_t>(b.parts) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x;
    // Vector atomics on the 16-byte aligned middle (an element offset into the accumulator may leave a head of up
    // to 3 elements before it) when the source is aligned the same way; scalar atomics on head and tail.
    const uint64_t head = min(t.n, (16 - t.dst % 16) % 16 / sizeof(float));
    uint64_t nv = 0;
    if (vector_atomics && (t.src + head * sizeof(T)) % (4 * sizeof(T)) == 0) {
        nv = (t.n - head) / 4;
        for (uint64_t i = first; i < nv; i += stride) {
            float4 v = load4<T>(src + head + 4 * i);
            v.x *= scale; v.y *= scale; v.z *= scale; v.w *= scale;
            red_add4(dst + head + 4 * i, v);
        }
    }
    const uint64_t done = nv ? head + nv * 4 : 0;  // no vector part: everything scalar
    if (nv)
        for (uint64_t i = first; i < head; i += stride) atomicAdd_system(dst + i, to_f32(src[i]) * scale);
    for (uint64_t i = done + first; i < t.n; i += stride) atomicAdd_system(dst + i, to_f32(src[i]) * scale);
}

// ---------------------------------------------------------------------------------------------------------
// Cell tasks (locked push and staged get): the work is a list of items, one per (task, cell). Items of task i
// are [first[i], first[i+1]); block b takes items rotate + b, rotate + b + gridDim.x, ... (mod total), so
// pushers of different ranks start at different cells instead of queueing on the same first lock.
// ---------------------------------------------------------------------------------------------------------
struct CellTask {
    uint64_t remote;  // symmetric address at the peer (accumulator / parameter region)
    uint64_t local;   // ordinary device memory of the caller (source / destination)
    uint64_t n;       // elements (push, fp32 at the owner) or bytes (get)
    uint64_t first;   // index of the task's first item
    int pe;
};
struct CellBatch {
    int ntasks;
    uint64_t total;  // items
    uint64_t rotate;
    CellTask t[kMaxTasks];
};

__device__ __forceinline__ int find_task(const CellBatch& b, uint64_t item) {
    int ti = 0;
    while (ti + 1 < b.ntasks && b.t[ti + 1].first <= item) ++ti;
    return ti;
}

// Push across nodes (or whenever not every PE pair has load/store atomics): ticket lock + get + add + put.
// The owner's address space is cut into fixed cells of `cell_bytes` (symmetric addresses are identical on every
// PE, so every pusher cuts the same way); cell c is guarded by ticket lock l = hash(c) % nlocks, i.e. the words
// next = locks[2l], serving = locks[2l+1] in the OWNER's symmetric memory. Per item, block b with scratch slot b:
//   1. thread 0 takes a ticket (fetch_inc of next at the owner) and polls serving until it equals the ticket,
//      with backoff, leaving if the abort word is raised; then __threadfence_system() (acquire for gets served
//      by loads through a peer pointer);
//   2. blocking get of the piece into the slot (the value every earlier holder left, see 4);
//   3. slot += float(src) * scale;
//   4. blocking put back; __syncthreads; thread 0 alone runs nvshmem_quiet (quiet covers every operation of the
//      PE, so the block's whole put is delivered at the owner);
//   5. thread 0 releases: atomic inc of serving at the owner.
// Ordering: 4 happens-before 5 (quiet), 5 happens-before the next ticket holder's 1, which precedes its 2: every
// holder reads the previous holder's result, so no update is lost. The ticket lock is FIFO-fair (no pusher
// starves behind luckier CAS retries). All lock words are touched only by NVSHMEM AMOs, which take one path for
// the whole job, so they are atomic with respect to each other.
// Deadlock freedom: a block holds at most one lock at a time and, while holding it, waits only for its own
// one-sided get/put/quiet, which complete without code running on the owner or on other blocks; so every lock
// is released after bounded work, and each waiting ticket is eventually served. A holder that died never
// releases: then the waiters leave when the host raises the abort (the job is lost; the error names the op).
template <typename T>
__global__ void accumulate_locked_kernel(CellBatch b, float scale, float* scratch, uint64_t cell_bytes,
                                         unsigned* locks, int nlocks, const volatile uint32_t* abort) {
    __shared__ int s_stop;
    float* slot = reinterpret_cast<float*>(reinterpret_cast<char*>(scratch) + blockIdx.x * cell_bytes);
    for (uint64_t k = blockIdx.x; k < b.total; k += gridDim.x) {
        const uint64_t item = (k + b.rotate) % b.total;
        const CellTask& t = b.t[find_task(b, item)];
        const uint64_t begin = t.remote, end = begin + t.n * sizeof(float);
        const uint64_t c = begin / cell_bytes + (item - t.first);
        const uint64_t lo = max(begin, c * cell_bytes), hi = min(end, (c + 1) * cell_bytes);
        const uint64_t e0 = (lo - begin) / sizeof(float), m = (hi - lo) / sizeof(float);
        float* remote = reinterpret_cast<float*>(lo);
        const T* src = reinterpret_cast<const T*>(t.local) + e0;
        unsigned* next = locks + 2 * static_cast<int>((c * 0x9E3779B97F4A7C15ull >> 17) % static_cast<uint64_t>(nlocks));
        unsigned* serving = next + 1;
        if (threadIdx.x == 0) {
            int stop = 0;
            const unsigned ticket = nvshmem_uint_atomic_fetch_inc(next, t.pe);
            unsigned ns = 64;
            while (nvshmem_uint_atomic_fetch(serving, t.pe) != ticket) {
                if (abort_raised(abort)) {
                    stop = 1;
                    break;
                }
                __nanosleep(ns);
                ns = min(ns * 2, 8192u);
            }
            __threadfence_system();
            s_stop = stop;
        }
        __syncthreads();
        if (s_stop) return;  // uniform: every thread read the same shared flag
        nvshmemx_getmem_block(slot, remote, m * sizeof(float), t.pe);
        __syncthreads();
        for (uint64_t i = threadIdx.x; i < m; i += blockDim.x) slot[i] += to_f32(src[i]) * scale;
        __syncthreads();
        nvshmemx_putmem_block(remote, slot, m * sizeof(float), t.pe);
        __syncthreads();
        if (threadIdx.x == 0) {
            nvshmem_quiet();
            nvshmem_uint_atomic_inc(serving, t.pe);
        }
        __syncthreads();  // the slot is reused for the next item only after the release
    }
}

// Fetch from peers without a peer pointer (across nodes): the destination is ordinary device memory, which an IB
// get cannot target, so every item is a blocking device get into this block's symmetric scratch slot, then a
// copy to the destination by the same block. A block uses only its own slot, and the next item's get starts
// after the copy (__syncthreads), so a slot is never overwritten while being read.
__global__ void get_staged_kernel(CellBatch b, char* scratch, uint64_t cell_bytes) {
    char* slot = scratch + blockIdx.x * cell_bytes;
    for (uint64_t k = blockIdx.x; k < b.total; k += gridDim.x) {
        const uint64_t item = (k + b.rotate) % b.total;
        const CellTask& t = b.t[find_task(b, item)];
        const uint64_t off = (item - t.first) * cell_bytes;
        const uint64_t n = min(cell_bytes, t.n - off);
        nvshmemx_getmem_block(slot, reinterpret_cast<const char*>(t.remote + off), n, t.pe);
        __syncthreads();
        copy_bytes(reinterpret_cast<char*>(t.local + off), slot, n, threadIdx.x, blockDim.x);
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------------------
// Signalled puts (the hierarchical push across nodes, odc_runtime/hierarchy.py): put_signal and wait_signal.
//
// Built from public NVSHMEM *device* APIs that exist, with the same signatures, in every release from 3.3
// through 3.8 (checked in the 3.4.5 and 3.8.0 headers: nvshmemx_putmem_nbi_block, nvshmem_quiet,
// nvshmemx_signal_op with NVSHMEM_SIGNAL_ADD, nvshmem_signal_fetch, nvshmem_signal_wait_until), launched as our
// own kernels, not through NVSHMEM's host *_on_stream wrappers: those launch with NVSHMEM's own CUDA runtime
// (their launch errors are invisible to check_launch, see odc_ext.h) and nvshmemx_signal_wait_until_on_stream
// cannot be interrupted, while our wait polls the engine's abort word like every other wait here.
//
// put_signal on PE p, stream-ordered, three steps (kernels on one stream):
//   1. data: for peers with a peer pointer (same node) an SM copy through the peer pointer (fetch_p2p_kernel
//      with the roles swapped: plain loads of local memory, plain stores to the peer); for the others (across
//      nodes) nvshmemx_putmem_nbi_block per cell from the symmetric source (put_nbi_kernel);
//   2. signal_kernel (one block): thread 0 runs nvshmem_quiet() (every put of step 1, and every other
//      device-initiated operation of this PE, is complete: delivered at the target), then every thread runs
//      __threadfence_system(), then nvshmemx_signal_op(&sig[index], 1, NVSHMEM_SIGNAL_ADD, q) per request.
// Ordering argument (data delivered before the signal is visible). Step 1's peer-pointer stores are performed
// when its kernel completes, before step 2 starts (same stream); the quiet completes the network puts; the
// system-scope fence orders all of them, cumulatively, before the signal AMO, which is only *issued* after that.
// So when the owner observes the count, every byte of every put counted in it is already in its memory. The
// waiter is the owner GPU itself (wait_signal_kernel reads the owner's own signal word, and the fold that follows
// on the owner's stream reads the owner's own memory): GPU_DIRECT_RDMA_WRITES_ORDERING=OWNER (this H100's value:
// the owner GPU sees network writes to its memory in order; other GPUs may not) is enough, and in any case the
// data writes were acknowledged (quiet) before the signal write was posted. The waiter then runs
// nvshmem_signal_wait_until (returns at once, and applies NVSHMEM's consistency step for network-delivered data
// where the transport needs one) and a system-scope fence (acquire): kernels after it on the stream see the data.
// Signal words only grow (ADD 1 per put; the caller compares against running counts), so no reset races a put.
// Why it cannot deadlock: put_signal waits for nothing but its own one-sided operations (quiet completes without
// code running on any other PE); wait_signal waits for puts that other PEs issue without waiting on us, and when
// they never come (a dead or stuck peer) the host raises the abort word at the deadline and the wait leaves.
// ---------------------------------------------------------------------------------------------------------
__global__ void put_nbi_kernel(CellBatch b, uint64_t cell_bytes) {
    for (uint64_t k = blockIdx.x; k < b.total; k += gridDim.x) {
        const uint64_t item = (k + b.rotate) % b.total;
        const CellTask& t = b.t[find_task(b, item)];
        const uint64_t off = (item - t.first) * cell_bytes;
        const uint64_t n = min(cell_bytes, t.n - off);
        nvshmemx_putmem_nbi_block(reinterpret_cast<void*>(t.remote + off), reinterpret_cast<const void*>(t.local + off),
                                  n, t.pe);
    }
}

struct SignalBatch {
    int n;
    uint64_t sig[kMaxTasks];  // symmetric address of the signal word
    int pe[kMaxTasks];
};

__global__ void signal_kernel(SignalBatch b) {
    if (threadIdx.x == 0) nvshmem_quiet();
    __syncthreads();
    __threadfence_system();
    for (int i = threadIdx.x; i < b.n; i += blockDim.x)
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(b.sig[i]), 1, NVSHMEM_SIGNAL_ADD, b.pe[i]);
}

// Waits until this PE's signal word reaches `value` or the abort word is raised. On abort it records the count
// it saw (host-mapped ctl: wait_gave_up, wait_seen) and leaves; the host reports the timeout.
__global__ void wait_signal_kernel(uint64_t* sig, uint64_t value, const volatile uint32_t* abort,
                                   volatile uint64_t* record) {
    unsigned ns = 32;
    uint64_t seen;
    while ((seen = nvshmem_signal_fetch(sig)) < value) {
        if (abort_raised(abort)) {
            record[1] = seen;
            __threadfence_system();
            record[0] = 1;
            __threadfence_system();
            return;
        }
        __nanosleep(ns);
        ns = min(ns * 2, 1024u);
    }
    nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, value);
    __threadfence_system();
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

// Split tasks into launches of at most kMaxTasks; `parts` per task so the grid is ~4 blocks per SM.
template <typename Launch>
void for_batches(const std::vector<Task>& tasks, uint64_t unit_per_block, Launch launch) {
    const int target_blocks = 4 * current_sm_count();
    for (size_t base = 0; base < tasks.size(); base += kMaxTasks) {
        TaskBatch b{};
        uint64_t max_n = 0;
        for (size_t i = base; i < std::min(tasks.size(), base + kMaxTasks); ++i) {
            if (tasks[i].n == 0) continue;
            b.t[b.ntasks++] = tasks[i];
            max_n = std::max(max_n, tasks[i].n);
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
// Host API: lifecycle
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

int mps_enabled(int device) {
    // cudaDevAttrMpsEnabled (133) exists from CUDA 12.x runtimes on; older ones answer cudaErrorInvalidValue.
    int v = 0;
    cudaError_t err = cudaDeviceGetAttribute(&v, static_cast<cudaDeviceAttr>(133), device);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return v ? 1 : 0;
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
    if (ndev == 0) throw Error("init: no CUDA device is visible (NVSHMEM needs a GPU)");
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

uint64_t malloc_(uint64_t bytes) {
    require_init("malloc");
    void* p = nvshmem_malloc(static_cast<size_t>(bytes));
    if (p == nullptr && bytes > 0) throw Error("nvshmem_malloc(" + std::to_string(bytes) + ") returned NULL");
    // nvshmem_malloc ends in a barrier that may launch work with NVSHMEM's own runtime; make sure it went well.
    ODC_CUDA_CHECK(cudaDeviceSynchronize());
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

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

// -------------------------------------------------------------------------------------------------------
// Engine
// -------------------------------------------------------------------------------------------------------
Engine::Engine(int rank, int npes, uint64_t epochs, uint64_t locks, int nlocks, uint64_t scratch, int slots,
               uint64_t cell_bytes, bool vector_atomics)
    : rank_(rank), npes_(npes), epochs_(epochs), locks_(locks), nlocks_(nlocks), scratch_(scratch), slots_(slots),
      cell_bytes_(cell_bytes), vector_atomics_(vector_atomics) {
    require_init("Engine");
    if (npes < 1 || rank < 0 || rank >= npes) throw Error("Engine: bad rank/npes");
    if (!epochs || !locks || !scratch || nlocks < 1 || slots < 1 || cell_bytes == 0 || cell_bytes % 16)
        throw Error("Engine: bad symmetric control buffers or scratch configuration");
    void* host = nullptr;
    // [0] abort, [1] barrier gave up (uint32); npes uint64 heard; 2 uint64: wait gave up, count it saw
    const size_t bytes = 2 * sizeof(uint32_t) + static_cast<size_t>(npes + 2) * sizeof(uint64_t);
    ODC_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, bytes);
    void* dev = nullptr;
    cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
    if (err != cudaSuccess) {
        cudaFreeHost(host);
        ODC_CUDA_CHECK(err);
    }
    ctl_host_ = static_cast<volatile uint32_t*>(host);
    ctl_dev_ = static_cast<uint32_t*>(dev);
    abort_dev_ = ctl_dev_;
}

Engine::~Engine() {
    // Never block here (a destructor may run at interpreter exit while a kernel still spins): raise the abort so
    // that any kernel of this engine leaves, and leave the mapped page to process teardown (a kernel may still
    // read it; the engine normally lives as long as the process).
    if (ctl_host_ != nullptr) ctl_host_[0] = 1;
}

void Engine::barrier(uint64_t epoch, uint64_t stream) {
    const int threads = std::min(npes_, 1024);
    barrier_kernel<<<1, std::max(32, threads), 0, as_stream(stream)>>>(as_ptr<uint64_t>(epochs_), epoch, rank_, npes_,
                                                                       abort_dev_, ctl_dev_);
    check_launch("barrier_kernel");
}

void Engine::put_signal(const std::vector<uint64_t>& remote, const std::vector<uint64_t>& local,
                        const std::vector<uint64_t>& bytes, const std::vector<int>& pe, const std::vector<bool>& near,
                        const std::vector<uint64_t>& sig, uint64_t stream) {
    require_init("put_signal");
    if (aborted()) throw Error("the transport was aborted after a timeout; restart the job");
    const size_t n = remote.size();
    if (local.size() != n || bytes.size() != n || pe.size() != n || near.size() != n || sig.size() != n)
        throw Error("put_signal: request lists differ in length");
    for (size_t i = 0; i < n; ++i) {
        if (pe[i] < 0 || pe[i] >= npes_) throw Error("put_signal: peer out of range");
        if ((remote[i] == 0 || local[i] == 0) && bytes[i] != 0) throw Error("put_signal: null address");
        if (sig[i] == 0 || sig[i] % sizeof(uint64_t) != 0) throw Error("put_signal: bad signal word address");
    }
    cudaStream_t s = as_stream(stream);
    // 1. data: peer-pointer copies in one SM kernel, network puts from the symmetric source in another
    std::vector<Task> tasks;
    for (size_t i = 0; i < n; ++i)
        if (near[i] && bytes[i] != 0) tasks.push_back(Task{remote[i], local[i], bytes[i]});
    for_batches(tasks, 64 * 1024, [&](const TaskBatch& b, int blocks) {
        fetch_p2p_kernel<<<blocks, kThreads, 0, s>>>(b);  // a byte copy: local source -> peer destination
        check_launch("put_signal (peer copy)");
    });
    const int sms = current_sm_count();
    for (size_t first = 0; first < n;) {
        CellBatch b{};
        for (; first < n && b.ntasks < kMaxTasks; ++first) {
            if (near[first] || bytes[first] == 0) continue;
            b.t[b.ntasks++] = CellTask{remote[first], local[first], bytes[first], b.total, pe[first]};
            b.total += (bytes[first] + cell_bytes_ - 1) / cell_bytes_;
        }
        if (b.ntasks == 0) continue;
        b.rotate = b.total * static_cast<uint64_t>(rank_) / npes_;
        const int blocks = static_cast<int>(std::min<uint64_t>(b.total, static_cast<uint64_t>(sms)));
        put_nbi_kernel<<<blocks, kThreads, 0, s>>>(b, cell_bytes_);
        check_launch("put_signal (network put)");
    }
    // 2. quiet + fence + one signal add per request (see the ordering argument at signal_kernel)
    for (size_t first = 0; first < n; first += kMaxTasks) {
        SignalBatch b{};
        for (size_t i = first; i < std::min(n, first + kMaxTasks); ++i) {
            b.sig[b.n] = sig[i];
            b.pe[b.n++] = pe[i];
        }
        signal_kernel<<<1, 64, 0, s>>>(b);
        check_launch("put_signal (signal)");
    }
}

void Engine::wait_signal(uint64_t sig, uint64_t value, uint64_t stream) {
    require_init("wait_signal");
    if (aborted()) throw Error("the transport was aborted after a timeout; restart the job");
    if (sig == 0 || sig % sizeof(uint64_t) != 0) throw Error("wait_signal: bad signal word address");
    wait_signal_kernel<<<1, 1, 0, as_stream(stream)>>>(as_ptr<uint64_t>(sig), value, abort_dev_, wait_record_dev());
    check_launch("wait_signal_kernel");
}

bool Engine::wait_gave_up() const { return wait_record_host()[0] != 0; }
uint64_t Engine::wait_seen() const { return wait_record_host()[1]; }

void Engine::quiet(uint64_t stream) {
    quiet_kernel<<<1, 1, 0, as_stream(stream)>>>();
    check_launch("quiet_kernel");
}

void Engine::set_abort() {
    ctl_host_[0] = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool Engine::aborted() const { return ctl_host_[0] != 0; }
bool Engine::barrier_gave_up() const { return ctl_host_[1] != 0; }

std::vector<uint64_t> Engine::heard() const {
    const volatile uint64_t* h = reinterpret_cast<const volatile uint64_t*>(ctl_host_ + 2);
    std::vector<uint64_t> out(npes_);
    for (int i = 0; i < npes_; ++i) out[i] = h[i];
    return out;
}

// -------------------------------------------------------------------------------------------------------
// Plan
// -------------------------------------------------------------------------------------------------------
Plan::Plan(std::shared_ptr<Engine> engine, int kind, std::vector<uint64_t> addr, std::vector<uint64_t> rel,
           std::vector<uint64_t> numel, std::vector<int> pe)
    : engine_(std::move(engine)), kind_(kind), addr_(std::move(addr)), rel_(std::move(rel)),
      numel_(std::move(numel)), pe_(std::move(pe)) {
    if (!engine_) throw Error("Plan: no engine");
    const size_t n = addr_.size();
    if (rel_.size() != n || numel_.size() != n || pe_.size() != n) throw Error("Plan: task lists differ in length");
    if (kind_ < kFetchCopy || kind_ > kPushLocked) throw Error("Plan: unknown kind " + std::to_string(kind_));
    for (size_t i = 0; i < n; ++i) {
        if (pe_[i] < 0 || pe_[i] >= engine_->npes()) throw Error("Plan: peer out of range");
        if (addr_[i] == 0 && numel_[i] != 0) throw Error("Plan: null address");
        if ((kind_ == kPushLocked || kind_ == kPushAtomic) && addr_[i] % sizeof(float) != 0)
            throw Error("Plan: accumulator address not 4-byte aligned");
    }
}

namespace {
uint64_t dtype_size(int dtype) {
    switch (dtype) {
        case kFloat32: return 4;
        case kBFloat16:
        case kFloat16: return 2;
        default: throw Error("unknown dtype code " + std::to_string(dtype));
    }
}
}  // namespace

void Plan::run(uint64_t base, int dtype, float scale, uint64_t stream) const {
    require_init("Plan.run");
    if (engine_->aborted()) throw Error("the transport was aborted after a timeout; restart the job");
    const uint64_t es = dtype_size(dtype);
    cudaStream_t s = as_stream(stream);
    const size_t n = addr_.size();
    switch (kind_) {
        case kFetchCopy:
            for (size_t i = 0; i < n; ++i) {
                if (numel_[i] == 0) continue;
                ODC_CUDA_CHECK(cudaMemcpyAsync(as_ptr<void>(base + rel_[i] * es), as_ptr<const void>(addr_[i]),
                                               numel_[i] * es, cudaMemcpyDeviceToDevice, s));
            }
            return;
        case kFetchKernel: {
            std::vector<Task> tasks(n);
            for (size_t i = 0; i < n; ++i) tasks[i] = Task{base + rel_[i] * es, addr_[i], numel_[i] * es};
            for_batches(tasks, 64 * 1024, [&](const TaskBatch& b, int blocks) {
                fetch_p2p_kernel<<<blocks, kThreads, 0, s>>>(b);
                check_launch("fetch_p2p_kernel");
            });
            return;
        }
        case kPushAtomic: {
            std::vector<Task> tasks(n);
            for (size_t i = 0; i < n; ++i) tasks[i] = Task{addr_[i], base + rel_[i] * es, numel_[i]};
            const bool vec = engine_->vector_atomics();
            for_batches(tasks, 16 * 1024, [&](const TaskBatch& b, int blocks) {
                switch (dtype) {
                    case kFloat32: accumulate_p2p_kernel<float><<<blocks, kThreads, 0, s>>>(b, scale, vec); break;
                    case kBFloat16: accumulate_p2p_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(b, scale, vec); break;
                    default: accumulate_p2p_kernel<__half><<<blocks, kThreads, 0, s>>>(b, scale, vec); break;
                }
                check_launch("accumulate_p2p_kernel");
            });
            return;
        }
        case kPushLocked:
        case kFetchStaged: {
            // One launch for all owners (up to kMaxTasks per launch); block 0 of rank r starts at item
            // r * total / npes, so concurrent pushers start on different cells and locks.
            const uint64_t cell = engine_->cell_bytes();
            for (size_t first = 0; first < n; first += kMaxTasks) {
                CellBatch b{};
                for (size_t i = first; i < std::min(n, first + kMaxTasks); ++i) {
                    if (numel_[i] == 0) continue;
                    const bool push = kind_ == kPushLocked;
                    const uint64_t size = push ? numel_[i] : numel_[i] * es;  // push: fp32 elements; get: bytes
                    const uint64_t items = push ? (addr_[i] + size * 4 - 1) / cell - addr_[i] / cell + 1
                                                : (size + cell - 1) / cell;
                    b.t[b.ntasks++] = CellTask{addr_[i], base + rel_[i] * es, size, b.total, pe_[i]};
                    b.total += items;
                }
                if (b.ntasks == 0) continue;
                b.rotate = b.total * static_cast<uint64_t>(engine_->rank()) / engine_->npes();
                const int blocks = static_cast<int>(std::min<uint64_t>(b.total, engine_->slots()));
                if (kind_ == kFetchStaged) {
                    get_staged_kernel<<<blocks, kThreads, 0, s>>>(b, as_ptr<char>(engine_->scratch()), cell);
                    check_launch("get_staged_kernel");
                    continue;
                }
                float* sc = as_ptr<float>(engine_->scratch());
                unsigned* lk = as_ptr<unsigned>(engine_->locks());
                const int nl = engine_->nlocks();
                const volatile uint32_t* ab = engine_->abort_dev();
                switch (dtype) {
                    case kFloat32: accumulate_locked_kernel<float><<<blocks, kThreads, 0, s>>>(b, scale, sc, cell, lk, nl, ab); break;
                    case kBFloat16: accumulate_locked_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(b, scale, sc, cell, lk, nl, ab); break;
                    default: accumulate_locked_kernel<__half><<<blocks, kThreads, 0, s>>>(b, scale, sc, cell, lk, nl, ab); break;
                }
                check_launch("accumulate_locked_kernel");
            }
            return;
        }
        default:
            throw Error("Plan.run: unknown kind");
    }
}

}  // namespace odc
