"""Auto-wrap policies and parameter ownership (pure: no process group needed)."""

from __future__ import annotations

import warnings

import pytest
import torch
from parity_models import FrozenMLP, OddLayer, OddModel
from torch import nn

from zeroshard import wrap
from zeroshard.models.gpt import GPT, PRESETS, Block


def _names(specs):
    return {s.name: sorted(name for _, _, name in s.params) for s in specs}


def test_by_class_units_and_tied_embedding_owned_by_root():
    model = GPT(PRESETS["nano"])
    specs = wrap.units(model, wrap.by_class(Block))
    assert [s.name for s in specs] == ["", "blocks.0", "blocks.1"]
    root = _names(specs)[""]
    # wte.weight is registered by wte and lm_head, both outside any block: the root owns it once.
    assert root == ["ln_f.bias", "ln_f.weight", "wpe.weight", "wte.weight"]
    assert all(name.startswith("blocks.0.") for name in _names(specs)["blocks.0"])


def test_by_class_accepts_class_names_like_the_articles_T5Block():
    model = GPT(PRESETS["nano"])
    assert wrap.by_class("Block")(model) == ["blocks.0", "blocks.1"]


def test_class_matching_nothing_lists_the_classes_present():
    with pytest.raises(
        ValueError, match=r"T5Block.*classes of its submodules: Block, CausalSelfAttention"
    ) as info:
        wrap.by_class("T5Block")(GPT(PRESETS["nano"]))
    assert "GPT," not in str(info.value)  # the model's own class is not a submodule's
    with pytest.raises(ValueError, match=r"GPT is the model itself"):
        wrap.by_class("GPT")(GPT(PRESETS["nano"]))


def test_shared_parameter_across_units_goes_to_common_ancestor():
    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    outer = nn.Sequential(Twin(), nn.Linear(4, 2))
    specs = wrap.units(outer, wrap.by_class(nn.Linear, Twin))
    names = _names(specs)
    assert names["0"] == ["0.a.weight"]  # Twin, the common ancestor of a and b
    assert names["0.a"] == ["0.a.bias"] and names["0.b"] == ["0.b.bias"]


def test_a_wrapped_module_whose_parameters_are_all_tied_outside_it_is_said():
    """``by_class(nn.Embedding)`` on a GPT whose input embedding is its head's weight: wte
    makes no unit (the root holds the tied weight), which was silent, while a class that
    matches nothing is an error."""
    with pytest.warns(UserWarning, match=r"wrap: wte make\(s\) no unit: its parameters are "
                                         "shared with a module outside it \\(tied\\)"):  # fmt: skip
        specs = wrap.units(GPT(PRESETS["nano"]), wrap.by_class(nn.Embedding))
    assert [s.name for s in specs] == ["", "wpe"]
    with warnings.catch_warnings():  # (by_size picks it by its count: nothing the user named)
        warnings.simplefilter("error")
        wrap.units(GPT(PRESETS["nano"]), wrap.by_size(1000))


def test_by_size_wraps_bottom_up_and_skips_containers():
    model = GPT(PRESETS["nano"])
    # Each MLP holds 8,352 elements; what is left of a block (4,352) stays below the threshold,
    # and the two leftovers together (8,704) sit in a ModuleList, which has no forward.
    # The tied embedding (8,192) is counted once; its unit is empty since the root owns it.
    assert sorted(wrap.by_size(8_000)(model)) == ["blocks.0.mlp", "blocks.1.mlp", "wte"]
    assert [s.name for s in wrap.units(model, wrap.by_size(8_000))] == [
        "",
        "blocks.0.mlp",
        "blocks.1.mlp",
    ]
    with pytest.raises(ValueError, match="positive"):
        wrap.by_size(0)
    with pytest.raises(TypeError, match="a whole number"):
        wrap.by_size(float("inf"))  # (an OverflowError)


def test_wrapping_a_container_is_an_error():
    with pytest.raises(ValueError, match="ModuleList"):
        wrap.units(FrozenMLP(), wrap.by_predicate(lambda name, m: name == "layers"))
    # parameter containers too: their parameters are read by the parent, never by a call (a
    # ParameterDict unit was never gathered at stage 3), and by_size passes over them
    model = nn.Module()
    model.pd = nn.ParameterDict({"w": nn.Parameter(torch.ones(8, 8))})
    model.pl = nn.ParameterList([nn.Parameter(torch.ones(8, 8))])
    model.head = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"cannot wrap containers \['pd'\].*ParameterDict"):
        wrap.units(model, wrap.by_class(nn.ParameterDict))
    assert wrap.by_size(50)(model) == ["head"]


