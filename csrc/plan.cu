// Plan: a precomputed transfer (odc_ext.h). Everything is validated at construction, so run() only forms
// addresses from the caller's base pointer and launches; its host cost is a few microseconds.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels.h"

namespace odc {

namespace {
bool push_kind(int kind) { return kind == kPushAtomic || kind == kPushLocked; }
}  // namespace

Plan::Plan(std::shared_ptr<Engine> engine, int kind, std::vector<uint64_t> addr, std::vector<uint64_t> rel,
           std::vector<uint64_t> numel, std::vector<int> pe, int acc_dtype)
    : engine_(std::move(engine)), kind_(kind), addr_(std::move(addr)), rel_(std::move(rel)),
      numel_(std::move(numel)), pe_(std::move(pe)), acc_dtype_(acc_dtype), acc_size_(0) {
    if (!engine_) throw Error("Plan: no engine");
    const size_t n = addr_.size();
    if (rel_.size() != n || numel_.size() != n || pe_.size() != n) throw Error("Plan: task lists differ in length");
    if (kind_ < kFetchCopy || kind_ > kPushLocked) throw Error("Plan: unknown kind " + std::to_string(kind_));
    if (push_kind(kind_)) {
        if (acc_dtype_ != kFloat32 && acc_dtype_ != kInt64)
            throw Error("Plan: accumulators are fp32 or int64, got dtype code " + std::to_string(acc_dtype_));
        acc_size_ = dtype_size(acc_dtype_);
    }
    for (size_t i = 0; i < n; ++i) {
        if (pe_[i] < 0 || pe_[i] >= engine_->npes()) throw Error("Plan: peer out of range");
        if (network_kind(kind_)) {
            // symmetric offsets: the element size of a fetch is only known at run(); the accumulator's bounds a push
            engine_->check_offset("Plan", addr_[i], kind_ == kPushLocked ? numel_[i] * acc_size_ : numel_[i]);
        } else if (addr_[i] == 0 && numel_[i] != 0) {
            throw Error("Plan: null address");
        }
        // natural alignment of the accumulator's elements: the atomics need it, and an int64 element then never
        // straddles two cells of the locked protocol (cell_bytes is a multiple of 16)
        if (push_kind(kind_) && addr_[i] % acc_size_ != 0)
            throw Error("Plan: accumulator address not " + std::to_string(acc_size_) + "-byte aligned");
    }
}

void Plan::run(uint64_t base, int dtype, float scale, uint64_t stream) const {
    require_init("Plan.run");
    if (engine_->aborted()) throw Error("the transport was aborted after a timeout; restart the job");
    const uint64_t es = dtype_size(dtype);
    if (push_kind(kind_)) {
        // Only exact mixes reach a kernel: int64 into int64 with scale 1 (deterministic mode), floats into fp32.
        if ((acc_dtype_ == kInt64) != (dtype == kInt64))
            throw Error("Plan.run: an int64 accumulator takes int64 sources only, an fp32 one fp32/bf16/fp16 (source "
                        "dtype code " + std::to_string(dtype) + ", accumulator " + std::to_string(acc_dtype_) + ")");
        if (dtype == kInt64 && scale != 1.0f) throw Error("Plan.run: int64 pushes take scale 1 (exact adds)");
    }
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
            launch_peer_copy(tasks, engine_->sm_count(), s, "peer_copy_kernel (fetch)");
            return;
        }
        case kPushAtomic: {
            std::vector<Task> tasks(n);
            for (size_t i = 0; i < n; ++i) tasks[i] = Task{addr_[i], base + rel_[i] * es, numel_[i]};
            launch_push_atomic(tasks, dtype, scale, engine_->vector_atomics(), engine_->sm_count(), s);
            return;
        }
        case kPushLocked:
        case kFetchStaged: {
            // One launch for all owners (up to kMaxTasks per launch); block 0 of rank r starts at item
            // r * total / npes, so concurrent pushers start on different cells and locks.
            const uint64_t cell = engine_->cell_bytes();
            const bool push = kind_ == kPushLocked;
            for (size_t first = 0; first < n; first += kMaxTasks) {
                CellBatch b{};
                for (size_t i = first; i < std::min(n, first + kMaxTasks); ++i) {
                    if (numel_[i] == 0) continue;
                    const uint64_t size = push ? numel_[i] : numel_[i] * es;  // push: accumulator elements; fetch: bytes
                    if (!push) engine_->check_offset("Plan.run", addr_[i], size);
                    // push: cells of the owner's arena the range touches (cut at symmetric offsets); fetch: pieces
                    const uint64_t items = push ? (addr_[i] + size * acc_size_ - 1) / cell - addr_[i] / cell + 1
                                                : (size + cell - 1) / cell;
                    b.t[b.ntasks++] = CellTask{addr_[i], base + rel_[i] * es, size, b.total, pe_[i]};
                    b.total += items;
                }
                if (b.ntasks == 0) continue;
                b.rotate = b.total * static_cast<uint64_t>(engine_->rank()) / engine_->npes();
                const int blocks = static_cast<int>(std::min<uint64_t>(b.total, engine_->scratch_slots()));
                if (push) {
                    launch_push_locked(b, blocks, dtype, scale, engine_->heap(), cell, as_ptr<char>(engine_->scratch()),
                                       as_ptr<unsigned>(engine_->locks()), engine_->nlocks(), engine_->abort_dev(), s);
                } else {
                    launch_fetch_staged(b, blocks, engine_->heap(), as_ptr<char>(engine_->scratch()), cell, s);
                }
            }
            return;
        }
        default:
            throw Error("Plan.run: unknown kind");
    }
}

}  // namespace odc
