"""This process's random number generators, saved and restored: torch's CPU generator, numpy's and
Python's global ones, and the accelerator's (any type, through its device module)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from zeroshard.accelerator import current_accelerator_type


def get_state() -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` reads back: torch's
    CPU generator, numpy's and python's global ones, and the accelerator's (any type: its device
    module's ``get_rng_state_all``) once it is initialized."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
        "accelerator": None,
    }
    module = _accelerator_module()
    if module is not None:
        state["accelerator"] = (current_accelerator_type(), module.get_rng_state_all())
    return state


def _accelerator_module():
    """The device module (``torch.cuda``, ``torch.npu``, ...) of this process's accelerator when
    it is initialized and has per-device RNG states; else None."""
    kind = current_accelerator_type()
    if kind is None:
        return None
    module = torch.get_device_module(kind)
    initialized = getattr(module, "is_initialized", lambda: False)()
    return module if initialized and hasattr(module, "get_rng_state_all") else None


def set_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])
    saved = state.get("accelerator")
    module = _accelerator_module() if saved is not None else None
    same_devices = module is not None and saved[0] == current_accelerator_type()
    if same_devices and len(saved[1]) == module.device_count():  # each device its own stream
        module.set_rng_state_all(saved[1])
