// Engine: control state of the job (odc_ext.h) and the host side of the barrier, quiet and signalled-put
// protocols (their kernels and ordering arguments: barrier.cu, signal.cu), plus the deadline thread.
//
// Deadline thread. watch() records a CUDA event on the stream after the watched operation; one thread per engine
// polls the oldest event (cudaEventQuery never blocks) and raises the abort word when it is late. It needs no
// Python and no GIL, so the abort is raised even when every Python thread is blocked (for instance inside a
// launch that waits for room in a launch queue that the stuck barrier filled). It only ever raises the abort;
// the Python watchdog turns what the kernels recorded into the error message. Watches complete in issue order
// (the Python side keeps at most one barrier in flight), so only the oldest needs polling.
//
// Graph capture. cudaEventQuery is an operation a stream capture prohibits: in the default (global) capture mode
// of the calling thread, a query made while *any* thread captures a CUDA graph in global mode fails and
// invalidates that capture (a user's torch.cuda.graph, a colocated rollout engine). Every query here
// (query_event: the deadline thread and the Python watchdog) runs in the thread-local capture mode, which ignores
// other threads' captures, and a capture-related return is never taken for a failure of the watched work: the
// query is retried at the next poll, the deadline still bounds it.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "kernels.h"

namespace odc {

bool capture_related(int code) {
    switch (static_cast<cudaError_t>(code)) {
        case cudaErrorStreamCaptureUnsupported:
        case cudaErrorStreamCaptureInvalidated:
        case cudaErrorStreamCaptureMerge:
        case cudaErrorStreamCaptureUnmatched:
        case cudaErrorStreamCaptureUnjoined:
        case cudaErrorStreamCaptureIsolation:
        case cudaErrorStreamCaptureImplicit:
        case cudaErrorCapturedEvent:
        case cudaErrorStreamCaptureWrongThread:
            return true;
        default:
            return false;
    }
}

int event_state(int code) {
    if (code == cudaSuccess) return kEventDone;
    if (code == cudaErrorNotReady || capture_related(code)) return kEventPending;
    return kEventFailed;
}

namespace {
// cudaEventQuery in the thread-local capture mode (restored afterwards); the raw return code.
cudaError_t query_local(cudaEvent_t ev) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
    const cudaError_t set = cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t q = cudaEventQuery(ev);
    if (set == cudaSuccess) cudaThreadExchangeStreamCaptureMode(&mode);
    if (q != cudaSuccess && q != cudaErrorNotReady && capture_related(q)) cudaGetLastError();  // not sticky
    return q;
}
}  // namespace

int query_event(uint64_t event) {
    const cudaError_t q = query_local(reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(event)));
    const int state = event_state(q);
    if (state == kEventFailed)
        throw Error(std::string("cudaEventQuery failed: ") + cudaGetErrorName(q) + " (" + cudaGetErrorString(q) + ")");
    return state;
}

struct Engine::State {
    // host-mapped: [0] abort word (uint32), then a Record (8-byte aligned) with npes heard values
    volatile uint32_t* ctl_host = nullptr;
    uint32_t* ctl_dev = nullptr;
    unsigned* claim_dev = nullptr;  // [0] barrier, [1] signal wait: who records first (device memory)
    std::atomic<uint64_t> next_wait{0};

    std::mutex mu;
    std::condition_variable cv;
    struct Watch {
        cudaEvent_t event;
        std::chrono::steady_clock::time_point deadline;
    };
    std::deque<Watch> watches;
    bool stop = false;
    std::atomic<bool> expired{false};
    std::thread thread;

    Record* record_dev() const { return reinterpret_cast<Record*>(ctl_dev + 2); }
    const volatile Record* record_host() const { return reinterpret_cast<const volatile Record*>(ctl_host + 2); }
};

