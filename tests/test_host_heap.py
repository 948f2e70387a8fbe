"""Returning freed host memory when the process grows (``zeroshard.residual_states.host_heap``)."""

from __future__ import annotations

import pytest

from zeroshard.residual_states import host_heap


def _keeper_over(monkeypatch, steps: list[tuple[int, int]]) -> tuple[host_heap.HeapKeeper, list]:
    """A keeper after the warm-up and ``steps``: each (resident bytes at its end, what a trim
    brings them down to); the trims' resident sizes before them."""
    rss = [100]
    trims: list[int] = []
    monkeypatch.setattr(host_heap, "resident_bytes", lambda: rss[0])

    def trim() -> bool:
        trims.append(rss[0])
        rss[0] = floor[0]
        return True

    floor = [100]
    monkeypatch.setattr(host_heap, "trim", trim)
    keeper = host_heap.HeapKeeper(slack=0.03)
    for _ in range(host_heap.WARMUP_STEPS - 1):
        keeper.after_step()  # warming up: no size read, no trim
    assert keeper.working_bytes is None and not trims
    keeper.after_step()  # step 10: the working size
    assert keeper.working_bytes == 100
    for rss[0], floor[0] in steps:
        keeper.after_step()
    return keeper, trims


def test_trims_only_when_the_process_outgrows_its_working_size(monkeypatch):
    steps = [(102, 100), (104, 100), (103, 100), (106, 100)]
    keeper, trims = _keeper_over(monkeypatch, steps)
    assert keeper.trims == 2 and trims == [104, 106]  # not at 102 or 103
    assert keeper.working_bytes == 100


def test_memory_a_trim_cannot_return_becomes_the_working_size(monkeypatch):
    """A process that grew for good (a checkpoint library loaded at the first save) trimmed
    after every step from then on, returning nothing."""
    steps = [(110, 108)] + [(108, 108)] * 5 + [(110, 108), (112, 108)]
    keeper, trims = _keeper_over(monkeypatch, steps)
    assert trims == [110, 112] and keeper.working_bytes == 108  # 112 > 108 * 1.03


def test_trim_returns_memory_here():
    if host_heap._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    assert host_heap.trim() is True
    assert host_heap.resident_bytes() > 0


def _host(root, cgroup: str, files: dict[str, str], available_kib: int = 8 * 2**20) -> str:
    """A fake file system under ``root``: /proc/meminfo (8 GiB available by default), this
    process's /proc/self/cgroup, and cgroup files (path -> content)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 1 kB\nMemAvailable: {available_kib} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


GIB = 2**30


def test_a_cgroup_limit_below_the_host_s_memory_is_what_is_available(tmp_path):
    # The host had 8 GiB available; the job's cgroup (a container, a SLURM job) allowed 2 GiB,
    # and a launch check passed on the host's figure before the kernel killed a rank.
    v2 = "sys/fs/cgroup/job/step"
    root = _host(
        tmp_path / "v2",
        "0::/job/step\n",
        {
            f"{v2}/memory.max": f"{4 * GIB}\n",
            f"{v2}/memory.current": f"{GIB}\n",
            f"{v2}/memory.stat": f"anon 1\ninactive_file {GIB // 2}\n",  # reclaimable cache
            "sys/fs/cgroup/job/memory.max": f"{2 * GIB}\n",  # the parent's limit binds
            "sys/fs/cgroup/job/memory.current": f"{GIB}\n",
        },
    )
    assert host_heap.memory_available_bytes(root) == GIB
    v1 = "sys/fs/cgroup/memory"
    root = _host(
        tmp_path / "v1",
        "5:cpu,cpuacct:/\n4:memory:/slurm/job1\n0::/\n",
        {
            f"{v1}/slurm/job1/memory.limit_in_bytes": f"{3 * GIB}\n",
            f"{v1}/slurm/job1/memory.usage_in_bytes": f"{2 * GIB}\n",
            f"{v1}/slurm/job1/memory.stat": f"total_inactive_file {GIB}\n",
            f"{v1}/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
            f"{v1}/memory.usage_in_bytes": f"{5 * GIB}\n",
        },
    )
    assert host_heap.memory_available_bytes(root) == 2 * GIB


def test_without_a_cgroup_limit_the_host_s_memory_is_available(tmp_path):
    # No limit ("max"), a namespace whose own cgroup is the mount's root, no cgroup files.
    files = {"sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": "5\n"}
    root = _host(tmp_path / "a", "0::/not/here\n", files)
    assert host_heap.memory_available_bytes(root) == 8 * GIB
    root = _host(tmp_path / "b", "0::/\n", {}, available_kib=1024)
    assert host_heap.memory_available_bytes(root) == 2**20
    limited = {"sys/fs/cgroup/memory.max": f"{GIB}\n", "sys/fs/cgroup/memory.current": "0\n"}
    root = _host(tmp_path / "c", "0::/not/here\n", limited)  # the mount's root is its cgroup
    assert host_heap.memory_available_bytes(root) == GIB
    assert host_heap.memory_available_bytes(str(tmp_path / "nothing")) is None


def test_cgroups_are_found_where_mountinfo_says(tmp_path):
    # v1's memory controller mounted with cpu's (/sys/fs/cgroup/cpu,memory) was not looked for;
    # a v2 mount that shows a subtree (a container's) gives paths below its own root.
    mountinfo = (
        "30 25 0:26 / /sys/fs/cgroup/cpu,memory rw,nosuid shared:9 - cgroup cgroup rw,cpu,memory\n"
    )
    v1 = "sys/fs/cgroup/cpu,memory/job"
    files = {
        "proc/self/mountinfo": mountinfo,
        f"{v1}/memory.limit_in_bytes": f"{GIB}\n",
        f"{v1}/memory.usage_in_bytes": f"{GIB // 4}\n",
    }
    root = _host(tmp_path / "v1", "4:cpu,memory:/job\n", files)
    assert host_heap.memory_available_bytes(root) == 3 * GIB // 4
    mountinfo = "40 30 0:30 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    files = {
        "proc/self/mountinfo": mountinfo,
        "sys/fs/cgroup/ctr/memory.max": f"{2 * GIB}\n",
        "sys/fs/cgroup/ctr/memory.current": f"{GIB}\n",
    }
    root = _host(tmp_path / "v2", "0::/kubepods/pod1/ctr\n", files)
    assert host_heap.memory_available_bytes(root) == GIB
