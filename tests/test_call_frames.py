"""``zeroshard.call_frames``: a forward interrupted by Ctrl-C (``KeyboardInterrupt``, for which
torch runs no ``always_call`` hook) is over, and is cleaned up as one that raised."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import zeroshard
from zeroshard import call_frames
from zeroshard.engine import Phase, engine_of


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.interrupt = nn.Linear(16, 16), False

    def forward(self, x):
        if self.interrupt:
            raise KeyboardInterrupt  # what Ctrl-C raises mid-forward
        return torch.tanh(self.fc(x))


def _interrupted(stage: int) -> dict:
    model = nn.Sequential(_Block(), _Block(), _Block())
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class(_Block))
    engine = engine_of(model)
    model[1].interrupt = True
    try:
        with torch.no_grad():
            model(torch.randn(2, 16))
    except KeyboardInterrupt:
        pass
    model[1].interrupt = False
    left = engine.phase is Phase.FORWARD  # no hook ran: the engine cannot have seen it end
    with zeroshard.summon_full_params(model):  # refused "inside forward or backward" before
        pass
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(torch.randn(2, 16))
    return {
        "left": left,
        "idle": engine.phase is Phase.IDLE,
        "warned": [str(w.message) for w in said],
    }


def test_a_forward_interrupted_by_ctrl_c_is_over(workers2):
    for stage in (0, 3):
        for r in workers2.run(_interrupted, stage):
            assert r == {"left": True, "idle": True, "warned": []}, r


def test_a_call_runs_while_a_call_of_its_module_is_on_the_stack():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, again: bool = False):
            if again:
                return self(x)
            seen["call"] = call_frames.current(self)
            seen["inside"] = call_frames.running(seen["call"], self)
            seen["besides"] = call_frames.running(seen["call"], self, besides_current=True)
            return x

    probe = Probe()
    probe(torch.ones(1))
    assert seen["call"] is not None and seen["inside"] and not seen["besides"]
    assert not call_frames.running(seen["call"], probe)  # returned
    probe(torch.ones(1), again=True)  # called from inside a call of its own
    assert seen["besides"]
    assert call_frames.current(probe) is None and call_frames.running(None, probe)  # unknown
