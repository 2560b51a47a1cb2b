"""What code that times or places work needs to know about devices."""

import platform
import time

import torch


def compute_device() -> torch.device:
    """Where a single-process job (evaluation, fine-tuning, export) runs: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so a clock read afterwards includes it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """perf_counter() after the device's queued work has finished."""
    synchronize(device)
    return time.perf_counter()


def cpu_features() -> dict:
    """What this CPU offers for training, as torch sees it: the flags that decide fp32 vs bf16 speed.

    Hosts of one machine type differ: some have AMX tiles (bf16 matmuls 3-5x fp32), others
    no bf16 units at all (bf16 10-100x slower). Detected, never assumed.
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
