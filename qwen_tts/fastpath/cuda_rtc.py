"""CUDA C++ compiled at run time with NVRTC and launched on PyTorch's current stream, through the driver API.

The kernels that Triton cannot express (explicit asynchronous copies into shared memory, stack_cuda.cu) are
compiled here on first use: NVRTC ships with PyTorch's CUDA wheels (libnvrtc), so a server needs no compiler and
no build step. A launch goes to `torch.cuda.current_stream()`, so CUDA graph capture records it like any other
kernel. PyTorch has a private helper for this (`torch.cuda._compile_kernel`), but its launch signature and its
shared-memory setting changed between releases; this module keeps the few calls we need in one place.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

import torch

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("cluster", ctypes.c_uint * 3), ("align", ctypes.c_void_p)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padded to 8 bytes, then the value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("nattrs", ctypes.c_uint),
    ]


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for base in sys.path:  # pip's CUDA wheels: site-packages/nvidia/<part or cuNN>/lib
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"NVRTC (libnvrtc.so.{major}) not found: install PyTorch's CUDA build or the CUDA toolkit")


@functools.cache
def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: {msg.value.decode() if msg.value else result}")


class Kernel:
    """A compiled kernel: `launch(grid, block, args, shared_bytes)` on the current stream; args are ctypes values."""

    def __init__(self, module: ctypes.c_void_p, func: ctypes.c_void_p, name: str) -> None:
        self._module, self._func, self.name = module, func, name
        self._shared = 0
        self._non_portable = False

    def set_max_shared(self, nbytes: int) -> None:
        """Allow this many bytes of dynamic shared memory a block (above 48 KiB needs the opt-in)."""
        if nbytes > self._shared:
            _check(
                _cuda().cuFuncSetAttribute(self._func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"cuFuncSetAttribute({self.name}, {nbytes} bytes of shared memory)",
            )
            self._shared = nbytes

    def _config(self, grid: int, block: int, shared_bytes: int, cluster: int) -> tuple:
        """A CUlaunchConfig on the current stream, with `cluster` blocks a cluster (and the attribute it points to,
        which must outlive the call)."""
        self.set_max_shared(shared_bytes)
        attr = _LaunchAttribute()
        attr.id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.cluster[:] = [cluster, 1, 1]
        if cluster > 8 and not self._non_portable:  # more than the portable 8 blocks need the function's opt-in
            _check(
                _cuda().cuFuncSetAttribute(self._func, _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                f"cuFuncSetAttribute({self.name}, non-portable cluster size)",
            )
            self._non_portable = True
        cfg = _LaunchConfig()
        cfg.grid[:] = [grid, 1, 1]
        cfg.block[:] = [block, 1, 1]
        cfg.shared = shared_bytes
        cfg.stream = torch.cuda.current_stream().cuda_stream
        cfg.attrs = ctypes.pointer(attr)
        cfg.nattrs = 1
        return cfg, attr

    def max_active_clusters(self, cluster: int, block: int, shared_bytes: int) -> int:
        """How many clusters of `cluster` blocks (of `block` threads and `shared_bytes` of dynamic shared memory) the
        device can hold at once (cuOccupancyMaxActiveClusters): a cluster's blocks share one GPC, so this can be
        fewer than the SMs over `cluster`."""
        cfg, _attr = self._config(cluster, block, shared_bytes, cluster)
        n = ctypes.c_int()
        _check(
            _cuda().cuOccupancyMaxActiveClusters(ctypes.byref(n), self._func, ctypes.byref(cfg)),
            f"cuOccupancyMaxActiveClusters({self.name}, {cluster})",
        )
        return n.value

    def launch(self, grid: int, block: int, args: list, shared_bytes: int = 0, cluster: int = 0) -> None:
        """Launch on the current stream; `cluster` > 0: in clusters of that many blocks (cuLaunchKernelEx)."""
        self.set_max_shared(shared_bytes)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        if cluster:
            cfg, _attr = self._config(grid, block, shared_bytes, cluster)
            _check(_cuda().cuLaunchKernelEx(ctypes.byref(cfg), self._func, params, None), f"launching {self.name}")
            return
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(
            _cuda().cuLaunchKernel(self._func, grid, 1, 1, block, 1, 1, shared_bytes, stream, params, None),
            f"launching {self.name}",
        )


def compile_kernel(source: str, name: str, device: torch.device) -> Kernel:
    """`name` (an extern "C" __global__ function of `source`) compiled for `device`'s architecture and loaded there."""
    major, minor = torch.cuda.get_device_capability(device)
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
        raise RuntimeError(f"nvrtcCreateProgram({name}) failed")
    try:
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
        if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"compiling {name} failed:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    with torch.cuda.device(device):
        torch.zeros(1, device=device)  # the device's primary context current on this thread
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        _check(_cuda().cuModuleLoadData(ctypes.byref(module), cubin), f"loading {name}")
        _check(_cuda().cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"finding {name}")
    return Kernel(module, func, name)
