"""Device and backend choice (``zeroshard.accelerator``) with the accelerator mocked as cuda, npu,
xpu and mps, and the process-wide settings ``Mesh`` and ``shard`` leave alone or announce."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from parity_models import train_both
from torch import nn

import zeroshard
from zeroshard import accelerator
from zeroshard.accelerator import Placement, device_of_backend, placement
from zeroshard.mesh import Mesh, cpu_threads_per_rank
from zeroshard.testing import WorkerError, free_port


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has ``kind`` accelerators (``count`` of them) and the backends in
    ``backends``; torch's own backend capability table stays as it is."""

    def setup(kind: str | None, *, count: int = 8, backends: tuple[str, ...] = ("gloo",)) -> None:
        found = None if kind is None else SimpleNamespace(type=kind)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda check_available=False: found
        )
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if kind else 0)
        monkeypatch.setattr(dist, "is_backend_available", lambda name: name in backends)

    return setup


# --------------------------------------------------------------------- found automatically


@pytest.mark.parametrize(("kind", "backend"), [("cuda", "nccl"), ("npu", "hccl"), ("xpu", "xccl")])
def test_the_accelerator_found_gets_its_own_backend(machine, kind, backend):
    machine(kind, backends=("gloo", backend))
    where = placement(local_rank=3)
    assert where == Placement(kind, 3, backend, where.reason)
    assert "current_accelerator() is " + kind in where.reason


def test_no_accelerator_is_cpu_with_gloo(machine):
    machine(None)
    where = placement(local_rank=5)
    assert (where.device_type, where.index, where.backend) == ("cpu", None, "gloo")
    assert where.device == torch.device("cpu")


def test_mps_found_falls_back_to_cpu_and_says_why(machine):
    machine("mps", backends=("gloo",))
    with pytest.warns(UserWarning, match="no torch.distributed backend.*device='cpu'"):
        where = placement()
    assert (where.device_type, where.backend) == ("cpu", "gloo")


def test_mps_asked_for_is_an_error_naming_the_way_out(machine):
    machine("mps", backends=("gloo",))
    with pytest.raises(ValueError, match="device='mps'.*no torch.distributed backend.*'cpu'"):
        placement(device="mps")


# --------------------------------------------------------------------- backends missing


@pytest.mark.parametrize(
    ("kind", "backend", "hint"),
    [("cuda", "nccl", "CUDA build"), ("npu", "hccl", "torch_npu"), ("xpu", "xccl", "XPU build")],
)
def test_a_present_accelerator_without_its_backend_names_both(machine, kind, backend, hint):
    machine(kind, backends=("gloo",))
    with pytest.raises(RuntimeError) as err:
        placement()
    message = str(err.value)
    assert f"the {kind} accelerator is present" in message
    assert f"collective backend {backend!r} is not available" in message
    assert hint in message and "device='cpu'" in message
    # gloo also moves CUDA tensors (torch's capability table), so only CUDA is offered gloo
    assert ("backend='gloo'" in message) == (kind == "cuda")


def test_an_explicit_backend_that_is_missing_is_a_value_error(machine):
    machine("cuda", backends=("gloo",))
    with pytest.raises(ValueError, match="backend='nccl' is not available.*drop backend="):
        placement(backend="nccl")


# --------------------------------------------------------------------- asked for explicitly


def test_explicit_device_and_index_win_over_local_rank(machine):
    machine("cuda", count=2, backends=("gloo", "nccl"))
    assert placement(device="cuda:1", local_rank=0).index == 1
    assert placement(device=torch.device("cuda", 0), local_rank=1).index == 0
    assert placement(device="cpu", local_rank=1) == Placement(
        "cpu", None, "gloo", "device='cpu' asked for"
    )


def test_gloo_may_serve_cuda_tensors_when_asked(machine):
    machine("cuda", backends=("gloo", "nccl"))
    assert placement(backend="gloo").backend == "gloo"


def test_a_backend_that_cannot_move_the_devices_tensors_is_refused(machine):
    machine(None, backends=("gloo", "nccl"))
    with pytest.raises(ValueError, match="'nccl' does not move cpu tensors.*backend='gloo'"):
        placement(device="cpu", backend="nccl")


def test_asking_for_an_accelerator_that_is_not_there_says_what_is(machine):
    machine(None)
    with pytest.raises(ValueError, match="device='cuda'.*finds no accelerator.*device='cpu'") as e:
        placement(device="cuda")
    assert "torch_npu" not in str(e.value)  # (a CUDA build was advised with NPU's plug-in)
    machine("xpu", backends=("gloo", "xccl"))
    with pytest.raises(ValueError, match="finds a xpu accelerator.*torch_npu.*device='xpu'") as e:
        placement(device="npu")
    assert "build of torch" not in str(e.value)  # (torch_npu installs on a stock torch)


