"""GPUs through NVML (``libnvidia-ml``, the library the NVIDIA driver ships), without torch.

Imported only when a question about GPUs is asked: ctypes is not free, and the config-only
commands never ask one.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping


def device_count() -> int:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except AttributeError:
        return 0
    return int(count.value) if ok else 0


class NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def visible_devices(env: Mapping[str, str]) -> list[int]:
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES as indices, or all)."""
    count = device_count()
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(count))
    entries = [e.strip() for e in listed.split(",") if e.strip()]
    return [int(e) for e in entries if e.isdigit() and int(e) < count]


def query(env: Mapping[str, str], query: str) -> list[tuple[int, ...]]:
    """Per visible GPU: its memory (``total``,) or its compute capability (major, minor), via NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    out: list[tuple[int, ...]] = []
    try:
        if nvml.nvmlInit_v2() != 0:
            return []
        for index in visible_devices(env):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            if query == "memory":
                memory = NvmlMemory()
                if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                    out.append((int(memory.total),))
            else:
                major, minor = ctypes.c_int(), ctypes.c_int()
                if (
                    nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))
                    == 0
                ):
                    out.append((major.value, minor.value))
        nvml.nvmlShutdown()
    except AttributeError:
        return []
    return out
