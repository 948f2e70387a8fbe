"""Which device a rank computes on and which collective backend serves it: the one place that
decides, through PyTorch's device-generic layer (``torch.accelerator``) rather than ``torch.cuda``.

The device is an explicit ``device=`` ("cuda", "npu", "xpu", "cpu", optionally with an index),
else the accelerator ``torch.accelerator.current_accelerator()`` reports, else the CPU. The
backend is an explicit ``backend=``, else the default for the device type:

| device | default backend | status in this project                                      |
|--------|-----------------|-------------------------------------------------------------|
| cpu    | gloo            | run: the whole test suite                                   |
| cuda   | nccl            | mapped; not yet run on hardware here                        |
| npu    | hccl            | mapped (``import torch_npu`` registers npu and HCCL); not run |
| xpu    | xccl            | mapped (XPU builds of torch >= 2.8); not run                |
| mps    | none            | found automatically: CPU with gloo, and a warning;          |
|        |                 | asked for (``device="mps"``): a ValueError                  |

MPS has no ``torch.distributed`` backend: gloo moves CPU tensors only, and nccl, hccl and xccl
need their own devices.

An accelerator that is present but whose backend this torch build lacks is an error naming both,
never a silent fallback to CPU. ``placement`` is a pure decision (strings and numbers, no device
is touched), so tests mock the accelerator and the backend checks and assert what it chose.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}
"""The collective backend each device type gets unless ``backend=`` says otherwise."""

_PLUGIN = {"npu": "torch_npu matching this torch (`import torch_npu` before zeroshard)"}
"""The device types that a plug-in package registers on a stock torch, and what to install."""
NO_BACKEND: dict[str, str] = {
    "mps": (
        "Apple MPS has no torch.distributed backend (gloo moves CPU tensors only, nccl/hccl/xccl "
        "need their own devices)"
    ),
}
"""Accelerator types that no collective backend serves, with the reason."""

_INSTALL_HINTS: dict[str, str] = {
    "nccl": "install a CUDA build of torch (pip install torch --index-url "
    "https://download.pytorch.org/whl/cu128)",
    "hccl": "install torch_npu matching this torch and `import torch_npu` before zeroshard",
    "xccl": "install an XPU build of torch >= 2.8 (pip install torch --index-url "
    "https://download.pytorch.org/whl/xpu)",
}


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: device type and index, the collective backend, and why."""

    device_type: str
    """"cpu", "cuda", "npu", "xpu", ..."""
    index: int | None
    """Device index on this node (``None`` on CPU)."""
    backend: str
    """The ``torch.distributed`` backend for this device ("gloo", "nccl", "hccl", "xccl")."""
    reason: str
    """How the device was chosen, for the log."""

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` (needs the device type registered: ``import torch_npu``)."""
        if self.index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, self.index)

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"


def current_accelerator_type() -> str | None:
    """The type of the accelerator present and usable ("cuda", "npu", ...), or None.

    ``torch.accelerator`` (torch >= 2.6) knows every in-tree accelerator and out-of-tree ones that
    register themselves (``import torch_npu`` makes it report "npu").
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return None
    try:
        device = accelerator.current_accelerator(check_available=True)
    except TypeError:  # torch 2.6: no check_available, None when nothing is available
        device = accelerator.current_accelerator()
    return None if device is None else device.type


def accelerator_count() -> int:
    """Devices of the current accelerator visible to this process (0 without one)."""
    return torch.accelerator.device_count()


def backend_available(backend: str) -> bool:
    """Whether this torch build (with its plug-ins imported) provides collective ``backend``."""
    check = getattr(dist, "is_backend_available", None)
    if check is not None:
        return bool(check(backend))
    probe = getattr(dist, f"is_{backend}_available", None)  # torch < 2.4
    return bool(probe and probe())


def backend_devices(backend: str) -> list[str] | None:
    """Device types ``backend`` moves tensors of, when torch records it (None: unknown)."""
    capability = getattr(dist.Backend, "backend_capability", {})
    devices = capability.get(backend.lower())
    return None if devices is None else list(devices)


def default_backend(device_type: str) -> str:
    """The collective backend for ``device_type``; ValueError where there is none."""
    if device_type in NO_BACKEND:
        raise ValueError(f"{NO_BACKEND[device_type]}; train on CPU with device='cpu'")
    name = DEFAULT_BACKENDS.get(device_type)
    if name is None:  # an accelerator torch maps itself (or a plug-in registered)
        name = getattr(dist.Backend, "default_device_backend_map", {}).get(device_type)
    if name is None:
        raise ValueError(
            f"no collective backend is known for device type {device_type!r}; pass backend= "
            "the name your accelerator's plug-in registers, or device='cpu'"
        )
    return name


def _parse_device(device: str | torch.device) -> tuple[str, int | None]:
    if isinstance(device, torch.device):
        return device.type, device.index
    if not isinstance(device, str) or not device:
        raise TypeError(f"device must be a string such as 'cuda' or a torch.device, got {device!r}")
    kind, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"device {device!r}: the index after ':' must be a number, e.g. 'cuda:0'")
    return kind.lower(), int(index) if index else None


def placement(
    *,
    device: str | torch.device | None = None,
    backend: str | None = None,
    local_rank: int = 0,
) -> Placement:
    """Decide this rank's device and collective backend (see the module docstring).

    ``device``: "cpu", an accelerator type ("cuda", "npu", "xpu"), optionally with an index
    ("cuda:1"), or None to use the accelerator torch finds. The index defaults to ``local_rank``.
    ``backend``: a ``torch.distributed`` backend name, or None for the device type's default.
    Raises ValueError for a choice that cannot work (naming the fix) and RuntimeError when an
    accelerator is present but this torch build lacks its backend (naming both).
    """
    found = current_accelerator_type()
    index: int | None
    if device is None:
        if found is None:
            kind, index = "cpu", None
            reason = "no accelerator found (torch.accelerator.current_accelerator() is None)"
        elif found in NO_BACKEND:
            warnings.warn(
                f"found a {found} accelerator but {NO_BACKEND[found]}: this rank runs on CPU with "
                "gloo; pass device='cpu' to choose that explicitly and silence this warning",
                stacklevel=3,
            )
            kind, index = "cpu", None
            reason = f"{found} found, but it has no collective backend: CPU instead"
        else:
            kind, index = found, None
            reason = f"torch.accelerator.current_accelerator() is {found}"
    else:
        kind, index = _parse_device(device)
        reason = f"device={str(device)!r} asked for"
        if kind in NO_BACKEND:
            raise ValueError(f"device={str(device)!r}: {NO_BACKEND[kind]}; use device='cpu'")
        if kind != "cpu" and kind != found:
            raise ValueError(
                f"device={str(device)!r} asked for, but torch finds "
                f"{'a ' + found + ' accelerator' if found else 'no accelerator'}: install "
                f"{_PLUGIN.get(kind, f'the {kind} build of torch')}, or pass "
                f"device={found or 'cpu'!r}"
            )
    if kind == "cpu":
        index = None
    else:
        index = local_rank if index is None else index
        count = accelerator_count()
        if index >= count:
            raise ValueError(
                f"this rank wants {kind}:{index} (LOCAL_RANK={local_rank}) but only {count} "
                f"{kind} device(s) are visible; start at most {count} processes per node "
                "(torchrun --nproc-per-node) or check CUDA_VISIBLE_DEVICES, "
                "ASCEND_RT_VISIBLE_DEVICES or ZE_AFFINITY_MASK"
            )
    chosen = backend.lower() if backend is not None else default_backend(kind)
    if not backend_available(chosen):
        if backend is not None:
            raise ValueError(
                f"backend={backend!r} is not available in this torch build; "
                f"{_INSTALL_HINTS.get(chosen, 'install it')}, or drop backend= to use "
                f"{kind}'s default"
            )
        others = [
            b
            for b, devices in getattr(dist.Backend, "backend_capability", {}).items()
            if kind in devices and b not in (chosen, "fake") and backend_available(b)
        ]
        other = f"pass backend={others[0]!r} (slower), " if others else ""
        raise RuntimeError(
            f"the {kind} accelerator is present but its collective backend {chosen!r} is not "
            f"available in this torch build: {_INSTALL_HINTS.get(chosen, 'install it')}; or "
            f"{other}or pass device='cpu' to train on CPU with gloo"
        )
    served = backend_devices(chosen)
    if served is not None and kind not in served:
        raise ValueError(
            f"backend {chosen!r} does not move {kind} tensors (it serves {', '.join(served)}); "
            f"use backend={default_backend(kind)!r} or a device it serves"
        )
    return Placement(kind, index, chosen, reason)


def device_of_backend(backend: str, local_rank: int) -> torch.device:
    """The device a rank of an already initialized group of ``backend`` computes on.

    The inverse of ``DEFAULT_BACKENDS`` ("nccl" -> cuda:LOCAL_RANK, "gloo" -> cpu); a composite
    backend ("cpu:gloo,cuda:nccl") means its accelerator entry.
    """
    by_backend = {b: kind for kind, b in DEFAULT_BACKENDS.items() if kind != "cpu"}
    for part in backend.lower().split(","):
        name = part.rpartition(":")[2]
        if name in by_backend:
            return torch.device(by_backend[name], local_rank)
    return torch.device("cpu")


def pin_host_memory() -> bool:
    """Whether host staging buffers should be pinned: when an accelerator with its own memory is
    present, so that copies to and from it are DMA and can overlap compute.

    ``torch.empty(..., pin_memory=True)`` pins for the current accelerator (torch >= 2.6). MPS
    shares memory with the CPU and our ranks never run on it (see NO_BACKEND): nothing to pin.
    """
    found = current_accelerator_type()
    return found is not None and found not in NO_BACKEND


def memory_allocated_bytes(device: torch.device) -> int:
    """Bytes held by tensors on accelerator ``device`` (torch's caching allocator's count)."""
    memory = getattr(torch.accelerator, "memory_allocated", None)
    if memory is not None:  # torch >= 2.9: one call for every accelerator
        return int(memory(device))
    return int(torch.get_device_module(device.type).memory_allocated(device))


def set_device(placement_: Placement) -> None:
    """Make the placement's device the current one of its accelerator (no-op on CPU)."""
    if placement_.is_accelerator:
        torch.accelerator.set_device_index(placement_.index)