def test_more_ranks_than_devices_is_an_error(machine):
    machine("npu", count=2, backends=("hccl",))
    with pytest.raises(ValueError, match=r"npu:2 \(LOCAL_RANK=2\) but only 2 npu device"):
        placement(local_rank=2)


@pytest.mark.parametrize("bad", ["cuda:x", ""])
def test_a_malformed_device_is_a_clear_error(machine, bad):
    machine("cuda", backends=("nccl",))
    with pytest.raises((ValueError, TypeError), match="device"):
        placement(device=bad)


def test_an_unknown_accelerator_without_a_backend_asks_for_one(machine):
    machine("maia", backends=("gloo",))
    with pytest.raises(ValueError, match="no collective backend is known for device type 'maia'"):
        placement()


def test_an_initialized_groups_backend_gives_its_device():
    assert device_of_backend("nccl", 3) == torch.device("cuda", 3)
    assert device_of_backend("xccl", 1) == torch.device("xpu", 1)
    assert device_of_backend("gloo", 3) == torch.device("cpu")
    assert device_of_backend("cpu:gloo,cuda:nccl", 2) == torch.device("cuda", 2)


def test_host_memory_is_pinned_only_for_an_accelerator_with_its_own_memory(machine):
    machine(None)
    assert not accelerator.pin_host_memory()
    machine("xpu")
    assert accelerator.pin_host_memory()
    machine("mps")
    assert not accelerator.pin_host_memory()


# --------------------------------------------------------------------- process-wide settings


def test_from_env_leaves_the_thread_count_alone_and_logs_the_group(lone_process, caplog):
    before = torch.get_num_threads()
    set_by_us = 3 if cpu_threads_per_rank(1) != 3 else 5  # neither 1 nor the cores' count
    torch.set_num_threads(set_by_us)
    try:
        with caplog.at_level(logging.INFO, logger="zeroshard"):
            mesh = Mesh.from_env(device="cpu")
        assert torch.get_num_threads() == set_by_us
        assert "started the default process group: gloo, rank 0 of 1, on cpu" in caplog.text
        object.__setattr__(mesh, "local_world_size", 2)
        assert mesh.share_cpu_threads() == cpu_threads_per_rank(2)
        assert torch.get_num_threads() == cpu_threads_per_rank(2)
    finally:
        torch.set_num_threads(before)


def _start_alone(monkeypatch, rank: int) -> tuple[int, str]:
    """Rank ``rank`` of a 2-rank job started with no other rank: (the port, the StartTimeout's
    one line)."""
    from zeroshard.watchdog import StartTimeout

    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
    env.update(WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StartTimeout) as info:
        Mesh.from_env(device="cpu", timeout_s=1.0)
    message = str(info.value)
    assert message.startswith(f"rank {rank} could not start the process group (")
    assert "\n" not in message and "zeroshard train --timeout" in message, message
    assert info.value.exit_code == 4
    return port, message


def test_a_rank_that_never_joins_is_a_start_timeout(lone_process, monkeypatch):
    """Rank 1 never starts: rank 0 says so in one line after the timeout (it was torch's
    DistStoreError traceback: "wait timeout after 1000ms, keys: /default_pg/0//cpu//0/1")."""
    _, message = _start_alone(monkeypatch, 0)
    assert "another rank did not join it within the timeout" in message, message


def test_a_rank_whose_rank_0_never_answers_is_a_start_timeout(lone_process, monkeypatch):
    """Rank 1 of a job whose rank 0 never comes up (a store nobody serves: RANK and MASTER_ADDR
    left over in the shell): one line, as above (it was torch's DistNetworkError traceback)."""
    port, message = _start_alone(monkeypatch, 1)
    assert f"rank 0's store at 127.0.0.1:{port} never answered" in message, message


def test_threads_per_rank_divide_the_cores():
    assert cpu_threads_per_rank(2, cores=16) == 8
    assert cpu_threads_per_rank(3, cores=16) == 5
    assert cpu_threads_per_rank(32, cores=16) == 1  # never zero
    assert cpu_threads_per_rank(0, cores=4) == 4


def test_shard_logs_the_process_group_it_starts(lone_process, caplog):
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        zeroshard.shard(nn.Linear(4, 4), stage=3)
    assert "shard() started the default process group (gloo, 1 rank(s), cpu)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        zeroshard.shard(nn.Linear(4, 4), stage=3)  # the group exists now: nothing to say
    assert "started" not in caplog.text


