// Signalled puts (the hierarchical push across nodes, odc_runtime/hierarchy.py): signal and wait kernels.
//
// Built from public NVSHMEM *device* APIs that exist, with the same signatures, in every release from 3.3
// through 3.8 (checked in the 3.4.5 and 3.8.0 headers: nvshmemx_putmem_nbi_block, nvshmem_quiet,
// nvshmemx_signal_op with NVSHMEM_SIGNAL_ADD, nvshmem_signal_fetch, nvshmem_uint64_wait_until), launched as our
// own kernels, not through NVSHMEM's host *_on_stream wrappers: those launch with NVSHMEM's own CUDA runtime
// (their launch errors are invisible to check_launch) and cannot be interrupted, while our wait polls the
// engine's abort word like every other wait here.
//
// put_signal on PE p (engine.cu), stream-ordered, kernels on one stream:
//   1. data: for peers with a peer pointer (same node) an SM copy through the peer pointer (peer.cu); for the
//      others (across nodes) nvshmemx_putmem_nbi_block per cell from the symmetric source (cells.cu);
//   2. signal_kernel (one block): thread 0 runs nvshmem_quiet() (every put of step 1, and every other
//      device-initiated operation of this PE, is complete: delivered at the target) and reads the abort word;
//      if it is up the kernel leaves without signalling (a signal announces data like a barrier announces an
//      epoch, and data put after an operation the abort cut short may be derived from what never arrived: the
//      same coherence argument as in barrier.cu); else every thread runs __threadfence_system(), then
//      nvshmemx_signal_op(&sig[index], 1, NVSHMEM_SIGNAL_ADD, q) per request.
// Ordering argument (data delivered before the signal is visible). Step 1's peer-pointer stores are performed
// when its kernel completes, before step 2 starts (same stream); the quiet completes the network puts; the
// system-scope fence orders all of them, cumulatively, before the signal AMO, which is only *issued* after that.
// So when the owner observes the count, every byte of every put counted in it is already in its memory. The
// waiter then runs nvshmem_uint64_wait_until (returns at once, and applies NVSHMEM's consistency step for
// network-delivered data; nvshmem_signal_wait_until does not in 3.4.5, only from 3.8) and a system-scope fence
// (acquire): kernels after it on the stream see the data.
// Signal words only grow (ADD 1 per put; the caller compares against running counts), so no reset races a put.
// Why it cannot deadlock: put_signal waits for nothing but its own one-sided operations (quiet completes without
// code running on any other PE); wait_signal waits for puts that other PEs issue without waiting on us, and when
// they never come (a dead or stuck peer) the abort word is raised at the deadline and the wait leaves.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "kernels.h"

namespace odc {
namespace {

__global__ void signal_kernel(SignalBatch b, char* heap, const volatile uint32_t* abort) {
    __shared__ int s_aborted;
    if (threadIdx.x == 0) {
        nvshmem_quiet();
        s_aborted = abort_raised(abort);
    }
    __syncthreads();
    if (s_aborted) return;  // no signal after an abort: the peer's wait times out instead of accepting the data
    __threadfence_system();
    for (int i = threadIdx.x; i < b.n; i += blockDim.x)
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(heap + b.sig[i]), 1, NVSHMEM_SIGNAL_ADD, b.pe[i]);
}

// Waits until this PE's signal word reaches `value` or the abort word is raised. On abort the first wait kernel
// to give up (claim word) records its id and the count it saw (host-mapped) and leaves; the host compares the id
// with the wait whose deadline passed, so a later wait released by the same abort never overwrites those facts.
__global__ void wait_signal_kernel(uint64_t* sig, uint64_t value, uint64_t id, const volatile uint32_t* abort,
                                   unsigned* claim, Record* record) {
    uint64_t seen = 0;
    if (!wait_or_abort([&] { return (seen = nvshmem_signal_fetch(sig)) >= value; }, abort, 1024u)) {
        if (atomicCAS(claim, 0u, 1u) == 0u) {
            *reinterpret_cast<volatile uint64_t*>(&record->wait_seen) = seen;
            __threadfence_system();
            *reinterpret_cast<volatile uint64_t*>(&record->wait_id) = id;
            __threadfence_system();
        }
        return;
    }
    nvshmem_uint64_wait_until(sig, NVSHMEM_CMP_GE, value);
    __threadfence_system();
}

}  // namespace

void launch_signal(const SignalBatch& b, char* heap, const volatile uint32_t* abort, cudaStream_t s) {
    signal_kernel<<<1, 64, 0, s>>>(b, heap, abort);
    check_launch("signal_kernel");
}

void launch_wait_signal(uint64_t* sig, uint64_t value, uint64_t id, const volatile uint32_t* abort, unsigned* claim,
                        Record* record, cudaStream_t s) {
    wait_signal_kernel<<<1, 1, 0, s>>>(sig, value, id, abort, claim, record);
    check_launch("wait_signal_kernel");
}

}  // namespace odc
