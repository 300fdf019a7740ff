// pybind11 bindings of odc_runtime._C. Compiled by the host compiler; everything CUDA/NVSHMEM lives in
// odc_nvshmem.cu. odc::Error becomes odc_runtime._C.NvshmemError (a RuntimeError subclass).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "odc_ext.h"
#include "odc_version.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "odc_runtime NVSHMEM extension: symmetric memory, peer pointers, fetch and push kernels";
    py::register_exception<odc::Error>(m, "NvshmemError", PyExc_RuntimeError);

    m.attr("DTYPE_FLOAT32") = static_cast<int>(odc::kFloat32);
    m.attr("DTYPE_BFLOAT16") = static_cast<int>(odc::kBFloat16);
    m.attr("DTYPE_FLOAT16") = static_cast<int>(odc::kFloat16);

    m.def("nvshmem_version_compiled", &odc::nvshmem_version_compiled,
          "(major, minor, patch) of the NVSHMEM headers and device library this extension was built against");
    m.def("nvshmem_version_runtime", &odc::nvshmem_version_runtime,
          "(major, minor, patch) of the libnvshmem_host.so.3 loaded in this process");
    m.def("device_count", &odc::device_count, "CUDA devices visible to this process (0 without GPU/driver)");
    m.def("get_unique_id", []() { return py::bytes(odc::get_unique_id()); });
    m.def("init", [](py::bytes uid, int rank, int nranks, int device) {
        odc::init(std::string(uid), rank, nranks, device);
    }, py::arg("uid"), py::arg("rank"), py::arg("nranks"), py::arg("device"));
    m.def("initialized", &odc::initialized);
    m.def("my_pe", &odc::my_pe);
    m.def("n_pes", &odc::n_pes);
    m.def("team_shared_n_pes", &odc::team_shared_n_pes);
    m.def("malloc", &odc::malloc_, py::arg("bytes"));
    m.def("free", &odc::free_, py::arg("ptr"));
    m.def("ptr", &odc::ptr, py::arg("addr"), py::arg("pe"));
    m.def("p2p_atomics", &odc::p2p_atomics);
    m.def("barrier_all", &odc::barrier_all, py::call_guard<py::gil_scoped_release>());
    m.def("barrier_all_on_stream", &odc::barrier_all_on_stream, py::arg("stream"));
    m.def("quiet_on_stream", &odc::quiet_on_stream, py::arg("stream"));
    m.def("buffer_register", &odc::buffer_register, py::arg("addr"), py::arg("bytes"));
    m.def("buffer_unregister", &odc::buffer_unregister, py::arg("addr"));
    m.def("finalize", &odc::finalize, py::call_guard<py::gil_scoped_release>());
    m.def("fetch_p2p", &odc::fetch_p2p, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"));
    m.def("get_staged", &odc::get_staged, py::arg("dst"), py::arg("src_sym"), py::arg("nbytes"), py::arg("pe"),
          py::arg("scratch"), py::arg("scratch_bytes"), py::arg("stream"));
    m.def("accumulate_p2p", &odc::accumulate_p2p, py::arg("dst"), py::arg("src"), py::arg("numel"),
          py::arg("src_dtype"), py::arg("scale"), py::arg("vector_atomics"), py::arg("stream"));
    m.def("accumulate_locked", &odc::accumulate_locked, py::arg("dst_sym"), py::arg("src"), py::arg("numel"),
          py::arg("src_dtype"), py::arg("scale"), py::arg("pe"), py::arg("scratch"), py::arg("scratch_bytes"),
          py::arg("cell_bytes"), py::arg("locks"), py::arg("nlocks"), py::arg("stream"));
}
