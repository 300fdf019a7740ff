// pybind11 bindings of odc_runtime._C. Compiled by the host compiler; everything CUDA/NVSHMEM lives in the .cu
// files. odc::Error becomes odc_runtime._C.NvshmemError (a RuntimeError subclass).
//
// GIL: every binding that can wait releases it (`release`): a kernel launch or event record blocks inside the
// driver when the stream's launch queue is full (behind a barrier that waits for a dead peer, for instance),
// and holding the GIL there would stop every Python thread, the watchdog included. tests/test_extension.py
// checks this list against the bindings. Only the non-blocking reads of host-mapped words keep the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "odc_ext.h"
#include "odc_version.h"

namespace py = pybind11;
using release = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(_C, m) {
    m.doc() = "odc_runtime NVSHMEM extension: symmetric memory, own barrier with abort, fetch and push plans";
    py::register_exception<odc::Error>(m, "NvshmemError", PyExc_RuntimeError);

    m.attr("DTYPE_FLOAT32") = static_cast<int>(odc::kFloat32);
    m.attr("DTYPE_BFLOAT16") = static_cast<int>(odc::kBFloat16);
    m.attr("DTYPE_FLOAT16") = static_cast<int>(odc::kFloat16);
    m.attr("DTYPE_INT64") = static_cast<int>(odc::kInt64);
    m.attr("PLAN_FETCH_COPY") = static_cast<int>(odc::kFetchCopy);
    m.attr("PLAN_FETCH_KERNEL") = static_cast<int>(odc::kFetchKernel);
    m.attr("PLAN_FETCH_STAGED") = static_cast<int>(odc::kFetchStaged);
    m.attr("PLAN_PUSH_ATOMIC") = static_cast<int>(odc::kPushAtomic);
    m.attr("PLAN_PUSH_LOCKED") = static_cast<int>(odc::kPushLocked);

    m.attr("EVENT_DONE") = static_cast<int>(odc::kEventDone);
    m.attr("EVENT_PENDING") = static_cast<int>(odc::kEventPending);
    m.attr("EVENT_FAILED") = static_cast<int>(odc::kEventFailed);
    m.def("capture_related", &odc::capture_related, py::arg("code"),
          "whether a cudaError_t code comes from a stream capture in progress (never a failure of watched work)");
    m.def("event_state", &odc::event_state, py::arg("code"), "EVENT_* for a cudaEventQuery return code");
    m.def("query_event", &odc::query_event, py::arg("event"),
          "cudaEventQuery in the thread-local capture mode: EVENT_DONE or EVENT_PENDING; raises on a CUDA error",
          release());

    m.def("nvshmem_version_compiled", &odc::nvshmem_version_compiled,
          "(major, minor, patch) of the NVSHMEM headers and device library this extension was built against");
    m.def("nvshmem_version_runtime", &odc::nvshmem_version_runtime,
          "(major, minor, patch) of the libnvshmem_host.so.3 loaded in this process");
    m.def("device_count", &odc::device_count, "CUDA devices visible to this process (0 without GPU/driver)");
    m.def("mps_enabled", &odc::mps_enabled, py::arg("device"),
          "1 if contexts on the device are shared via CUDA MPS, 0 if not, -1 if the runtime cannot tell");
    m.def("get_unique_id", []() {
        std::string uid;
        {
            py::gil_scoped_release nogil;
            uid = odc::get_unique_id();
        }
        return py::bytes(uid);
    });
    m.def("init", [](py::bytes uid, int rank, int nranks, int device) {
        odc::init(std::string(uid), rank, nranks, device);
    }, py::arg("uid"), py::arg("rank"), py::arg("nranks"), py::arg("device"), release());
    m.def("malloc", &odc::malloc_, py::arg("bytes"), release());
    m.def("ptr", &odc::ptr, py::arg("addr"), py::arg("pe"));
    m.def("p2p_atomics", &odc::p2p_atomics, release());

    py::class_<odc::Engine, std::shared_ptr<odc::Engine>>(m, "Engine")
        .def(py::init<int, int, uint64_t, uint64_t, int, uint64_t, int, uint64_t, bool, uint64_t, uint64_t>(),
             py::arg("rank"), py::arg("npes"), py::arg("epochs"), py::arg("locks"), py::arg("nlocks"),
             py::arg("scratch"), py::arg("scratch_slots"), py::arg("cell_bytes"), py::arg("vector_atomics"),
             py::arg("heap_base"), py::arg("heap_bytes"), release())
        .def("barrier", &odc::Engine::barrier, py::arg("epoch"), py::arg("stream"), release())
        .def("quiet", &odc::Engine::quiet, py::arg("stream"), release())
        .def("watch", &odc::Engine::watch, py::arg("stream"), py::arg("timeout_s"), release())
        .def("set_abort", &odc::Engine::set_abort)
        .def("aborted", &odc::Engine::aborted)
        .def("watching", &odc::Engine::watching, release())
        .def("deadline_passed", &odc::Engine::deadline_passed)
        .def("barrier_gave_up", &odc::Engine::barrier_gave_up)
        .def("heard", &odc::Engine::heard)
        .def("put_signal", &odc::Engine::put_signal, py::arg("remote"), py::arg("local"), py::arg("bytes"),
             py::arg("pe"), py::arg("near"), py::arg("sig"), py::arg("stream"), release())
        .def("wait_signal", &odc::Engine::wait_signal, py::arg("sig"), py::arg("value"), py::arg("stream"), release())
        .def("wait_gave_up", &odc::Engine::wait_gave_up)
        .def("wait_seen", &odc::Engine::wait_seen);

    py::class_<odc::Plan>(m, "Plan")
        .def(py::init<std::shared_ptr<odc::Engine>, int, std::vector<uint64_t>, std::vector<uint64_t>,
                      std::vector<uint64_t>, std::vector<int>, int>(),
             py::arg("engine"), py::arg("kind"), py::arg("addr"), py::arg("rel"), py::arg("numel"), py::arg("pe"),
             py::arg("acc_dtype") = static_cast<int>(odc::kFloat32), release())
        .def("run", &odc::Plan::run, py::arg("base"), py::arg("dtype"), py::arg("scale"), py::arg("stream"), release())
        .def_property_readonly("kind", &odc::Plan::kind);
}
