"""State dicts of many small units (``zeroshard.state_dict_gather``): the model's and the
optimizer's made and loaded with a few batched all-gathers (one per flat, or per DTensor entry,
before), each within ``bucket_bytes``, the values those of an unsharded model's in the same
test, uneven row chunks (3 rows on 2 ranks, a 1-row parameter) included."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard import collectives as C
from zeroshard.state_dict_layout import COLLECTIVE

UNITS = 12


class Pair(nn.Module):
    """A unit with parameters of 3 rows, 6 rows and 1 row (uneven chunks over 2 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.up = nn.Linear(3, 6, bias=False)
        self.gain = nn.Parameter(torch.ones(1, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(self.fc(x))) * self.gain + x


class Net(nn.Module):
    """The units, and a parameter of the root's own (its entry is taken first on load)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, 6))
        self.blocks = nn.Sequential(*[Pair() for _ in range(UNITS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x * self.scale.mean(0))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


class _Counted:
    """The state dicts' all-gathers (their sizes in bytes) and DTensor.full_tensor() calls."""

    def __init__(self) -> None:
        self.gathers: list[int] = []
        self.full_tensors = 0

    def __enter__(self) -> _Counted:
        from torch.distributed.tensor import DTensor

        gather, full_tensor = C.all_gather, DTensor.full_tensor

        def counted_gather(out, *args, **kwargs):
            if kwargs.get("label") == COLLECTIVE:
                self.gathers.append(out.numel() * out.element_size())
            return gather(out, *args, **kwargs)

        def counted_full(dt, *args, **kwargs):
            self.full_tensors += 1
            return full_tensor(dt, *args, **kwargs)

        self._patches = [
            mock.patch.object(C, "all_gather", counted_gather),
            mock.patch.object(DTensor, "full_tensor", counted_full),
        ]
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self._patches:
            p.stop()


def _full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _row_chunks(values: dict, template: dict) -> dict:
    """``values`` (whole tensors) as the DTensors of ``template``: this rank's row chunks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for k, t in template.items():
        if hasattr(t, "to_local"):
            size = -(-values[k].shape[0] // world)  # torch.chunk's rows per rank
            t.to_local().copy_(values[k][rank * size : (rank + 1) * size])
            out[k] = t
        else:
            out[k] = values[k].clone()
    return out


def _batched(stage: int, precision: str, bucket_bytes: int) -> dict:
    net = _net()
    ref = copy.deepcopy(net)
    model = zeroshard.shard(
        net,
        stage=stage,
        wrap=zeroshard.wrap.by_class(Pair),
        mixed_precision=precision,
        config=zeroshard.ShardConfig(bucket_bytes=bucket_bytes),
    )
    out: dict = {}
    with _Counted() as saving:
        sd = model.state_dict()
    out["save"] = saving.gathers
    out["save_equal"] = all(torch.equal(_full(sd[k]), v) for k, v in ref.state_dict().items())
    # New values, loaded as row chunks (what dcp.load fills in), then read back.
    torch.manual_seed(1)
    values = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    ref.load_state_dict(values)
    chunks = _row_chunks(values, model.state_dict())
    with _Counted() as loading:
        model.load_state_dict(chunks)
    out["load"], out["load_full_tensors"] = loading.gathers, loading.full_tensors
    back = model.state_dict()
    out["load_equal"] = all(torch.equal(_full(back[k]), v) for k, v in values.items())
    # One AdamW step on the same global batch, then the optimizer's states.
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4 * dist.get_world_size(), 6, generator=torch.Generator().manual_seed(2))
    mine = x.chunk(dist.get_world_size())[dist.get_rank()]
    opt.backward(model(mine).square().mean())
    opt.step()
    ref(x).square().mean().backward()
    ref_opt.step()
    with _Counted() as saving:
        osd = opt.state_dict()
    out["osave"] = saving.gathers
    names = dict(ref.named_parameters())
    want = {n: ref_opt.state[p] for n, p in names.items()}

    def close(state: dict) -> bool:
        return all(
            torch.allclose(_full(state[n][k]).float(), want[n][k].float(), rtol=1e-4, atol=1e-6)
            for n in names
            for k in ("exp_avg", "exp_avg_sq", "step")
        )

    # (BF16 compute takes other steps than the FP32 reference: its round trip is checked)
    out["osave_close"] = precision != "fp32" or close(osd["state"])
    with _Counted() as loading:
        opt.load_state_dict(osd)
    out["oload"], out["oload_full_tensors"] = loading.gathers, loading.full_tensors
    again = opt.state_dict()["state"]
    out["oload_close"] = all(
        torch.equal(_full(again[n][k]), _full(osd["state"][n][k])) for n in names for k in again[n]
    )
    flat_bytes = [f.padded_numel * 4 for f in zeroshard.engine_of(model).flat_params]
    out["largest"] = max(flat_bytes)
    return out


@pytest.mark.parametrize(("stage", "precision"), [(3, "fp32"), (1, "bf16"), (2, "fp32")])
def test_many_units_share_few_gathers(workers2, stage, precision):
    for r in workers2.run(_batched, stage, precision, 25 * 2**20):
        assert r["save_equal"] and r["load_equal"], r
        assert r["osave_close"] and r["oload_close"], r
        # Before: one gather per unit (13), per unit and state (26), per DTensor entry (37, 74).
        # Stage 2 in FP32 holds the whole masters: nothing to gather for the model.
        assert len(r["save"]) == (0 if (stage, precision) == (2, "fp32") else 1), r
        assert len(r["load"]) == 1 and r["load_full_tensors"] == 0, r
        assert len(r["osave"]) == 2, r  # exp_avg, exp_avg_sq
        assert len(r["oload"]) == 1 and r["oload_full_tensors"] == 0, r


def test_a_small_bucket_bounds_each_gather(workers2):
    cap = 600  # bytes: three units' flat buffers (48 FP32 elements each, padded)
    for r in workers2.run(_batched, 3, "fp32", cap):
        assert r["save_equal"] and r["load_equal"], r
        assert r["osave_close"] and r["oload_close"], r
        for what in ("save", "osave", "load", "oload"):
            sizes = r[what]
            assert 2 < len(sizes) < 4 * UNITS, (what, sizes)
            # (a load's gather pads each rank's row chunks to the longest rank's)
            assert max(sizes) <= 2 * max(cap, r["largest"]), (what, sizes)


def _edited_in_place(stage: int) -> bool:
    """A submodule's load pre-hook that edits its entry in place (a checkpoint upgrade's
    ``mul_``): the entry had been gathered ahead, before the hook ran, and the value from
    before the edit was loaded (torch and FSDP2 load the edited one)."""
    net = _net()
    ref = copy.deepcopy(net)
    model = zeroshard.shard(net, stage=stage, wrap=zeroshard.wrap.by_class(Pair))

    def upgrade(module, state_dict, prefix, *args):
        state_dict[prefix + "weight"].mul_(2)

    for m in (model, ref):
        m.blocks[5].fc.register_load_state_dict_pre_hook(upgrade)
    ref.load_state_dict(copy.deepcopy(ref.state_dict()))
    model.load_state_dict(model.state_dict())
    back = model.state_dict()
    return all(torch.equal(_full(back[k]), v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("stage", [1, 3])
def test_an_entry_edited_in_place_by_a_hook_is_loaded_edited(workers2, stage):
    assert workers2.run(_edited_in_place, stage) == [True, True]


def _split_unevenly() -> str:
    """A DTensor entry whose rows are not torch.chunk's split on one rank only (5 rows as 3 +
    1): that rank raised, the other waited in the gather for good."""
    from torch.distributed.tensor import DTensor, Shard

    from zeroshard.state_dict_layout import device_mesh

    model = zeroshard.shard(_net(), stage=3, wrap=zeroshard.wrap.by_class(Pair))
    sd = model.state_dict()
    rows = 3 if dist.get_rank() == 0 else 2  # (torch.chunk: 2 and 1)
    local = torch.zeros(rows, 6)
    sd["scale"] = DTensor.from_local(
        local, device_mesh(model), [Shard(0)], run_check=False, shape=(3, 6), stride=(6, 1)
    )
    try:
        model.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_an_entry_split_unevenly_is_an_error_on_every_rank(workers2):
    for said in workers2.run(_split_unevenly):
        assert "does not hold its rank's row chunk" in said, said
