// Cell protocols over NVSHMEM network operations (across nodes, or wherever a PE pair lacks load/store atomics):
// locked push, staged fetch, network put. The work is a list of items, one per (task, cell); items of task i are
// [first[i], first[i+1]); block b takes items rotate + b, rotate + b + gridDim.x, ... (mod total), so PEs of
// different ranks start at different cells instead of queueing on the same first lock.
//
// Addresses. A task names the peer's region by its *symmetric offset* in the heap arena (the same number on every
// PE, because every PE runs the same allocation sequence). NVSHMEM's operations take a symmetric address in the
// caller's own heap, formed here as heap + offset. Cells and locks are derived from the offset alone: NVSHMEM does
// not promise that the heap sits at the same virtual address on every PE (each process reserves its own range),
// so two PEs deriving a lock from their own addresses of one owner cell could take different locks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "kernels.h"

namespace odc {
namespace {

// Locked push: ticket lock + get + add + put per cell. The owner's arena is cut into fixed cells of `cell_bytes`
// at symmetric offsets 0, cell_bytes, ... (every pusher cuts the same way: offsets, not addresses); cell c is
// guarded by ticket lock l = hash(c) % nlocks, i.e. the words next = locks[2l], serving = locks[2l+1] in the
// OWNER's symmetric memory. Per item, block b with scratch slot b:
//   1. thread 0 takes a ticket (fetch_inc of next at the owner) and waits (wait_or_abort) until serving equals
//      the ticket; then __threadfence_system() (acquire for gets served by loads through a peer pointer);
//   2. blocking get of the piece into the slot (the value every earlier holder left, see 4);
//   3. slot += float(src) * scale (fp32 accumulator), or slot += src (int64 accumulator, deterministic mode);
//   4. blocking put back; __syncthreads; thread 0 alone runs nvshmem_quiet (quiet covers every operation of the
//      PE, so the block's whole put is delivered at the owner);
//   5. thread 0 releases: atomic inc of serving at the owner.
// Ordering: 4 happens-before 5 (quiet), 5 happens-before the next ticket holder's 1, which precedes its 2: every
// holder reads the previous holder's result, so no update is lost. The ticket lock is FIFO-fair (no pusher
// starves behind luckier CAS retries). All lock words are touched only by NVSHMEM AMOs, which take one path for
// the whole job, so they are atomic with respect to each other.
// Element type: A is the accumulator's (float or int64_t; Plan::run allows int64 only with int64 sources and
// scale 1). The lock still does all the work of making get + add + put one atomic update of the cell: nothing in
// NVSHMEM makes a get/put pair atomic, whatever the element type. What int64 changes is the order argument: the
// ticket order of the holders is arrival order, so with fp32 the cell's value depends on it (rounding is not
// associative), while the int64 adds (two's complement modulo 2^64, kept inside int64 by deterministic mode's
// fixed-point bound, so no wrap) are associative and commutative: the same bits whatever order the holders come.
// Cells never split an element: cells start at multiples of cell_bytes (a multiple of 16) and Plan checks that an
// accumulator is aligned to its element size.
// Deadlock freedom: a block holds at most one lock at a time and, while holding it, waits only for its own
// one-sided get/put/quiet, which complete without code running on the owner or on other blocks; so every lock
// is released after bounded work, and each waiting ticket is eventually served. A holder that died never
// releases: then the waiters leave when the abort word is raised (the job is lost; the error names the op).
// Not bounded by the abort: the ticket fetch_inc and the get/put/quiet themselves, which wait inside NVSHMEM
// (to a dead node they wait for the network transport's own error handling; see docs/design.md).
__device__ __forceinline__ void accumulate(float& acc, float v, float scale) { acc += v * scale; }
__device__ __forceinline__ void accumulate(float& acc, __nv_bfloat16 v, float scale) { acc += to_f32(v) * scale; }
__device__ __forceinline__ void accumulate(float& acc, __half v, float scale) { acc += to_f32(v) * scale; }
__device__ __forceinline__ void accumulate(int64_t& acc, int64_t v, float) {
    // on the unsigned reinterpretation: the int64 sum without signed-overflow UB (none occurs: the bound)
    acc = static_cast<int64_t>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(v));
}

template <typename T, typename A>
__global__ void push_locked_kernel(CellBatch b, float scale, char* heap, char* scratch, uint64_t cell_bytes,
                                   unsigned* locks, int nlocks, const volatile uint32_t* abort) {
    __shared__ int s_stop;
    A* slot = reinterpret_cast<A*>(scratch + blockIdx.x * cell_bytes);
    for (uint64_t k = blockIdx.x; k < b.total; k += gridDim.x) {
        const uint64_t item = (k + b.rotate) % b.total;
        const CellTask& t = b.t[find_task(b, item)];
        const uint64_t begin = t.offset, end = begin + t.n * sizeof(A);
        const uint64_t c = begin / cell_bytes + (item - t.first);
        const uint64_t lo = max(begin, c * cell_bytes), hi = min(end, (c + 1) * cell_bytes);
        const uint64_t e0 = (lo - begin) / sizeof(A), m = (hi - lo) / sizeof(A);
        A* remote = reinterpret_cast<A*>(heap + lo);
        const T* src = reinterpret_cast<const T*>(t.local) + e0;
        unsigned* next = locks + 2 * static_cast<int>((c * 0x9E3779B97F4A7C15ull >> 17) % static_cast<uint64_t>(nlocks));
        unsigned* serving = next + 1;
        if (threadIdx.x == 0) {
            const unsigned ticket = nvshmem_uint_atomic_fetch_inc(next, t.pe);
            s_stop = !wait_or_abort([&] { return nvshmem_uint_atomic_fetch(serving, t.pe) == ticket; }, abort, 8192u);
            __threadfence_system();
        }
        __syncthreads();
        if (s_stop) return;  // uniform: every thread read the same shared flag
        nvshmemx_getmem_block(slot, remote, m * sizeof(A), t.pe);
        __syncthreads();
        for (uint64_t i = threadIdx.x; i < m; i += blockDim.x) accumulate(slot[i], src[i], scale);
        __syncthreads();
        nvshmemx_putmem_block(remote, slot, m * sizeof(A), t.pe);
        __syncthreads();
        if (threadIdx.x == 0) {
            nvshmem_quiet();
            nvshmem_uint_atomic_inc(serving, t.pe);
        }
        __syncthreads();  // the slot is reused for the next item only after the release
    }
}

// Staged fetch: the destination is ordinary device memory, which an IB get cannot target, so every item is a
// blocking device get into this block's symmetric scratch slot, then a copy to the destination by the same block.
// A block uses only its own slot, and the next item's get starts after the copy (__syncthreads), so a slot is
// never overwritten while being read. One-sided: it waits for nothing but its own gets.
__global__ void fetch_staged_kernel(CellBatch b, char* heap, char* scratch, uint64_t cell_bytes) {
    char* slot = scratch + blockIdx.x * cell_bytes;
    for (uint64_t k = blockIdx.x; k < b.total; k += gridDim.x) {
        const uint64_t item = (k + b.rotate) % b.total;
        const CellTask& t = b.t[find_task(b, item)];
        const uint64_t off = (item - t.first) * cell_bytes;
        const uint64_t n = min(cell_bytes, t.n - off);
        nvshmemx_getmem_block(slot, heap + t.offset + off, n, t.pe);
        __syncthreads();
        copy_bytes(reinterpret_cast<char*>(t.local + off), slot, n, threadIdx.x, blockDim.x);
        __syncthreads();
    }
}

// Network put of signalled puts (signal.cu has the protocol): per cell, a non-blocking put from the symmetric
// source; completed by the quiet of the signal kernel that follows on the stream.
__global__ void put_nbi_kernel(CellBatch b, char* heap, uint64_t cell_bytes) {
    for (uint64_t k = blockIdx.x; k < b.total; k += gridDim.x) {
        const uint64_t item = (k + b.rotate) % b.total;
        const CellTask& t = b.t[find_task(b, item)];
        const uint64_t off = (item - t.first) * cell_bytes;
        const uint64_t n = min(cell_bytes, t.n - off);
        nvshmemx_putmem_nbi_block(heap + t.offset + off, reinterpret_cast<const void*>(t.local + off), n, t.pe);
    }
}

}  // namespace

