// Plain C++ interface between the pybind11 bindings (bindings.cpp, compiled by the host compiler) and the
// CUDA/NVSHMEM code (the .cu files, compiled by nvcc). Pointers and cudaStream_t travel as integers so the
// extension never links torch. Every failure is reported by throwing odc::Error, never by exit().
//
// After init the extension makes no NVSHMEM host call at all (no malloc/free, no host or on-stream
// collective): all device work is launched by our own kernels through our own CUDA runtime, so every launch
// and CUDA error is checked here, and every wait a peer can block (barrier, lock spins, signal waits) polls an
// abort word in host-mapped memory that the engine's deadline thread raises. Every binding that can block (a
// launch into a full queue, init, malloc) releases the GIL (bindings.cpp).
//
// Source layout: runtime.cu (init), engine.cu (Engine), plan.cu (Plan), one file per device protocol
// (kernels.h lists them), common.cuh (checks, task descriptors, the abort-poll helper), bindings.cpp.
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

// dtype codes, exported to Python as _C.DTYPE_* (odc_runtime/transport/nvshmem/extension.py reads them).
// kInt64: deterministic mode's fixed-point pushes (int64 sources into an int64 accumulator, scale 1, exact).
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt64 = 3 };

// What a Plan does (exported as _C.PLAN_*).
enum PlanKind : int {
    kFetchCopy = 0,    // copy engines: cudaMemcpyAsync from peer pointers
    kFetchKernel = 1,  // one SM copy kernel over all peer pointers
    kFetchStaged = 2,  // no peer pointer (across nodes): device get into the symmetric scratch, copy out
    kPushAtomic = 3,   // fused cast*scale*atomic-add through peer pointers
    kPushLocked = 4,   // ticket lock + get + add + put per cell (multi-node protocol), cells by symmetric offset
};
inline bool network_kind(int kind) { return kind == kFetchStaged || kind == kPushLocked; }

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

// Event queries that cannot break a CUDA graph capture in another thread (engine.cu has why). What a return code
// of cudaEventQuery means for a watched operation (exported as _C.EVENT_*):
enum EventState : int { kEventDone = 0, kEventPending = 1, kEventFailed = 2 };
// A code that a stream capture in progress produces (this thread's, or another thread's in the global capture
// mode): never a failure of the watched work.
bool capture_related(int code);
int event_state(int code);  // EventState of a cudaError_t code
// cudaEventQuery(event) in the thread-local capture mode: kEventDone or kEventPending; throws on a CUDA error.
int query_event(uint64_t event);

// Engine: the job's control state. `epochs` (npes uint64), `locks` (2 * nlocks uint32) and `scratch`
// (scratch_slots * cell_bytes) are symmetric allocations made at init; `heap_base`/`heap_bytes` are this PE's
// arena (every symmetric offset passed to the engine and to plans is relative to it). The abort word and the
// records of what the first kernel that gave up saw live in host-mapped memory owned by the engine. A deadline
// thread of the engine (no Python) polls the events of watched operations and raises the abort word when one
// is late, so a dead peer cannot hang this process even while Python is blocked.
class Engine {
  public:
    Engine(int rank, int npes, uint64_t epochs, uint64_t locks, int nlocks, uint64_t scratch, int scratch_slots,
           uint64_t cell_bytes, bool vector_atomics, uint64_t heap_base, uint64_t heap_bytes);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Own barrier, stream-ordered: completes this PE's NVSHMEM operations, announces `epoch` to every PE, waits
    // until every PE announced >= epoch or the abort word is set.
    void barrier(uint64_t epoch, uint64_t stream);
    // Completes this PE's outstanding device-initiated NVSHMEM operations (stream-ordered, one thread).
    void quiet(uint64_t stream);
    // The deadline thread raises the abort word unless the work queued on `stream` so far completes within
    // `timeout_s` seconds (watches complete in the order they were made).
    void watch(uint64_t stream, double timeout_s);
    void set_abort();               // every waiting kernel of this engine leaves within microseconds
    bool aborted() const;           // the abort word is set
    size_t watching() const;        // watched operations whose completion the deadline thread has not yet seen
    bool deadline_passed() const;   // the deadline thread raised it
    uint64_t barrier_gave_up() const;  // epoch of the first barrier kernel that left because of the abort (0: none)
    // Last epoch each peer had announced to us when that barrier kernel gave up.
    std::vector<uint64_t> heard() const;

