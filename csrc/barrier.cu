// Own barrier and quiet (replace nvshmemx_barrier_all_on_stream, whose host part blocks the CPU until every PE
// arrives when several PEs share a GPU, and whose device part cannot be interrupted).
//
// State: epochs[q] in every PE's symmetric memory = the last barrier epoch PE q announced to this PE. Every PE
// calls the same barriers in the same order (the Python side numbers them), so epoch k means "barrier #k".
//
// Protocol of barrier #k on PE p (one block, thread t serves peers t, t + blockDim, ...):
//   1. release: thread 0 runs nvshmem_quiet() (this PE's device-initiated puts/AMOs are complete: the locked
//      push and staged fetch), then reads the abort word: if it is up, the kernel leaves at once, announcing
//      nothing and recording nothing (see "Never announce after an abort" below); else every thread runs
//      __threadfence_system();
//   2. announce: nvshmemx_signal_op(&epochs[p], k, SIGNAL_SET, q) for every q (a volatile store through the
//      peer pointer on NVLink, a network AMO otherwise);
//   3. wait: until epochs[q] >= k for every q (wait_or_abort); on abort, the first barrier kernel to give up
//      records its epoch and what every peer last announced into host-mapped memory, and leaves;
//   4. acquire: nvshmem_uint64_wait_until(&epochs[q], GE, k) (returns at once, and applies NVSHMEM's own
//      consistency step for data delivered by the network, in every release 3.3-3.8), then
//      __threadfence_system().
//
// Ordering argument. Everything PE q issued on its stream before barrier #k happens-before q's announcement:
// kernels on one stream run in order and a kernel's writes are performed before the next kernel starts; the
// quiet completes q's remote puts/AMOs (locked pushes); peer-pointer atomics of the fused push are performed
// when that kernel completes; and the system-scope fence makes all of them visible, cumulatively, before the
// announcing store. PE p observes the announcement (load of k) and then fences (acquire), so everything after
// barrier #k on p's stream sees those writes: the owner's accumulator holds every push issued before any PE's
// barrier, and a fetch after the barrier reads every owner's post-step parameters.
//
// Never announce after an abort. An announcement tells the peers "everything I issued before barrier #k is
// done", so a PE whose earlier work was cut short by the abort must not make it. Work cut short (a locked push
// whose lock wait gave up, a signal wait released before its count) read the abort word up before its kernel
// ended; this kernel starts after that kernel ended (same stream, or joined by an event) and reads the word after
// it: by coherence of the one host-mapped word it reads it up too, and leaves without announcing. An abort raised
// after the check concerns this barrier's own wait or later work: everything before it completed, so the
// announcement is true. The peers' barriers then wait for this PE until their own deadlines: the job fails with a
// timeout on every rank instead of one rank's gradient missing from a completed step. A barrier that started
// with the abort up records nothing either, so the host blames the operation that was late, not this barrier.
//
// Why it cannot deadlock. A PE announces before it waits, so barrier #k completes on every PE as soon as every PE
// has *started* its barrier #k kernel. A PE's barrier kernel starts once the work queued before it on its stream
// has finished; that work is our own kernels (copy, fused push: no waiting at all; locked push: waits only for a
// lock whose holder is resident and finishes after bounded, one-sided work; staged fetch: one-sided) and the
// user's kernels. So, with every PE alive and calling the same barriers, every barrier completes. A PE that is
// dead or never calls barrier #k leaves the others spinning, and that is what the abort word ends: the engine's
// deadline thread (engine.cu; no Python needed) raises it when the barrier's event is late, and every spinning
// kernel of this engine leaves within a poll period; the context stays usable. Epochs only grow and a PE cannot
// run more than one barrier ahead of the slowest (it would wait in it), so ">= k" never confuses rounds.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>

#include "kernels.h"

namespace odc {
namespace {

__global__ void barrier_kernel(uint64_t* epochs, uint64_t epoch, int me, int npes, const volatile uint32_t* abort,
                               unsigned* claim, Record* record) {
    __shared__ int s_gave_up;
    __shared__ int s_aborted;
    __shared__ unsigned s_first;
    if (threadIdx.x == 0) {
        s_gave_up = 0;
        nvshmem_quiet();
        s_aborted = abort_raised(abort);  // after the quiet, before any announcement (see above)
    }
    __syncthreads();
    if (s_aborted) return;  // uniform: every thread read the same shared flag
    __threadfence_system();
    for (int q = threadIdx.x; q < npes; q += blockDim.x) nvshmemx_signal_op(epochs + me, epoch, NVSHMEM_SIGNAL_SET, q);
    for (int q = threadIdx.x; q < npes; q += blockDim.x) {
        if (!wait_or_abort([&] { return nvshmem_signal_fetch(epochs + q) >= epoch; }, abort, 1024u)) {
            s_gave_up = 1;  // benign race: every writer stores 1
            break;
        }
    }
    __syncthreads();
    if (s_gave_up) {
        if (threadIdx.x == 0) s_first = atomicCAS(claim, 0u, 1u) == 0u;
        __syncthreads();
        if (!s_first) return;  // an earlier barrier kernel already recorded its facts
        volatile uint64_t* heard = record->heard;
        for (int q = threadIdx.x; q < npes; q += blockDim.x) heard[q] = nvshmem_signal_fetch(epochs + q);
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            *reinterpret_cast<volatile uint64_t*>(&record->barrier_epoch) = epoch;
            __threadfence_system();
        }
        return;
    }
    for (int q = threadIdx.x; q < npes; q += blockDim.x) nvshmem_uint64_wait_until(epochs + q, NVSHMEM_CMP_GE, epoch);
    __threadfence_system();
}

__global__ void quiet_kernel() { nvshmem_quiet(); }

}  // namespace

void launch_barrier(uint64_t* epochs, uint64_t epoch, int me, int npes, const volatile uint32_t* abort,
                    unsigned* claim, Record* record, cudaStream_t s) {
    const int threads = std::min(npes, 1024);
    barrier_kernel<<<1, threads < 32 ? 32 : threads, 0, s>>>(epochs, epoch, me, npes, abort, claim, record);
    check_launch("barrier_kernel");
}

void launch_quiet(cudaStream_t s) {
    quiet_kernel<<<1, 1, 0, s>>>();
    check_launch("quiet_kernel");
}

}  // namespace odc
