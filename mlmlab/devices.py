"""What code that times or places work needs to know about devices."""

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so a clock read afterwards includes it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """perf_counter() after the device's queued work has finished."""
    synchronize(device)
    return time.perf_counter()
