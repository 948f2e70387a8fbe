"""The swap files' traffic during ``zeroshard train`` (ZeRO-Infinity's NVMe tier): bytes read
and written per step, summed over ranks, and the time blocked on a swap, for the run's records
and summary."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroshard.watchdog import diagnosed


class DiskTraffic:
    """Bytes the offloaded states moved to and from the swap files (ZeRO-Infinity), summed over
    steps since the last record and, in records, over ranks; nothing without NVMe offload."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self.offloaded = bool(opt.offload_stats())  # also clears the building's I/O
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0

    def collect(self) -> None:
        """Add the step just finished (every rank, after the optimizer step)."""
        if not self.offloaded:
            return
        # Every swapper names its counters [prefix_]read_bytes, ..._write_bytes and ..._wait_s
        # (ShardedOptimizer.offload_stats). A record read ahead (the states' prefetch_bytes) is
        # counted in read_bytes by the swap that takes it out of the store's pool: not again.
        for key, value in self.opt.offload_stats().items():
            if key.endswith("read_bytes"):
                self.read_bytes += int(value)
            elif key.endswith("write_bytes"):
                self.write_bytes += int(value)
            elif key.endswith("wait_s"):
                self.wait_s += value

    def record(self, num_steps: int, device: torch.device) -> dict:
        """Per-step disk traffic of every rank together since the last record (a collective
        when offloaded): ``disk_read_gb``, ``disk_write_gb`` (1e9 bytes) and this rank's
        ``io_wait_s`` (seconds blocked on a swap per step)."""
        if not self.offloaded:
            return {}
        total = torch.tensor([self.read_bytes, self.write_bytes], dtype=torch.float64)
        total = total.to(device)
        with diagnosed("all_reduce", "the swap traffic", None):
            dist.all_reduce(total)
        steps = max(num_steps, 1)
        out = {
            "disk_read_gb": round(total[0].item() / steps / 1e9, 3),
            "disk_write_gb": round(total[1].item() / steps / 1e9, 3),
            "io_wait_s": round(self.wait_s / steps, 3),
        }
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0
        return out

    @staticmethod
    def summary(records: list[dict]) -> dict:
        """The last record's per-step disk traffic (all ranks), for ``summary.json``."""
        last = next((r for r in reversed(records) if "disk_read_gb" in r), None)
        if last is None:
            return {}
        return {"disk_read_gb_per_step": last["disk_read_gb"],
                "disk_write_gb_per_step": last["disk_write_gb"]}  # fmt: skip
