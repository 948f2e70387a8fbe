"""Memory tiers for ZeRO-Offload / ZeRO-Infinity: an asynchronous tensor store on CPU and NVMe.

See DESIGN.md §6 and `store.py` for the usage; `bench/bench_offload.py` measures it against the
raw bandwidth of the disk.
"""

from .placement import Offload
from .store import OffloadConfig, TensorStore
from .tiers import (
    OffloadError,
    OffloadSetupError,
    SwapHandle,
    SwapIntegrityError,
    SwapSpaceError,
    TensorMeta,
    Tier,
)

__all__ = [
    "Offload",
    "OffloadConfig",
    "OffloadError",
    "OffloadSetupError",
    "SwapHandle",
    "SwapIntegrityError",
    "SwapSpaceError",
    "TensorMeta",
    "TensorStore",
    "Tier",
]
