// Host-side launchers of the device protocols, one .cu file per protocol, each with its ordering argument and
// why it cannot deadlock next to the kernel:
//   barrier.cu  own barrier (epochs, release/acquire, abort) and quiet
//   peer.cu     peer-pointer copy and fused cast*scale*atomic-add push, int64 atomic-add push (one NVLink domain)
//   cells.cu    cell protocols over NVSHMEM network operations: locked push, staged fetch, network put
//   signal.cu   signalled puts: quiet + fence + signal add, and the signal wait
// Every launcher checks its launch (odc::Error); every wait for another PE goes through wait_or_abort
// (common.cuh). Launchers never block the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common.cuh"

namespace odc {

// What a kernel that gave up because of the abort leaves for the host (host-mapped, see Engine). Only the first
// kernel of each kind writes (a claim word in device memory decides), so later waits released by the same abort
// never overwrite the facts of the first one.
struct Record {
    uint64_t barrier_epoch;  // barrier kernel that gave up (0: none)
    uint64_t wait_id;        // signal wait that gave up (0: none)
    uint64_t wait_seen;      // the count it saw then
    uint64_t heard[1];       // [npes]: what each peer had announced when the barrier gave up
};

// barrier.cu
void launch_barrier(uint64_t* epochs, uint64_t epoch, int me, int npes, const volatile uint32_t* abort,
                    unsigned* claim, Record* record, cudaStream_t s);
void launch_quiet(cudaStream_t s);

// peer.cu; `sms`: the device's SM count (the grid is about 4 blocks per SM)
void launch_peer_copy(const std::vector<Task>& tasks, int sms, cudaStream_t s, const char* what);
// dtype kInt64: int64 sources into an int64 accumulator, exact (scale unused: Plan::run refused scale != 1)
void launch_push_atomic(const std::vector<Task>& tasks, int dtype, float scale, bool vector_atomics, int sms,
                        cudaStream_t s);

// cells.cu; `heap` is this PE's arena base (CellTask.offset is relative to it), `scratch` holds one cell per
// block (blocks <= scratch slots); push: `dtype` kInt64 adds int64 into an int64 accumulator (scale 1), every
// other code casts * scale into an fp32 one (Plan::run checked the mix)
void launch_push_locked(const CellBatch& b, int blocks, int dtype, float scale, char* heap, uint64_t cell_bytes,
                        char* scratch, unsigned* locks, int nlocks, const volatile uint32_t* abort, cudaStream_t s);
void launch_fetch_staged(const CellBatch& b, int blocks, char* heap, char* scratch, uint64_t cell_bytes,
                         cudaStream_t s);
void launch_put_nbi(const CellBatch& b, int blocks, char* heap, uint64_t cell_bytes, cudaStream_t s);

// signal.cu; signal words are symmetric offsets in the arena
struct SignalBatch {
    int n;
    uint64_t sig[kMaxTasks];
    int pe[kMaxTasks];
};
void launch_signal(const SignalBatch& b, char* heap, const volatile uint32_t* abort, cudaStream_t s);
void launch_wait_signal(uint64_t* sig, uint64_t value, uint64_t id, const volatile uint32_t* abort, unsigned* claim,
                        Record* record, cudaStream_t s);

// Element size of a dtype code (throws on an unknown code).
uint64_t dtype_size(int dtype);

}  // namespace odc
