// Plain C++ interface between the pybind11 bindings (bindings.cpp, compiled by the host compiler) and the
// CUDA/NVSHMEM code (odc_nvshmem.cu, compiled by nvcc). Pointers and cudaStream_t travel as integers so the
// extension never links torch. Every failure is reported by throwing odc::Error, never by exit().
//
// After init the extension makes no NVSHMEM host call at all (no malloc/free, no host or on-stream
// collective): all device work is launched by our own kernels through our own CUDA runtime, so every launch
// and CUDA error is checked here, and every wait a peer can block (barrier, lock spins, signal waits) polls an abort word in
// host-mapped memory that the Python watchdog raises at the deadline.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace odc {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// dtype codes, exported to Python as _C.DTYPE_* (odc_runtime/transport/nvshmem.py reads them from there)
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// What a Plan does (exported as _C.PLAN_*).
enum PlanKind : int {
    kFetchCopy = 0,    // copy engines: cudaMemcpyAsync from peer pointers
    kFetchKernel = 1,  // one SM copy kernel over all peer pointers
    kFetchStaged = 2,  // no peer pointer (across nodes): device get into the symmetric scratch, copy out
    kPushAtomic = 3,   // fused cast*scale*atomic-add through peer pointers
    kPushLocked = 4,   // ticket lock + get + add + put per cell (multi-node protocol)
};

// -- lifecycle (init-time only) -----------------------------------------------------------------------------
int device_count();              // cudaGetDeviceCount, 0 (not an error) when there is no GPU/driver
int mps_enabled(int device);     // 1: contexts on `device` are shared via MPS, 0: not, -1: unknown
std::string get_unique_id();     // raw bytes of nvshmemx_uniqueid_t
void init(const std::string& uid, int rank, int nranks, int device);
uint64_t malloc_(uint64_t bytes);        // collective; init only
uint64_t ptr(uint64_t addr, int pe);     // 0 when pe is not reachable by loads/stores
// True when NVSHMEM decided (job-wide, the same on every PE) that every PE reaches every other PE with
// load/store atomics; only then may pushes use plain GPU atomics through peer pointers.
bool p2p_atomics();

// Engine: the job's control state. `epochs` (npes uint64), `locks` (2 * nlocks uint32) and `scratch`
// (slots * cell_bytes) are symmetric allocations made at init; the abort word and the record of what each
// peer last announced live in host-mapped memory owned by the engine.
class Engine {
  public:
    Engine(int rank, int npes, uint64_t epochs, uint64_t locks, int nlocks, uint64_t scratch, int slots,
           uint64_t cell_bytes, bool vector_atomics);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Own barrier, stream-ordered: completes this PE's NVSHMEM operations, announces `epoch` to every PE, waits
    // until every PE announced >= epoch or the abort word is set. Never blocks the host.
    void barrier(uint64_t epoch, uint64_t stream);
    // Completes this PE's outstanding device-initiated NVSHMEM operations (stream-ordered, one thread).
    void quiet(uint64_t stream);
    void set_abort();               // every waiting kernel of this engine leaves within microseconds
    bool aborted() const;           // the abort word is set
    bool barrier_gave_up() const;   // a barrier kernel left because of the abort
    // Last epoch each peer had announced to us when a barrier kernel gave up (valid if barrier_gave_up()).
    std::vector<uint64_t> heard() const;

    // Signalled puts (hierarchical push across nodes): per request, write `bytes` from `local` (this PE's device
    // memory; inside the symmetric heap when !near[i]) to `remote` (the peer pointer when near[i], else the
    // symmetric address) on PE pe[i], then add 1 to the signal word at symmetric address sig[i] on that PE once
    // the data is delivered. Stream-ordered, never blocks the host.
    void put_signal(const std::vector<uint64_t>& remote, const std::vector<uint64_t>& local,
                    const std::vector<uint64_t>& bytes, const std::vector<int>& pe, const std::vector<bool>& near,
                    const std::vector<uint64_t>& sig, uint64_t stream);
    // The stream waits until this PE's signal word at `sig` is >= value (acquire), or the abort word is set (then
    // wait_gave_up() and wait_seen() tell what it last saw). Never blocks the host.
    void wait_signal(uint64_t sig, uint64_t value, uint64_t stream);
    bool wait_gave_up() const;  // a wait_signal kernel left because of the abort
    uint64_t wait_seen() const;  // the count it saw then (valid if wait_gave_up())

    int rank() const { return rank_; }
    int npes() const { return npes_; }

    // Launch helpers used by Plan.
    uint64_t scratch() const { return scratch_; }
    int slots() const { return slots_; }
    uint64_t cell_bytes() const { return cell_bytes_; }
    uint64_t locks() const { return locks_; }
    int nlocks() const { return nlocks_; }
    bool vector_atomics() const { return vector_atomics_; }
    const volatile uint32_t* abort_dev() const { return abort_dev_; }

  private:
    volatile uint64_t* wait_record_dev() const {
        return reinterpret_cast<volatile uint64_t*>(ctl_dev_ + 2) + npes_;
    }
    const volatile uint64_t* wait_record_host() const {
        return reinterpret_cast<const volatile uint64_t*>(ctl_host_ + 2) + npes_;
    }

    int rank_, npes_;
    uint64_t epochs_, locks_;
    int nlocks_;
    uint64_t scratch_;
    int slots_;
    uint64_t cell_bytes_;
    bool vector_atomics_;
    // host-mapped: [0] abort word, [1] "a barrier gave up"; then npes uint64 "heard" values; then 2 uint64:
    // "a signal wait gave up", the count it saw
    volatile uint32_t* ctl_host_ = nullptr;
    uint32_t* ctl_dev_ = nullptr;
    const volatile uint32_t* abort_dev_ = nullptr;
};

// A precomputed transfer: per task the peer's address (peer pointer, or the symmetric address for the staged
// and locked kinds), the element offset in the caller's tensor, the element count and the peer. run(base,
// dtype, ...) addresses the caller's tensor as base + rel * sizeof(dtype) (fetch: the buffer's dtype; push: the
// gradient's dtype, the accumulator being fp32) and launches; its host cost is a few microseconds.
class Plan {
  public:
    Plan(std::shared_ptr<Engine> engine, int kind, std::vector<uint64_t> addr, std::vector<uint64_t> rel,
         std::vector<uint64_t> numel, std::vector<int> pe);
    void run(uint64_t base, int dtype, float scale, uint64_t stream) const;
    int kind() const { return kind_; }

  private:
    std::shared_ptr<Engine> engine_;
    int kind_;
    std::vector<uint64_t> addr_, rel_, numel_;
    std::vector<int> pe_;
};

}  // namespace odc