def test_by_predicate_and_frozen_and_odd_parameters_are_kept():
    specs = wrap.units(OddModel(), wrap.by_predicate(lambda n, m: isinstance(m, OddLayer)))
    owned = [name for s in specs for _, _, name in s.params]
    assert sorted(owned) == sorted(n for n, _ in OddModel().named_parameters())


def test_from_hf_uses_no_split_modules():
    model = GPT(PRESETS["nano"])
    model._no_split_modules = ["Block"]
    assert wrap.from_hf(model)(model) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="_no_split_modules; use by_class"):
        wrap.from_hf(nn.Linear(2, 2))
    # A model without it (DistilBERT's): its layers' class is suggested.
    with pytest.raises(ValueError, match=r"by_class\('Block'\) for the layers of its blocks"):
        wrap.from_hf(GPT(PRESETS["nano"]))


def test_from_hf_on_a_real_transformers_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    names = wrap.from_hf(model)(model)
    assert names == ["transformer.h.0", "transformer.h.1"]
    specs = wrap.units(model, wrap.from_hf(model))
    assert sum(p.numel() for s in specs for _, p, _ in s.params) == sum(
        p.numel() for p in model.parameters()
    )
    assert torch.is_tensor(next(model.parameters()))


def test_shard_s_wrap_takes_classes_and_names_as_by_class():
    """``wrap=Block``, ``"Block"`` or ``[Block]`` (FSDP's ``transformer_layer_cls`` habit) read
    as ``by_class``; before, each failed with an unrelated TypeError."""
    model = GPT(PRESETS["nano"])
    for given in (Block, "Block", [Block], {"Block"}, (Block, "Nothing")):
        assert wrap.as_policy(given)(model) == ["blocks.0", "blocks.1"], given
    policy = wrap.by_size(1)
    assert wrap.as_policy(policy) is policy and wrap.as_policy(None) is None
    assert wrap.by_class((Block,))(model) == wrap.by_class({Block})(model)  # as isinstance
    assert wrap.by_size(1e4)(model) == wrap.by_size(10**4)(model)  # FSDP's min_num_params=1e6


@pytest.mark.parametrize(
    "given, error, said",
    [
        (3, TypeError, "wrap= takes a policy from zeroshard.wrap"),
        (Block(PRESETS["nano"]), TypeError, "got a Block module, not its class"),
        ([Block, 3], TypeError, "wrap= takes a policy"),
        (lambda m: isinstance(m, Block), TypeError, "returned False.*by_predicate"),
        (lambda m: "blocks.0", TypeError, "returned 'blocks.0', not a list"),
        (lambda m: [0], TypeError, "submodule names are strings"),
    ],
    ids=["int", "an instance", "a list with an int", "FSDP1 lambda", "a name", "not names"],
)
def test_a_wrap_that_is_no_policy_is_named(given, error, said):
    with pytest.raises(error, match=said):
        wrap.units(GPT(PRESETS["nano"]), wrap.as_policy(given))


def test_policy_arguments_of_the_wrong_type_are_named():
    with pytest.raises(TypeError, match="by_class takes module classes or class names.*got 1"):
        wrap.by_class(1)
    with pytest.raises(TypeError, match="got Block"):
        wrap.by_class(Block(PRESETS["nano"]))
    for count in ("a", 2.5):
        with pytest.raises(TypeError, match="by_size takes a parameter count"):
            wrap.by_size(count)


def test_a_predicate_of_the_module_alone_is_named():
    """FSDP1's lambda policies took the module alone: a raw TypeError inside shard before."""
    with pytest.raises(TypeError, match=r"with \(name, module\).*lambda name, module"):
        wrap.by_predicate(lambda m: isinstance(m, nn.Linear))
    assert wrap.by_predicate(lambda name, m: isinstance(m, Block))(GPT(PRESETS["nano"]))


def test_multihead_attentions_out_proj_stays_with_its_parent():
    # MultiheadAttention reads out_proj.weight without calling out_proj: as a unit of its own
    # (a Linear, so by_class(nn.Linear) matched it) it was never gathered at stage 3
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    names = [s.name for s in wrap.units(model, wrap.by_class(nn.Linear))]
    assert names == ["", "linear1", "linear2"]
    assert "self_attn.out_proj.weight" in _names(wrap.units(model, wrap.by_class(nn.Linear)))[""]
    assert [s.name for s in wrap.units(nn.MultiheadAttention(8, 2), wrap.by_size(1))] == [""]
