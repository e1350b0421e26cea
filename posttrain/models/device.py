"""Where a run computes: the `device` config key turned into a torch.device, checked up front.

    device=auto     cuda (GPU 0) when torch sees a CUDA GPU, else cpu
    device=cpu      always the CPU
    device=cuda     GPU 0; cuda:N for GPU N. Refused with a clear message when CUDA is absent.

Code below the recipes never assumes a device: it reads it from the tensors it gets (`x.device`)
and takes CPU-only fast paths (oneDNN packing, fused CPU kernels, malloc tuning) only when that
device is the CPU.
"""

from __future__ import annotations

import re

import torch

from posttrain.errors import UserError

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


def _cuda_missing(name: str) -> str:
    build = torch.version.cuda or "none (a CPU-only build)"
    return (f"device={name}: CUDA is not available here (torch {torch.__version__}, CUDA build: {build}); "
            f"use device=cpu or device=auto")


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' (or a torch.device) -> torch.device; UserError if unusable."""
    text = str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", text)
    if m is None:
        raise UserError(f"unknown device '{name}': use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UserError(_cuda_missing(text))
    index = int(m.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise UserError(f"device={text}: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0..)")
    return torch.device("cuda", index)


def is_cpu(x: str | torch.device | torch.Tensor) -> bool:
    """True if `x` (a device, its name, or a tensor) is on the CPU."""
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    return device.type == "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (for timing); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
