// Plain C++ interface between the pybind11 bindings (bindings.cpp, compiled by the host compiler) and the
// CUDA/NVSHMEM code (odc_nvshmem.cu, compiled by nvcc). Pointers and cudaStream_t travel as integers so the
// extension never links torch. Every failure is reported by throwing odc::Error, never by exit().
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace odc {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// dtype codes shared with odc_runtime/transport/nvshmem.py
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// -- host / lifecycle --------------------------------------------------------------------------------
std::string get_unique_id();  // raw bytes of nvshmemx_uniqueid_t
void init(const std::string& uid, int rank, int nranks, int device);
bool initialized();
int my_pe();
int n_pes();
int team_shared_n_pes();
uint64_t malloc_(uint64_t bytes);
void free_(uint64_t ptr);
uint64_t ptr(uint64_t addr, int pe);  // 0 when pe is not reachable by loads/stores
// True when NVSHMEM decided (job-wide, the same on every PE) that every PE reaches every other PE with
// load/store atomics; only then may pushes use plain GPU atomics through peer pointers.
bool p2p_atomics();
void barrier_all();
void barrier_all_on_stream(uint64_t stream);
void quiet_on_stream(uint64_t stream);
void buffer_register(uint64_t addr, uint64_t bytes);
void buffer_unregister(uint64_t addr);
void finalize();
int device_count();  // cudaGetDeviceCount, 0 (not an error) when there is no GPU/driver

// -- data movement (all stream-ordered on `stream`) -------------------------------------------------------
// Intra-node fetch: dst[i][0:nbytes[i]) = src[i][...] where src[i] is a peer pointer (from ptr()).
void fetch_p2p(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
               const std::vector<uint64_t>& nbytes, uint64_t stream);
// Inter-node fetch: get `nbytes` from symmetric `src_sym` on `pe` into ordinary device memory `dst`,
// staged through the symmetric scratch buffer [scratch, scratch + scratch_bytes).
void get_staged(uint64_t dst, uint64_t src_sym, uint64_t nbytes, int pe, uint64_t scratch,
                uint64_t scratch_bytes, uint64_t stream);
// Intra-node push: dst[i][0:n[i]) += float(src[i]) * scale with atomics through peer pointers (fp32 dst).
void accumulate_p2p(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                    const std::vector<uint64_t>& numel, int src_dtype, float scale, bool vector_atomics,
                    uint64_t stream);
// Inter-node push: lock + get + add + put on lock cells of `cell_bytes` (see odc_nvshmem.cu).
void accumulate_locked(uint64_t dst_sym, uint64_t src, uint64_t numel, int src_dtype, float scale, int pe,
                       uint64_t scratch, uint64_t scratch_bytes, uint64_t cell_bytes, uint64_t locks,
                       int nlocks, uint64_t stream);

}  // namespace odc
