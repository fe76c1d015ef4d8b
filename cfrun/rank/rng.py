"""Process-global RNG states: torch CPU, CUDA (every device, when initialized), python, numpy."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def get_global_rng() -> dict[str, Any]:
    """Copies of every global RNG state this process uses. Call on the training thread."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_global_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`get_global_rng`; states missing from ``state`` are left as they are."""
    torch.set_rng_state(state["torch"])
    rnd = state["random"]
    random.setstate((rnd[0], tuple(rnd[1]), rnd[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