Engine::Engine(int rank, int npes, uint64_t epochs, uint64_t locks, int nlocks, uint64_t scratch, int scratch_slots,
               uint64_t cell_bytes, bool vector_atomics, uint64_t heap_base, uint64_t heap_bytes)
    : rank_(rank), npes_(npes), epochs_(epochs), locks_(locks), nlocks_(nlocks), scratch_(scratch),
      scratch_slots_(scratch_slots), cell_bytes_(cell_bytes), vector_atomics_(vector_atomics), heap_base_(heap_base),
      heap_bytes_(heap_bytes), state_(new State) {
    require_init("Engine");
    if (npes < 1 || rank < 0 || rank >= npes) throw Error("Engine: bad rank/npes");
    if (!epochs || !locks || !scratch || nlocks < 1 || scratch_slots < 1 || cell_bytes == 0 || cell_bytes % 16)
        throw Error("Engine: bad symmetric control buffers or scratch configuration");
    if (!heap_base || !heap_bytes) throw Error("Engine: no heap arena");
    ODC_CUDA_CHECK(cudaGetDevice(&device_));
    ODC_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));  // once, not per launch
    void* host = nullptr;
    const size_t bytes = 2 * sizeof(uint32_t) + sizeof(Record) + static_cast<size_t>(npes) * sizeof(uint64_t);
    ODC_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, bytes);
    void* dev = nullptr;
    cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
    if (err == cudaSuccess) err = cudaMalloc(&state_->claim_dev, 2 * sizeof(unsigned));
    if (err == cudaSuccess) err = cudaMemset(state_->claim_dev, 0, 2 * sizeof(unsigned));
    if (err != cudaSuccess) {
        cudaFreeHost(host);
        ODC_CUDA_CHECK(err);
    }
    ODC_CUDA_CHECK(cudaDeviceSynchronize());  // the claim words are zero before any kernel of ours runs
    state_->ctl_host = static_cast<volatile uint32_t*>(host);
    state_->ctl_dev = static_cast<uint32_t*>(dev);
    abort_dev_ = state_->ctl_dev;
}

Engine::~Engine() {
    // Never block here (a destructor may run at interpreter exit while a kernel still spins): raise the abort so
    // that any kernel of this engine leaves, stop the deadline thread (it never blocks: event queries only), and
    // leave the mapped page to process teardown (a kernel may still read it).
    if (state_->ctl_host != nullptr) state_->ctl_host[0] = 1;
    {
        std::lock_guard<std::mutex> lk(state_->mu);
        state_->stop = true;
    }
    state_->cv.notify_all();
    if (state_->thread.joinable()) state_->thread.join();
    for (auto& w : state_->watches) cudaEventDestroy(w.event);
}

void Engine::check_offset(const char* what, uint64_t offset, uint64_t bytes) const {
    if (offset > heap_bytes_ || bytes > heap_bytes_ - offset)
        throw Error(std::string(what) + ": symmetric offset range [" + std::to_string(offset) + ", +" +
                    std::to_string(bytes) + ") outside the heap arena of " + std::to_string(heap_bytes_) + " bytes");
}

void Engine::barrier(uint64_t epoch, uint64_t stream) {
    require_init("barrier");
    // The kernel would not announce anyway (barrier.cu); refusing here tells the caller now.
    if (aborted()) throw Error("the transport was aborted after a timeout; restart the job");
    launch_barrier(as_ptr<uint64_t>(epochs_), epoch, rank_, npes_, abort_dev_, state_->claim_dev,
                   state_->record_dev(), as_stream(stream));
}

void Engine::quiet(uint64_t stream) {
    require_init("quiet");
    launch_quiet(as_stream(stream));
}

void Engine::watch(uint64_t stream, double timeout_s) {
    State& st = *state_;
    cudaEvent_t ev = nullptr;
    ODC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t err = cudaEventRecord(ev, as_stream(stream));
    if (err != cudaSuccess) {
        cudaEventDestroy(ev);
        ODC_CUDA_CHECK(err);
    }
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(std::max(0.0, timeout_s)));
    {
        std::lock_guard<std::mutex> lk(st.mu);
        st.watches.push_back({ev, deadline});
        if (!st.thread.joinable()) {
            st.thread = std::thread([this] {
                State& s = *state_;
                cudaSetDevice(device_);  // events belong to this device's primary context
                std::unique_lock<std::mutex> lock(s.mu);
                while (!s.stop) {
                    if (s.watches.empty()) {
                        s.cv.wait(lock);
                        continue;
                    }
                    const State::Watch w = s.watches.front();
                    lock.unlock();
                    const int state = event_state(query_local(w.event));
                    const bool late = std::chrono::steady_clock::now() > w.deadline;
                    lock.lock();
                    if (state == kEventDone) {
                        cudaEventDestroy(w.event);
                        s.watches.pop_front();
                        continue;
                    }
                    if (state == kEventFailed || late) {  // a CUDA error or a late operation: release every wait
                        s.expired = late;
                        s.ctl_host[0] = 1;
                        std::atomic_thread_fence(std::memory_order_seq_cst);
                        return;  // the abort word is never lowered: nothing more to watch
                    }
                    s.cv.wait_for(lock, std::chrono::milliseconds(1));
                }
            });
        }
    }
    st.cv.notify_all();
}