    // Signalled puts (hierarchical push across nodes): per request, write `bytes` from `local` (this PE's device
    // memory; inside the symmetric heap when !near[i]) to the peer pe[i] at `remote` (the peer pointer when
    // near[i], else the symmetric offset), then add 1 to the signal word at symmetric offset sig[i] on that PE
    // once the data is delivered. Stream-ordered.
    void put_signal(const std::vector<uint64_t>& remote, const std::vector<uint64_t>& local,
                    const std::vector<uint64_t>& bytes, const std::vector<int>& pe, const std::vector<bool>& near,
                    const std::vector<uint64_t>& sig, uint64_t stream);
    // The stream waits until this PE's signal word at symmetric offset `sig` is >= value (acquire), or the abort
    // word is set. Returns the wait's id (> 0); wait_gave_up() is the id of the first wait that left because of
    // the abort (0: none) and wait_seen() the count it saw then.
    uint64_t wait_signal(uint64_t sig, uint64_t value, uint64_t stream);
    uint64_t wait_gave_up() const;
    uint64_t wait_seen() const;

    int rank() const { return rank_; }
    int npes() const { return npes_; }
    int sm_count() const { return sm_count_; }
    uint64_t scratch() const { return scratch_; }
    int scratch_slots() const { return scratch_slots_; }
    uint64_t cell_bytes() const { return cell_bytes_; }
    uint64_t locks() const { return locks_; }
    int nlocks() const { return nlocks_; }
    bool vector_atomics() const { return vector_atomics_; }
    char* heap() const { return reinterpret_cast<char*>(static_cast<uintptr_t>(heap_base_)); }
    uint64_t heap_bytes() const { return heap_bytes_; }
    const volatile uint32_t* abort_dev() const { return abort_dev_; }
    // Throws unless [offset, offset + bytes) lies inside the arena.
    void check_offset(const char* what, uint64_t offset, uint64_t bytes) const;

  private:
    struct State;  // host-mapped control page, claim words, deadline thread (engine.cu)
    int rank_, npes_, device_ = 0, sm_count_ = 0;
    uint64_t epochs_, locks_;
    int nlocks_;
    uint64_t scratch_;
    int scratch_slots_;
    uint64_t cell_bytes_;
    bool vector_atomics_;
    uint64_t heap_base_, heap_bytes_;
    const volatile uint32_t* abort_dev_ = nullptr;
    std::unique_ptr<State> state_;
};

// A precomputed transfer: per task the peer's address (the peer pointer for the copy, kernel and atomic kinds)
// or its symmetric offset in the arena (the staged and locked kinds, which use NVSHMEM network operations), the element offset in the caller's tensor, the element count and the peer. run(base,
// dtype, ...) addresses the caller's tensor as base + rel * sizeof(dtype) (fetch: the buffer's dtype; push: the
// gradient's dtype) and launches; its host cost is a few microseconds. Push kinds: `acc_dtype` is the
// accumulator's element type, kFloat32 (sources fp32/bf16/fp16, cast * scale, fp32 add) or kInt64 (sources int64
// only, scale 1: an exact integer add); run() refuses any other mix before launching. Fetch kinds ignore it.
class Plan {
  public:
    Plan(std::shared_ptr<Engine> engine, int kind, std::vector<uint64_t> addr, std::vector<uint64_t> rel,
         std::vector<uint64_t> numel, std::vector<int> pe, int acc_dtype = kFloat32);
    void run(uint64_t base, int dtype, float scale, uint64_t stream) const;
    int kind() const { return kind_; }

  private:
    std::shared_ptr<Engine> engine_;
    int kind_;
    std::vector<uint64_t> addr_, rel_, numel_;
    std::vector<int> pe_;
    int acc_dtype_;
    uint64_t acc_size_;  // bytes per accumulator element (push kinds)
};

}  // namespace odc