EXIT_RACE = """
import sys, torch, torch.distributed as dist, zeroshard
from torch import nn
dist.init_process_group("gloo")
zeroshard.shard(nn.Linear(4, 4), stage=2)
t = torch.ones(1)
sys.setswitchinterval(1000)  # this thread keeps the GIL unless it blocks: exit comes first
dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_a_script_that_ends_right_after_a_collective_exits_cleanly(tmp_path):
    """gloo's worker thread drops its reference to the collective's tensor only once it holds
    the GIL; at exit it would be ended mid-destructor and abort the process ("terminate called
    without an active exception"). Without ``shard``'s exit hook this script aborted on about 1
    rank in 3 here, so 4 ranks catch a regression most of the time; it never fails with it."""
    script = tmp_path / "exit_race.py"
    script.write_text(EXIT_RACE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    cmd += ["--master-port", str(free_port()), str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("timeout_s", [float("inf"), "60", 0, True])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused(lone_process, timeout_s):
    """inf was timedelta's OverflowError and "60" a TypeError comparing str with int."""
    with pytest.raises(ValueError, match="timeout_s must be a positive, finite number"):
        Mesh.from_env(device="cpu", timeout_s=timeout_s)


GROUPS_OF_THE_USER = """
import os, sys, torch, torch.distributed as dist, zeroshard
from torch import nn
dist.init_process_group("gloo")
r = dist.get_rank()
out = open(os.path.join(sys.argv[1], f"rank{r}.txt"), "w")
for k in ("RANK", "WORLD_SIZE"):  # a group started as mp.spawn's scripts do: no such variables
    os.environ.pop(k)
mesh = zeroshard.Mesh.from_env()
print("from_env", mesh.rank, mesh.world_size, file=out)
model = zeroshard.shard(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1)), stage=3, mesh=mesh)
dist.destroy_process_group()
# a new job of the same processes, numbered the other way: the old model is not its model
store = dist.FileStore(os.path.join(sys.argv[1], "store"), 2)
dist.init_process_group("gloo", store=store, rank=1 - r, world_size=2)
try:
    model(torch.ones(2, 8))
    print("old model ran", file=out)
except RuntimeError as e:
    print("old model:", str(e)[:53], file=out)
model = zeroshard.shard(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1)), stage=3)
opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
opt.backward(model(torch.ones(2, 8)).sum())
opt.step()
zeroshard.checkpoint.save(os.path.join(sys.argv[1], "ckpt"), model, opt, async_save=True).wait()
print("async save in the new group", file=out)
out.close()
dist.destroy_process_group()
"""


def test_groups_the_user_starts_and_restarts(tmp_path):
    """``Mesh.from_env`` in a group started without torchrun's variables took rank 0 of 1
    (stage 0 summed the ranks' gradients; stages 1-3 failed in a collective); a model sharded
    in a destroyed group ran on in a new one, gathering its shards in the new ranks' order;
    an asynchronous save in the new group failed on the old group's background group."""
    script = tmp_path / "groups.py"
    script.write_text(GROUPS_OF_THE_USER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(script), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines == [
            f"from_env {rank} 2",
            "old model: the process group this model was sharded over is gone",
            "async save in the new group",
        ], lines


def _outside_the_mesh() -> str:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))
    try:
        zeroshard.shard(nn.Linear(8, 8), stage=3, mesh=mesh)
        return "sharded"
    except ValueError as e:
        return str(e)


def test_a_rank_outside_the_device_mesh_is_told_so(workers4):
    said = workers4.run(_outside_the_mesh)
    assert said[:2] == ["sharded", "sharded"], said  # (IndexError from inside torch before)
    for rank in (2, 3):
        assert said[rank].startswith(f"rank {rank} is not in this DeviceMesh (ranks [0, 1])")


def _mesh_of_a_group(how: str, stage: int) -> float:
    """Shard over a group of the user's (``dist.new_group``) given as ``how``, 2 SGD steps;
    the largest difference from plain torch on the global batch. A Mesh made by hand with
    another rank than the group's (the ranks reversed) is an error."""
    import copy
    from dataclasses import replace

    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    base = zeroshard.Mesh.current()
    meshes = {
        "group": group,
        "from_group": zeroshard.Mesh.from_group(group),
        "by hand": replace(base, rank=world - 1 - base.rank, group=group),
    }
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, mesh=meshes[how], wrap=zeroshard.wrap.by_class(nn.Linear)
    )
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    me = dist.get_rank(group)
    batches = [
        torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(i)) for i in (0, 1)
    ]
    return train_both(
        model, opt, ref, ref_opt, batches,
        lambda m, x: m(x).pow(2).mean(), lambda x: x[2 * me : 2 * me + 2],
    )[0]  # fmt: skip


@pytest.mark.parametrize("how", ["group", "from_group"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_process_group_of_the_user_s_is_a_mesh(workers2, how, stage):
    assert max(workers2.run(_mesh_of_a_group, how, stage)) < 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_a_mesh_whose_rank_is_not_its_group_s_is_refused(workers2, stage):
    # It was taken: the shards were cut at one rank and gathered at the other, and stages 1-3
    # trained on mixed-up weights (0.3-0.6 off torch) without a word.
    said = r"Mesh\(rank=[01], world_size=2\) disagrees with its group, where this process is rank"
    with pytest.raises(WorkerError, match=said + r" [01] of its 2: pass the group itself"):
        workers2.run(_mesh_of_a_group, "by hand", stage)
