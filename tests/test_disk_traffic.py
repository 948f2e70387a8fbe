"""``zeroshard train``'s disk traffic (``DiskTraffic``): each byte the swap files move counted
once, whether a swap read it or the store read it ahead."""

from __future__ import annotations

import torch

import zeroshard
from zeroshard.disk_traffic import DiskTraffic
from zeroshard.models.gpt import GPT, Block, GPTConfig

CFG = GPTConfig(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def _states_on_nvme(folder: str) -> dict:
    """Adam's states on NVMe at stage 3, one sub-group per block: after the first steps the
    sub-groups past the first are read ahead into the store's pool at each step's end."""
    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(CFG),
        stage=3,
        wrap=zeroshard.wrap.by_class(Block),
        offload=zeroshard.Offload(optimizer="nvme", folder=folder),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))

    def step() -> None:
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()

    step()  # (the states are made, then written)
    traffic, read_ahead = DiskTraffic(opt), 0
    for _ in range(3):
        step()
        read_ahead += opt._swap.stats()["prefetch_bytes"]  # (collect clears it)
        traffic.collect()
    out = {
        "read": traffic.read_bytes,
        "written": traffic.write_bytes,
        "read_ahead": read_ahead,
        "states": opt._swap.need_bytes,
    }
    opt.close()
    return out


def test_states_read_ahead_are_counted_once(workers1, tmp_path):
    (r,) = workers1.run(_states_on_nvme, str(tmp_path))
    assert r["read_ahead"] > 0, r  # (else this test shows nothing)
    # Each sub-group's record is read once and written once per step: a read ahead was counted
    # again when its swap copied it out of the pool (reads 1.2-1.7x the disk's).
    assert r["read"] == r["written"], r
    assert r["written"] >= 3 * r["states"], r
