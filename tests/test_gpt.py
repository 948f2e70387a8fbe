"""The reference GPT: shapes, tied embeddings, presets, and that it never imports zeroshard."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from zeroshard.models import gpt
from zeroshard.models.gpt import GPT, PRESETS, GPTConfig, preset


def test_shapes_and_loss():
    torch.manual_seed(0)
    model = GPT(PRESETS["nano"])
    x = torch.randint(0, 256, (3, 17))
    assert model(x).shape == (3, 17, 256)
    loss = model(x, x)
    assert loss.shape == () and 4.5 < loss.item() < 6.5  # about ln(256) = 5.55 at init


def test_embeddings_are_tied():
    model = GPT(PRESETS["nano"])
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once


@pytest.mark.parametrize("name", ["nano", "tiny", "small", "100m"])
def test_num_params_matches_the_built_model(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_preset_sizes():
    assert 0.5e6 < PRESETS["tiny"].num_params() < 1.5e6
    assert 70e6 < PRESETS["100m"].num_params() < 130e6
    assert 0.9e9 < PRESETS["1b"].num_params() < 1.5e9


def test_bad_config_and_preset():
    with pytest.raises(ValueError, match="must divide"):
        GPTConfig(n_layer=1, n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="tiny"):
        preset("nope")
    with pytest.raises(ValueError, match="block_size"):
        GPT(PRESETS["nano"])(torch.zeros(1, 65, dtype=torch.long))


def test_model_code_never_imports_zeroshard():
    tree = ast.parse(inspect.getsource(gpt))
    modules = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [n])
    ]
    assert not [m for m in modules if m and m.startswith("zeroshard")]