void launch_push_locked(const CellBatch& b, int blocks, int dtype, float scale, char* heap, uint64_t cell,
                        char* sc, unsigned* lk, int nl, const volatile uint32_t* ab, cudaStream_t s) {
    switch (dtype) {
        case kInt64: push_locked_kernel<int64_t, int64_t><<<blocks, kThreads, 0, s>>>(b, scale, heap, sc, cell, lk, nl, ab); break;
        case kFloat32: push_locked_kernel<float, float><<<blocks, kThreads, 0, s>>>(b, scale, heap, sc, cell, lk, nl, ab); break;
        case kBFloat16: push_locked_kernel<__nv_bfloat16, float><<<blocks, kThreads, 0, s>>>(b, scale, heap, sc, cell, lk, nl, ab); break;
        default: push_locked_kernel<__half, float><<<blocks, kThreads, 0, s>>>(b, scale, heap, sc, cell, lk, nl, ab); break;
    }
    check_launch("push_locked_kernel");
}

void launch_fetch_staged(const CellBatch& b, int blocks, char* heap, char* scratch, uint64_t cell, cudaStream_t s) {
    fetch_staged_kernel<<<blocks, kThreads, 0, s>>>(b, heap, scratch, cell);
    check_launch("fetch_staged_kernel");
}

void launch_put_nbi(const CellBatch& b, int blocks, char* heap, uint64_t cell, cudaStream_t s) {
    put_nbi_kernel<<<blocks, kThreads, 0, s>>>(b, heap, cell);
    check_launch("put_nbi_kernel");
}

}  // namespace odc
