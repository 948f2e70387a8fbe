"""Side streams for collectives on accelerators; plain (no-op) contexts on CPU.

On a GPU the engine issues every parameter all-gather, with its copy-in and cast, on an
all-gather stream, and every gradient reduction, with its collect and cast, on a reduce-scatter
stream, so that neither waits behind (nor delays) the compute stream's kernels. Ordering is kept
by events: a side stream first waits for the compute stream (its inputs were written there),
and the compute stream waits for the collective's work handle before it reads the result
(``Handle.wait`` in ``zeroshard.collectives``: NCCL makes the current stream wait).

Generic ``torch.Stream`` / ``torch.accelerator`` calls, so CUDA, XPU or NPU alike. Not yet run on
a GPU in this project (no accelerator was available): the CPU path, where collectives are gloo's
and there are no streams, is the one tested.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_STREAMS: dict[tuple[torch.device, str], torch.Stream] = {}


def side_stream(device: torch.device, role: str) -> torch.Stream | None:
    """The stream for ``role`` ("all_gather" or "reduce_scatter") on ``device``; None on CPU."""
    if device.type == "cpu":
        return None
    key = (device, role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.Stream(device=device)
    return _STREAMS[key]


@contextlib.contextmanager
def on_side_stream(device: torch.device, role: str) -> Iterator[None]:
    """Run the block on ``role``'s side stream after everything queued so far on the current
    stream of ``device`` (its inputs come from there); a no-op on CPU."""
    stream = side_stream(device, role)
    if stream is None:
        yield
        return
    stream.wait_stream(torch.accelerator.current_stream(device))
    with stream:
        yield
