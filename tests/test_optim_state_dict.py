"""Loading an optimizer state dict (``zeroshard.optim_state_dict``): which piece of a sub-group
holds a parameter's range (``_owner``: by bisection, as the scan it replaced), and loads that
write the rank's states in place, or refuse before writing any."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard
from zeroshard.optim_state_dict import _owner


def _scan(span: range, pieces: list[range]) -> int | None:
    """The scan ``_owner`` replaced (quadratic over a sub-group's parameters)."""
    return next(
        (
            j
            for j, p in enumerate(pieces)
            if span.stop > span.start and p.start <= span.start and span.stop <= p.stop
        ),
        None,
    )


def test_the_owner_is_the_scan_s():
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(1, 8)))
        bounds = [0, *cuts, 60]
        pieces = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        pieces += [range(c, c) for c in rng.sample(bounds, 2)]  # empty pieces where others start
        rng.shuffle(pieces)  # (the sub-group's order is torch's parameter order)
        spans = sorted((p.start, p.stop, j) for j, p in enumerate(pieces))
        for _ in range(20):
            a = rng.randrange(0, 61)
            span = range(a, min(60, a + rng.randint(0, 10)))
            found = _owner(span, spans)
            expected = _scan(span, pieces)
            assert found == expected, (span, pieces, found, expected)


def _states(opt) -> list[tuple[int, torch.Tensor]]:
    """``(data_ptr, copy)`` of each element-wise state this rank holds, in a fixed order."""
    return [
        (v.data_ptr(), v.detach().clone())
        for st in opt.state.values()
        for _, v in sorted(st.items())
        if torch.is_tensor(v) and v.ndim
    ]


def _loaded_in_place(stage: int) -> dict:
    """Save, step on, load the save back: the states the rank held are the ones loaded into
    (the load had built every new state before loading any: a second copy of the rank's
    optimizer states at its peak). Then a dict whose last entry is no row chunk on one rank:
    refused on every rank before any state is written."""
    from torch.distributed.tensor import DTensor, Shard

    from zeroshard.state_dict_layout import device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)

    def step() -> None:
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    saved = opt.state_dict()
    saved_states = _states(opt)
    step()
    before = _states(opt)
    opt.load_state_dict(saved)
    after = _states(opt)
    out = {
        "in place": [p for p, _ in after] == [p for p, _ in before],
        "loaded": all(torch.equal(a, s) for (_, a), (_, s) in zip(after, saved_states)),
    }
    step()
    before = _states(opt)
    rows = 5 if dist.get_rank() == 0 else 3  # (torch.chunk's split of 8: 4 and 4)
    bad = {**saved, "state": {k: dict(v) for k, v in saved["state"].items()}}
    bad["state"]["3.bias"]["exp_avg_sq"] = DTensor.from_local(
        torch.zeros(rows), device_mesh(model), [Shard(0)], run_check=False, shape=(8,), stride=(1,)
    )
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(bad)
    out["said"] = [str(info.value)]
    # Entries no copy can take, on the rank holding the piece alone (it raised there, its
    # state zeroed, the other rank loaded), refused on every rank too.
    for entry in (torch.empty(8, device="meta"), 0.5):
        bad["state"]["3.bias"]["exp_avg_sq"] = entry
        with pytest.raises(ValueError) as info:
            opt.load_state_dict(bad)
        out["said"].append(str(info.value))
    out["untouched"] = all(torch.equal(a, b) for (_, a), (_, b) in zip(_states(opt), before))
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_load_writes_the_states_in_place_or_none_of_them(workers2, stage):
    for r in workers2.run(_loaded_in_place, stage):
        assert r["in place"] and r["loaded"] and r["untouched"], r
        split, meta, number = r["said"]
        assert "does not hold its rank's row chunk" in split, split
        assert "'exp_avg_sq' of 3.bias is a tensor on the meta device" in meta, meta
        assert "'exp_avg_sq' of 3.bias is float, not values" in number, number
        assert all(said.endswith("nothing was loaded") for said in r["said"]), r["said"]