void Engine::set_abort() {
    state_->ctl_host[0] = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool Engine::aborted() const { return state_->ctl_host[0] != 0; }
size_t Engine::watching() const {
    std::lock_guard<std::mutex> lk(state_->mu);
    return state_->watches.size();
}
bool Engine::deadline_passed() const { return state_->expired.load(); }
uint64_t Engine::barrier_gave_up() const { return state_->record_host()->barrier_epoch; }

std::vector<uint64_t> Engine::heard() const {
    const volatile uint64_t* h = state_->record_host()->heard;
    std::vector<uint64_t> out(npes_);
    for (int i = 0; i < npes_; ++i) out[i] = h[i];
    return out;
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
        if (((remote[i] == 0 && near[i]) || local[i] == 0) && bytes[i] != 0) throw Error("put_signal: null address");
        if (!near[i]) check_offset("put_signal", remote[i], bytes[i]);
        if (sig[i] % sizeof(uint64_t) != 0) throw Error("put_signal: bad signal word offset");
        check_offset("put_signal (signal word)", sig[i], sizeof(uint64_t));
    }
    cudaStream_t s = as_stream(stream);
    // 1. data: peer-pointer copies in one SM kernel, network puts from the symmetric source in another
    std::vector<Task> tasks;
    for (size_t i = 0; i < n; ++i)
        if (near[i] && bytes[i] != 0) tasks.push_back(Task{remote[i], local[i], bytes[i]});
    launch_peer_copy(tasks, sm_count_, s, "put_signal (peer copy)");
    for (size_t first = 0; first < n;) {
        CellBatch b{};
        for (; first < n && b.ntasks < kMaxTasks; ++first) {
            if (near[first] || bytes[first] == 0) continue;
            b.t[b.ntasks++] = CellTask{remote[first], local[first], bytes[first], b.total, pe[first]};
            b.total += (bytes[first] + cell_bytes_ - 1) / cell_bytes_;
        }
        if (b.ntasks == 0) continue;
        b.rotate = b.total * static_cast<uint64_t>(rank_) / npes_;
        launch_put_nbi(b, static_cast<int>(std::min<uint64_t>(b.total, static_cast<uint64_t>(sm_count_))), heap(),
                       cell_bytes_, s);
    }
    // 2. quiet + fence + one signal add per request (see the ordering argument in signal.cu)
    for (size_t first = 0; first < n; first += kMaxTasks) {
        SignalBatch b{};
        for (size_t i = first; i < std::min(n, first + kMaxTasks); ++i) {
            b.sig[b.n] = sig[i];
            b.pe[b.n++] = pe[i];
        }
        launch_signal(b, heap(), abort_dev_, s);
    }
}

uint64_t Engine::wait_signal(uint64_t sig, uint64_t value, uint64_t stream) {
    require_init("wait_signal");
    if (aborted()) throw Error("the transport was aborted after a timeout; restart the job");
    if (sig % sizeof(uint64_t) != 0) throw Error("wait_signal: bad signal word offset");
    check_offset("wait_signal", sig, sizeof(uint64_t));
    const uint64_t id = ++state_->next_wait;
    launch_wait_signal(as_ptr<uint64_t>(heap_base_ + sig), value, id, abort_dev_, state_->claim_dev + 1,
                       state_->record_dev(), as_stream(stream));
    return id;
}

uint64_t Engine::wait_gave_up() const { return state_->record_host()->wait_id; }
uint64_t Engine::wait_seen() const { return state_->record_host()->wait_seen; }

}  // namespace odc
