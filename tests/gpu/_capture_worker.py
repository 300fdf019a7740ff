"""Worker for tests/gpu/test_capture_gpu.py (issue 33, finding 2): one rank syncs in a loop (every barrier watched
by the engine's deadline thread and the Python watchdog, which query its event about every millisecond) while
another thread captures CUDA graphs in the *global* capture mode, torch.cuda.graph's default. The watchers query
in the thread-local mode, so no capture may be invalidated and no sync may fail.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=... MASTER_PORT=... python _capture_worker.py RESULT.json

The backend is ``ODC_GPU_TEST_BACKEND`` (default ``nvshmem``; ``symm``: its watchdog thread watches each sync).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import odc_runtime as odc

SECONDS = 8.0


def main() -> None:
    out = sys.argv[1]
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    odc.init(os.environ.get("ODC_GPU_TEST_BACKEND", "nvshmem"), heap_size="64M")
    st = odc.shard(torch.zeros(1 << 16, device="cuda"), name="w")
    grad = torch.ones(1 << 16, device="cuda")  # allocated before the captures start (no cudaMalloc during them)
    x = torch.ones(1 << 12, device="cuda")
    torch.cuda.synchronize()
    stop = threading.Event()
    result: dict = {"captures": 0, "capture_errors": [], "syncs": 0, "error": None}

    def capture() -> None:
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="global"):  # warm the graph pool
            y = x * 2
        while not stop.is_set():
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="global"):
                    y = x * 2
                    for _ in range(200):  # a capture that lasts long enough to overlap many queries
                        y = y + 1
                graph.replay()
                result["captures"] += 1
            except Exception as e:  # reported, not raised: the test asserts on it
                result["capture_errors"].append(f"{type(e).__name__}: {e}"[:300])

    # A daemon thread, stopped in `finally`: a failure of this thread must not leave the process waiting on it.
    thread = threading.Thread(target=capture, name="user-graph-capture", daemon=True)
    thread.start()
    end = time.monotonic() + SECONDS
    try:
        while time.monotonic() < end:
            odc.push(st, grad)
            odc.sync()
            result["syncs"] += 1
        # Stop the captures before this thread synchronizes the device: global capture mode forbids a device-wide
        # synchronize from any thread while a capture is open (cudaErrorStreamCaptureUnsupported), by design.
        stop.set()
        thread.join(timeout=60)
        odc.sync()
        torch.cuda.synchronize()
    except odc.OdcError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop.set()
        thread.join(timeout=60)
    result["capture_thread_stopped"] = not thread.is_alive()
    if result["error"] is None:
        result["grad_ok"] = bool(torch.all(st.grad == result["syncs"]).item())
    with open(out, "w") as f:
        json.dump(result, f)
    odc.finalize()


if __name__ == "__main__":
    main()
