"""Returning freed host memory to the system when the process grows (ZeRO-R's defragmentation,
on the CPU).

Training on the CPU frees and allocates the same large buffers every step (activations, gradient
buffers, the collectives' own temporaries, some on gloo's threads). glibc's allocator keeps what
is freed in its arenas, and with its dynamic mmap threshold most of these buffers come from the
arenas rather than from ``mmap``; across threads and sizes the arenas fragment, and the process
grows step after step although no tensor leaks. Measured on this project's machine, 2 gloo ranks
at stage 3: the ``tiny`` GPT +33% and +56% on its two ranks over 500 steps, the ``100m`` one
1.5 -> 1.7 GiB over 8 steps with 0.76 GiB of tensors alive (``bench/bench_residual.py``).

``HeapKeeper`` takes the process's resident size after a warm-up as its working size, and when a
later step ends with the process more than ``slack`` above it, asks glibc to release every free
page it holds (``malloc_trim(0)``, which also returns free pages inside the arenas). Trimming
after every step would keep the process smallest but make every step fault its buffers in again
(measured: ``tiny`` steps 10-20% slower; glibc's own ``MALLOC_TRIM_THRESHOLD_=0``, 1.9x on
``100m``); trimming on growth only costs a trim every few dozen steps. A no-op where the C library
has no ``malloc_trim`` (musl, macOS) or ``/proc/self/statm`` is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

WARMUP_STEPS = 10
"""Steps before the working size is taken (the first steps allocate what training keeps)."""


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return the C library's free memory to the system; whether it could (glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def resident_bytes() -> int | None:
    """This process's resident set size, or None where ``/proc`` does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_available_bytes(root: str = "/") -> int | None:
    """Memory this process can still be given without swapping or being killed, bytes: the
    least of Linux's ``MemAvailable`` and the headroom of its memory cgroup (a container's, a
    SLURM job's: MemAvailable is the host's, and a cgroup's limit kills the process well below
    it). None where neither says. ``root``: the file system's root (tests)."""
    found = [b for b in (_meminfo_available(root), _cgroup_headroom(root)) if b is not None]
    return min(found) if found else None


def _meminfo_available(root: str) -> int | None:
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat(text: str | None, key: str) -> int:
    """Field ``key`` of a cgroup's ``memory.stat`` (0 where absent)."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_mounts(root: str) -> dict[str, tuple[str, str]]:
    """Where the cgroup hierarchies are mounted, from ``/proc/self/mountinfo``: ``"v2"`` (the
    unified one) and ``"memory"`` (v1's memory controller, alone or mounted with others, e.g.
    at ``/sys/fs/cgroup/cpu,memory``), each as (mount point, the cgroup path the mount shows
    at its root); the usual places where mountinfo does not say."""
    found = {"v2": ("/sys/fs/cgroup", "/"), "memory": ("/sys/fs/cgroup/memory", "/")}
    seen: dict[str, tuple[str, str]] = {}
    for line in (_read(os.path.join(root, "proc/self/mountinfo")) or "").splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        tail = fields[fields.index("-") + 1 :]
        if len(tail) >= 3 and tail[0] == "cgroup2":
            seen.setdefault("v2", (fields[4], fields[3]))
        elif len(tail) >= 3 and tail[0] == "cgroup" and "memory" in tail[2].split(","):
            seen.setdefault("memory", (fields[4], fields[3]))
    if "memory" not in seen:  # (no mountinfo: a directory named for the controllers)
        top = os.path.join(root, "sys/fs/cgroup")
        names = sorted(os.listdir(top)) if os.path.isdir(top) else []
        named = [n for n in names if "memory" in n.split(",") and os.path.isdir(f"{top}/{n}")]
        if named:
            seen["memory"] = (f"/sys/fs/cgroup/{named[0]}", "/")
    return {**found, **seen}


def _cgroup_headroom(root: str) -> int | None:
    """Limit minus working set (usage less the inactive page cache the kernel reclaims first,
    as Kubernetes counts it) of this process's memory cgroup and of each cgroup above it, the
    least; None where no limit is set or the files are not there. cgroup v2
    (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``), wherever their hierarchies are mounted."""
    table = _read(os.path.join(root, "proc/self/cgroup")) or ""
    mounts = _cgroup_mounts(root)
    headrooms = []
    for line in table.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy
            (point, shown), files = mounts["v2"], ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own
            (point, shown) = mounts["memory"]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        path = path.strip()
        if shown != "/" and (path + "/").startswith(shown.rstrip("/") + "/"):
            path = path[len(shown.rstrip("/")) :]  # (the mount shows a subtree)
        base = os.path.normpath(os.path.join(root, point.lstrip("/")))
        here = os.path.normpath(os.path.join(base, path.lstrip("/")))
        if not here.startswith(base) or not os.path.isdir(here):
            here = base  # a namespace's: its own cgroup is mounted as the base
        while True:
            limit, usage = _read(os.path.join(here, files[0])), _read(os.path.join(here, files[1]))
            if limit and usage and limit.strip().isdigit() and int(limit) < _UNLIMITED:
                inactive = _stat(_read(os.path.join(here, "memory.stat")), files[2])
                working = max(int(usage) - inactive, 0)
                headrooms.append(max(int(limit) - working, 0))
            if len(here) <= len(base) or not here.startswith(base):  # (the mount's root)
                break
            here = os.path.dirname(here)
    return min(headrooms) if headrooms else None


class HeapKeeper:
    """Trims the heap when the process outgrows its working size by ``slack`` (a fraction)."""

    def __init__(self, slack: float) -> None:
        self.slack = slack
        self.steps = 0
        self.working_bytes: int | None = None
        """Resident bytes after ``WARMUP_STEPS`` steps (None before, or without /proc)."""
        self.trims = 0

    def after_step(self) -> None:
        """Call once per optimizer step, after its temporaries are freed."""
        self.steps += 1
        if self.steps < WARMUP_STEPS or _malloc_trim() is None:
            return
        now = resident_bytes()
        if now is None:
            return
        if self.working_bytes is None:
            self.working_bytes = now
        elif now > self.working_bytes * (1 + self.slack):
            trim()
            self.trims += 1
            after = resident_bytes()
            if after is not None and after > self.working_bytes * (1 + self.slack):
                # What the trim could not return is held (a checkpoint's first save loads its
                # library and buffers): the working size from here on. Kept, it had every later
                # step trim for nothing (175 trims in 200 steps after a save at step 20).
                self.working_bytes = after
