"""Native host functions as steps of a device stream: a CUDA graph with the host's work inside it.

:mod:`ninfer.program.host_steps` cuts a captured forward wherever Python must run on the host part-way through.
Work the host can do without Python (a C function of a plugin's native library, taking one pointer) can instead
be queued on the stream itself: the driver calls it once the stream's earlier work is done, and the stream's later
work waits until it returns (``cuLaunchHostFunc``). Queued during a capture it becomes a host node of the graph,
so the forward stays one graph and its replay needs no Python between the device's work and the host's.

Invariants (the driver's rules for host functions):
- the function makes no CUDA call and never waits for later work of any stream: it would deadlock the stream;
- it cannot return an error: it records failures where its caller reads them;
- what it reads must have been written before it on the stream (by a kernel or copy queued earlier), and what it
  writes is read by work queued after it: host memory the device reads or writes in place (page-locked, unified
  addressing), so no copy is queued around it;
- on the CPU there is no stream: :func:`launch_host_fn` calls the function at once, on the calling thread.
"""

from __future__ import annotations

import ctypes
import threading

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_driver: ctypes.CDLL | None = None
_driver_lock = threading.Lock()


class HostCallError(RuntimeError):
    """The CUDA driver refused to queue a host function (its error named)."""


def _cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library (``libcuda.so.1``), loaded once, ``cuLaunchHostFunc`` typed."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise HostCallError(f"host functions on a CUDA stream need the CUDA driver (libcuda.so.1), which "
                                    f"does not load here: {exc}") from None
            lib.cuLaunchHostFunc.restype = ctypes.c_int
            lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cuGetErrorString.restype = ctypes.c_int
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver = lib
        return _driver


def launch_host_fn(fn: int, arg: int, device: torch.device) -> None:
    """Queue ``fn(arg)`` (the address of a C function ``void fn(void *)`` and its argument) on ``device``'s current
    stream, as a host node if that stream is being captured (module docstring); on the CPU, call it now."""
    if device.type == "cpu":
        _HOST_FN(fn)(arg)
        return
    if device.type != "cuda":
        raise HostCallError(f"host functions run on CUDA streams or on the CPU, not on {device}")
    driver = _cuda_driver()
    stream = torch.cuda.current_stream(device).cuda_stream
    status = driver.cuLaunchHostFunc(stream, fn, arg)
    if status != 0:
        name = ctypes.c_char_p()
        driver.cuGetErrorString(status, ctypes.byref(name))
        raise HostCallError(f"cuLaunchHostFunc failed with CUDA driver error {status} "
                            f"({(name.value or b'unknown').decode()})")
