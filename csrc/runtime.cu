// NVSHMEM lifecycle (init-time only): device queries, unique id, init with its status checked, the init-time
// symmetric allocations, peer pointers, and NVSHMEM's job-wide load/store-atomics decision. After init no NVSHMEM
// host function is called (engine.cu and plan.cu launch our own kernels).
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

#include "common.cuh"
#include "odc_compat.cuh"

namespace odc {

namespace {
bool g_initialized = false;

// NVSHMEM's own job-wide decision (allgathered over all PEs at init) whether every PE reaches every other by
// load/store *atomics* (NVLink, or PCIe P2P with native atomics). When it is false, NVSHMEM itself routes every
// AMO, even to same-node peers, through the network transport, because NIC atomics are only atomic with
// respect to other NIC atomics, not to GPU atomics on the same word.
// (The predicate lives in NVSHMEM's device headers, which are only visible in the device compilation pass;
// odc_compat.cuh picks the form that exists in the NVSHMEM version compiled against.)
__global__ void p2p_atomics_kernel(int* out) {
#ifdef __CUDA_ARCH__
    *out = compat::ldst_atomics_path() ? 1 : 0;
#endif
}
}  // namespace

void check_launch(const char* what) {
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        throw Error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
    }
}

void require_init(const char* what) {
    if (!g_initialized) throw Error(std::string(what) + ": NVSHMEM is not initialised (call init first)");
}

uint64_t dtype_size(int dtype) {
    switch (dtype) {
        case kInt64: return 8;
        case kFloat32: return 4;
        case kBFloat16:
        case kFloat16: return 2;
        default: throw Error("unknown dtype code " + std::to_string(dtype));
    }
}

int device_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device / no driver" error
        return 0;
    }
    return n;
}

int mps_enabled(int device) {
    // cudaDevAttrMpsEnabled (133) exists from CUDA 12.x runtimes on; older ones answer cudaErrorInvalidValue.
    int v = 0;
    cudaError_t err = cudaDeviceGetAttribute(&v, static_cast<cudaDeviceAttr>(133), device);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return v ? 1 : 0;
}

std::string get_unique_id() {
    if (device_count() == 0) throw Error("get_unique_id: no CUDA device is visible");
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    ODC_NVSHMEM_CHECK(nvshmemx_get_uniqueid(&uid));
    return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

void init(const std::string& uid_bytes, int rank, int nranks, int device) {
    if (g_initialized) throw Error("init: NVSHMEM is already initialised in this process");
    // Validate everything we can before NVSHMEM sees it: some of its internal failures still exit().
    const int ndev = device_count();
    if (ndev == 0) throw Error("init: no CUDA device is visible (NVSHMEM needs a GPU)");
    if (device < 0 || device >= ndev)
        throw Error("init: device " + std::to_string(device) + " out of range (" + std::to_string(ndev) + " visible)");
    if (nranks < 1 || rank < 0 || rank >= nranks) throw Error("init: bad rank/nranks");
    if (uid_bytes.size() != sizeof(nvshmemx_uniqueid_t))
        throw Error("init: unique id has " + std::to_string(uid_bytes.size()) + " bytes, expected " +
                    std::to_string(sizeof(nvshmemx_uniqueid_t)));
    ODC_CUDA_CHECK(cudaSetDevice(device));
    ODC_CUDA_CHECK(cudaFree(nullptr));  // create / bind the primary context now, with a checked status
    nvshmemx_uniqueid_t uid;
    std::memcpy(&uid, uid_bytes.data(), sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    ODC_NVSHMEM_CHECK(nvshmemx_set_attr_uniqueid_args(rank, nranks, &uid, &attr));
    // nvshmemx_init_attr() is a static inline wrapper that exit()s on failure: call what it calls and throw.
    int provided = 0;
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    ODC_NVSHMEM_CHECK(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID,
                                           &attr, version));
    // nvshmemi_init_thread returns 0 even when the common init behind it failed (nvshmemi_try_common_init
    // swallows the error, and the first nvshmem_malloc would then call NVSHMEM's error exit): the public status
    // (nvshmemx_init_status, in every release 3.3-3.8) says whether the PE is really initialised.
    const int status = nvshmemx_init_status();
    if (status < NVSHMEM_STATUS_IS_INITIALIZED || status == NVSHMEM_STATUS_INVALID) {
        throw Error("init: NVSHMEM did not finish initialising (nvshmemx_init_status() = " + std::to_string(status) +
                    ", expected >= NVSHMEM_STATUS_IS_INITIALIZED); its log says why (run with NVSHMEM_DEBUG=WARN): "
                    "typically no usable transport between the GPUs or too little memory for the symmetric heap "
                    "(NVSHMEM_SYMMETRIC_SIZE)");
    }
    g_initialized = true;
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks) {
        throw Error("init: NVSHMEM PE numbering (" + std::to_string(nvshmem_my_pe()) + "/" +
                    std::to_string(nvshmem_n_pes()) + ") differs from the requested rank " +
                    std::to_string(rank) + "/" + std::to_string(nranks));
    }
}

uint64_t malloc_(uint64_t bytes) {
    require_init("malloc");
    void* p = nvshmem_malloc(static_cast<size_t>(bytes));
    if (p == nullptr && bytes > 0) throw Error("nvshmem_malloc(" + std::to_string(bytes) + ") returned NULL");
    // nvshmem_malloc ends in a barrier that may launch work with NVSHMEM's own runtime; make sure it went well.
    ODC_CUDA_CHECK(cudaDeviceSynchronize());
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

uint64_t ptr(uint64_t addr, int pe) {
    require_init("ptr");
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(nvshmem_ptr(as_ptr<void>(addr), pe)));
}

bool p2p_atomics() {
    require_init("p2p_atomics");
    int* d = nullptr;
    int h = 0;
    ODC_CUDA_CHECK(cudaMalloc(&d, sizeof(int)));
    p2p_atomics_kernel<<<1, 1>>>(d);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d);
    ODC_CUDA_CHECK(err);
    return h != 0;
}

}  // namespace odc
