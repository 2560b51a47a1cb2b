"""What code that times or places work needs to know about devices."""

import os
import platform
import time
from pathlib import Path

import torch


def compute_device() -> torch.device:
    """Where a single-process job (evaluation, fine-tuning, export) runs: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def memory_capacity(device: torch.device) -> tuple[int, str] | None:
    """(bytes one process may hold on ``device``, the device in words), or None where it is not known.

    A GPU's whole memory; on CPU the host's memory (a container's limit if lower) shared by
    the processes launched on this host (torchrun sets LOCAL_WORLD_SIZE).
    """
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return properties.total_memory, f"this GPU ({properties.name})"
    if device.type == "cpu":
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        share = f" split between {processes} processes" if processes > 1 else ""
        return _host_memory() // processes, f"this host's memory{share}"
    return None


def _host_memory() -> int:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            return min(physical, int(text))
    return physical


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so a clock read afterwards includes it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """perf_counter() after the device's queued work has finished."""
    synchronize(device)
    return time.perf_counter()


def cpu_features() -> dict:
    """What this CPU offers for training, as torch sees it: the flags a log names beside a figure.

    Hosts of one machine type differ: some have AMX tiles (bf16 matmuls 3-8x fp32), others
    no bf16 units at all (bf16 10-100x slower). Named here, never decided on: what precision
    pays is timed (train/launch.py, cpu_bf16_speedup).
    """
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return {
        "model": capabilities.get("cpu_name") or platform.processor() or "unknown",
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        **{flag: bool(capabilities.get(flag)) for flag in ("avx512_f", "avx512_bf16", "amx_bf16")},
    }


def describe_cpu() -> str:
    """One line: the CPU's model, the flags that matter and torch's kernel level."""
    features = cpu_features()
    flags = ", ".join(f"{flag} {'yes' if features[flag] else 'no'}" for flag in ("avx512_f", "avx512_bf16", "amx_bf16"))
    return f"CPU {features['model']} ({flags}; torch kernels {features['torch_capability']})"
