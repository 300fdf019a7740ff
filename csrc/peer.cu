// Peer-pointer protocols (one NVLink domain): copy and fused push. One launch handles up to kMaxTasks requests.
// Block b works on task b % ntasks, so consecutive blocks hit different peers (the caller already rotates the
// peer order), and on part b / ntasks of it: the task is cut into `parts` interleaved slices. Neither kernel waits
// for anything, so neither can take part in a deadlock; ordering against other PEs comes from the barrier
// (barrier.cu): their stores/atomics are performed when the kernel completes, before the next kernel on the
// stream (the barrier) starts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels.h"

namespace odc {
namespace {

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

// Copy: plain loads from one address this GPU can load, plain stores to another (fetch: the owner's memory
// through the peer pointer -> local memory; put_signal: local memory -> the peer through the peer pointer).
__global__ void peer_copy_kernel(TaskBatch b) {
    const int ti = blockIdx.x % b.ntasks;
    const int part = blockIdx.x / b.ntasks;
    const Task t = b.t[ti];
    const uint64_t stride = static_cast<uint64_t>(b.parts) * blockDim.x;
    const uint64_t first = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x;
    copy_bytes(reinterpret_cast<char*>(t.dst), reinterpret_cast<const char*>(t.src), t.n, first, stride);
}

// Push: dst (the owner's fp32 accumulator, through the peer pointer) += float(src) * scale.
// Exactness under concurrency: every update is a single system-scope hardware atomic performed at the owner's
// memory, so concurrent pushers from any number of PEs never lose an update; fp32 addition order may differ
// between runs.
template <typename T>
__global__ void push_atomic_kernel(TaskBatch b, float scale, bool vector_atomics) {
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

// Push, deterministic mode: dst (the owner's int64 fixed-point accumulator, through the peer pointer) += src,
// int64 sources already quantised on the host side (odc_runtime/deterministic.py), scale 1 (Plan::run refuses
// any other). Per element one system-scope 64-bit integer atomic on the unsigned reinterpretation: two's-complement
// addition modulo 2^64 is the int64 sum, and the fixed-point bound keeps every partial sum of a window inside
// int64, so nothing wraps. Integer addition is associative and commutative, so the final value is the same bits
// whatever order the concurrent pushers' atomics are performed in (the fp32 kernel above cannot promise that).
// Lost-update freedom is the fp32 kernel's argument: each add is a single atomic performed at the owner's memory.
__global__ void push_atomic_int64_kernel(TaskBatch b) {
    const int ti = blockIdx.x % b.ntasks;
    const int part = blockIdx.x / b.ntasks;
    const Task t = b.t[ti];
    unsigned long long* dst = reinterpret_cast<unsigned long long*>(t.dst);
    const unsigned long long* src = reinterpret_cast<const unsigned long long*>(t.src);
    const uint64_t stride = static_cast<uint64_t>(b.parts) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x; i < t.n; i += stride)
        atomicAdd_system(dst + i, src[i]);
}

// Split tasks into launches of at most kMaxTasks; `parts` per task so the grid is ~4 blocks per SM.
template <typename Launch>
void for_batches(const std::vector<Task>& tasks, uint64_t unit_per_block, int sms, Launch launch) {
    const int target_blocks = 4 * sms;
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

void launch_peer_copy(const std::vector<Task>& tasks, int sms, cudaStream_t s, const char* what) {
    for_batches(tasks, 64 * 1024, sms, [&](const TaskBatch& b, int blocks) {
        peer_copy_kernel<<<blocks, kThreads, 0, s>>>(b);
        check_launch(what);
    });
}

void launch_push_atomic(const std::vector<Task>& tasks, int dtype, float scale, bool vec, int sms, cudaStream_t s) {
    for_batches(tasks, 16 * 1024, sms, [&](const TaskBatch& b, int blocks) {
        switch (dtype) {
            case kInt64: push_atomic_int64_kernel<<<blocks, kThreads, 0, s>>>(b); break;
            case kFloat32: push_atomic_kernel<float><<<blocks, kThreads, 0, s>>>(b, scale, vec); break;
            case kBFloat16: push_atomic_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(b, scale, vec); break;
            default: push_atomic_kernel<__half><<<blocks, kThreads, 0, s>>>(b, scale, vec); break;
        }
        check_launch("push_atomic_kernel");
    });
}

}  // namespace odc
