"""The engine's timeline: the device moment by moment through a step, by hand, and per unit
when a built model gives each unit's size."""

import dataclasses

import pytest

from zeroshard.planner import describe as d
from zeroshard.planner import memory as m
from zeroshard.planner import timeline as t
from zeroshard.planner.memory import MemoryConfig


def test_saved_activations_per_layer_by_hand():
    kw = dict(micro_batch_size=2, seq_len=16, hidden_size=64, num_heads=4)
    # 16 hd activations, a log-sum-exp per head (fp32), 2 LayerNorms x (mean, rstd) in fp32.
    flash = t.saved_activation_bytes_per_layer(**kw, activation_bytes=4, flash_attention=True)
    assert flash == 2 * 16 * (4 * 16 * 64 + 4 * 4 + 4 * 4)
    # Materialized attention keeps the heads x seq probabilities in the activation dtype.
    eager = t.saved_activation_bytes_per_layer(**kw, activation_bytes=2)
    assert eager == 2 * 16 * (2 * 16 * 64 + 2 * 4 * 16 + 4 * 4)


def _engine(stage, **kw):
    """zeroshard's engine in FP32 (what ``zeroshard.planner.calibrate`` measures)."""
    engine = dict(
        num_dp_ranks=2,
        micro_batch_size=2,
        seq_len=16,
        bytes_per_param=m.BytesPerParam(params=4, grads=4, optimizer_states=8),
        activation_checkpointing=False,
        activation_bytes=4,
        flash_attention=True,
        bucket_per_unit=True,
        num_buckets=2,
        fragmentation_fraction=0.0,
    )
    return MemoryConfig(stage=stage, **(engine | kw))


def test_engine_timeline_at_the_loss_by_hand():
    # A wide vocabulary puts the peak at the loss's backward.
    model = d.from_transformer(num_layers=2, hidden_size=32, num_heads=2, vocab_size=4096)
    b = m.plan_memory(model, _engine(3))
    assert b.peak_moment == "loss backward"
    tokens, hd = 2 * 16, 32
    block, root = model.shape.block_numel, model.root_numel
    assert root == model.num_params - 2 * block
    per_layer = tokens * (4 * 16 * hd + 4 * 2 + 16)
    assert b.peak["activation_working"] == 2 * per_layer + tokens * (8 * hd + 8 + 16) + 16 * 8
    assert b.peak["logits"] == tokens * 4096 * 12
    # No flat gradient yet: a unit's is collected from autograd's gradients at its reduction.
    assert b.peak["comm_buckets"] == 0
    assert b.peak["gathered_units"] == 4 * (root + block)  # the root and one prefetched block
    assert b.peak["grads"] == 0  # no shard reduced yet
    assert b.peak["params"] == b.device["params"] == 4 * model.num_params // 2


WIDE = d.from_transformer(num_layers=4, hidden_size=128, num_heads=4, vocab_size=64)


def test_engine_timeline_in_a_units_backward():
    # A narrow vocabulary and a wide model: the peak moves into the last block's backward.
    model = WIDE
    b = m.plan_memory(model, _engine(2, micro_batch_size=4, seq_len=64))
    assert b.peak_moment == "unit backward 0"
    hd = 128
    assert b.peak["comm_buckets"] == 0  # the last block is the first reduced: nothing in flight
    assert b.peak["gathered_units"] == 0  # stage 2 keeps parameters replicated
    assert b.peak["model_state_working"] == 4 * (4 * hd * hd + hd) + 4 * 64 * hd
    assert b.peak["logits"] == 0


def _moments(model, cfg):
    states = m.model_states(
        model.num_params,
        stage=cfg.stage,
        num_dp_ranks=cfg.num_dp_ranks,
        bytes_per_param=cfg.bytes_per_param,
    )[m.Tier.DEVICE]
    if cfg.step_in_backward:
        states["grads"] = 0
    return dict(t.moments(model, cfg, states))


def test_engine_timeline_post_backward_follows_the_engines_schedule():
    # One reduction in flight, counting the one being started (the engine's default): at a
    # unit's post-backward its parameters are freed first (the root and the prefetched unit stay
    # gathered), then the previous unit's reduction is finished (gloo-like staging of its input
    # while waited for), then the unit's gradient is collected: held twice, nothing in flight.
    block, root = WIDE.shape.block_numel, WIDE.root_numel
    cfg = _engine(3, num_buckets=1, reduce_stages_input=True)
    mo = _moments(WIDE, cfg)
    k = 2
    backward = mo[f"unit backward {k}"]
    assert backward["comm_buckets"] == 4 * block  # unit 1's full gradient, in flight
    assert backward["gathered_units"] == 4 * (root + 2 * block)  # root, unit 2, unit 3
    assert backward["grads"] == 4 * 2 * block // 2  # units 0 and 1 reduced: their shards
    end = mo[f"unit backward end {k}"]
    assert end["comm_buckets"] == 4 * block + 4 * block  # ... and autograd's gradient of unit 2
    assert end["gathered_units"] == backward["gathered_units"]
    wait = mo[f"unit reduction wait {k}"]
    assert wait["gathered_units"] == 4 * (root + block)  # unit 2 freed, unit 3 prefetched
    assert wait["comm_buckets"] == 4 * block + 4 * block + 4 * block  # + the staging copy
    post = mo[f"unit post-backward {k}"]
    assert post["gathered_units"] == 4 * (root + block)
    assert post["comm_buckets"] == 2 * 4 * block  # collected: autograd's and the flat copy
    assert post["grads"] == 4 * 2 * block // 2
    assert mo["unit post-backward 3"]["gathered_units"] == 4 * root  # nothing left to prefetch
    assert "unit reduction wait 0" not in mo  # nothing in flight to wait for
    # The root last, by the end-of-backward callback, its gradient (the head's) collected too.
    assert mo["root post-backward"]["comm_buckets"] == 2 * 4 * root
    assert mo["root post-backward"]["gathered_units"] == 0
    assert mo["end of backward"]["comm_buckets"] == 2 * 4 * root  # its buffer and the staging
    assert mo["optimizer step"]["model_state_working"] == 0  # fused AdamW: no temporaries
    # Two in flight: one is still in flight at the collect, two during the backward.
    mo = _moments(WIDE, _engine(3, num_buckets=2, reduce_stages_input=True))
    assert mo[f"unit backward {k}"]["comm_buckets"] == 2 * 4 * block
    assert mo[f"unit reduction wait {k}"]["comm_buckets"] == (2 + 1 + 1) * 4 * block
    assert mo[f"unit post-backward {k}"]["comm_buckets"] == (1 + 2) * 4 * block
    # Without staging (NCCL; zeroshard's gloo reduce-scatter: sends into the output)
    # there is no wait moment.
    assert not any("wait" in name for name in _moments(WIDE, _engine(3, num_buckets=1)))


def test_a_recomputed_span_gathers_one_unit_more_at_stage_3():
    # WIDE has 4 blocks. With one span of all 4, the last block's backward recomputes the
    # other three one at a time beside it and the prefetched one; spans of 2 need no more.
    block, root = WIDE.shape.block_numel, WIDE.root_numel
    ckpt = dict(activation_checkpointing=True, engine_timeline=True)
    for ci, extra in ((4, 1), (2, 0)):
        mo = _moments(WIDE, _engine(3, num_layers_per_checkpoint=ci, **ckpt))
        assert mo["unit backward 0"]["gathered_units"] == 4 * (root + (2 + extra) * block), ci
        assert mo["unit backward 1"]["gathered_units"] == 4 * (root + 2 * block), ci
    assert (
        _moments(WIDE, _engine(2, num_layers_per_checkpoint=4, **ckpt))["unit backward 0"][
            "gathered_units"
        ]
        == 0
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_step_in_backward_drops_the_shards(stage):
    # 32 tokens: model states dominate. Without it the step holds every gradient shard; with it
    # each shard is stepped and dropped as its reduction finishes: grads 0 at every moment.
    cfg = _engine(stage, num_buckets=1)
    sib = _engine(stage, num_buckets=1, step_in_backward=True)
    plain, stepped = m.plan_memory(WIDE, cfg), m.plan_memory(WIDE, sib)
    assert plain.peak["grads"] > 0 and plain.device["grads"] == 4 * WIDE.num_params // 2
    assert stepped.device["grads"] == 0 and stepped.peak["grads"] == 0
    before, after = _moments(WIDE, cfg), _moments(WIDE, sib)
    assert "optimizer step" in before and "optimizer step" not in after
    for name, now in after.items():
        assert sum(now.values()) == sum(before[name].values()) - before[name]["grads"], name
    lower = max(sum(v.values()) - v["grads"] for n, v in before.items() if n != "optimizer step")
    assert stepped.peak_bytes() == lower < plain.peak_bytes()


def test_step_in_backward_needs_partitioned_gradients():
    for stage in (0, 1):
        with pytest.raises(ValueError, match="step_in_backward needs partitioned gradients"):
            _engine(stage, step_in_backward=True)
    nvme = m.OFFLOADS["nvme-optimizer"]
    with pytest.raises(ValueError, match="NVMe"):
        MemoryConfig(stage=3, placement=nvme, step_in_backward=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_timeline_is_bounded_by_the_allowance(stage):
    model = d.from_gpt("tiny")
    b = m.plan_memory(model, _engine(stage, fragmentation_fraction=0.1))
    for category, num_bytes in b.peak.items():
        if category != "fragmentation":
            assert num_bytes <= b.device[category], category
    assert b.peak_bytes() <= b.total_bytes()
    assert b.peak["fragmentation"] > 0
    assert set(b.to_dict()) >= {"peak", "peak_moment"}
    # The papers' allowance has no timeline.
    assert m.plan_memory(model, MemoryConfig(stage=stage)).peak is None


def test_units_of_their_own_sizes():
    # A built model's units, unequal (an encoder-decoder: small encoder blocks, larger decoder
    # blocks): stage 3 gathers the root and the units backward is at, each of its own size,
    # in full (4 bytes per element).
    shape = d.TransformerShape(num_layers=3, hidden_size=32, num_heads=2, vocab_size=64)
    units = (1000, 1000, 3000)  # forward order: backward visits 3000 first
    model = d.ModelDescription(
        num_params=500 + sum(units),
        shape=shape,
        root_unit_numel=500,
        block_unit_numels=units,
        largest_unit_numel=3000,
    )
    assert t.unit_numels(model) == [1000, 1000, 3000]
    moments = dict(t.moments(model, _engine(3, num_units_prefetch=1), _states(model)))
    assert moments["unit backward 0"]["gathered_units"] == 4 * (500 + 3000 + 1000)
    assert moments["unit backward 2"]["gathered_units"] == 4 * (500 + 1000)
    assert moments["loss backward"]["gathered_units"] == 4 * (500 + 3000)
    # Its post-backward holds its own gradient twice and the previous unit's in flight.
    assert moments["unit post-backward 1"]["comm_buckets"] == 4 * (3000 + 2 * 1000)
    # Every unit and the root reduced by the optimizer step: all gradient shards exist.
    step = moments["optimizer step"]
    assert step["grads"] == _states(model)["grads"]


def _states(model):
    return m.model_states(
        model.num_params,
        stage=3,
        num_dp_ranks=2,
        bytes_per_param=m.BytesPerParam(params=4, grads=4, optimizer_states=8),
    )[m.Tier.DEVICE]


def test_description_units_must_add_up():
    with pytest.raises(ValueError, match="own 900 parameters, not num_params=1000"):
        d.ModelDescription(num_params=1000, root_unit_numel=300, block_unit_numels=(300, 300))


@pytest.mark.parametrize(
    "stage, offload", [(2, "cpu-optimizer"), (3, "cpu-optimizer"), (3, "nvme-everything")]
)
def test_offloaded_gradients_are_collected_and_reduced_on_the_device(stage, offload):
    # The engine collects a unit's gradient on the device and reduce-scatters it there; only the
    # reduced shard leaves. The plan showed no gradient buffer at any moment (8.6% under a
    # measured stage-2 Qwen2 peak with the optimizer on the CPU).
    on = _moments(WIDE, _engine(stage, num_buckets=1))
    off = _moments(WIDE, _engine(stage, num_buckets=1, placement=m.OFFLOADS[offload]))
    assert any(now["comm_buckets"] > 0 for now in on.values())
    for name, now in off.items():
        assert now["comm_buckets"] == on[name]["comm_buckets"], name


def test_the_engine_s_constant_buffers_are_its_default_unless_said():
    # as_engine_buckets set constant_buffers=True whatever was asked: a plan for
    # ShardConfig(constant_buffers=False) counted buffers that run does not keep.
    gpt = d.from_gpt("tiny")
    base = MemoryConfig(stage=3, num_dp_ranks=2, activation_checkpointing=False)
    assert base.constant_buffers is None
    assert t.as_engine_buckets(gpt, base).constant_buffers is True
    off = dataclasses.replace(base, constant_buffers=False)
    assert t.as_engine_buckets(gpt, off).constant_buffers is False
    pooled = m.plan_memory(gpt, t.as_engine_buckets(gpt, base))
    unpooled = m.plan_memory(gpt, t.as_engine_buckets(gpt, off))
    # Held throughout: the optimizer step's moment holds the gathered units too.
    assert pooled.device["gathered_units"] == unpooled.device["gathered_units"] > 0
    assert pooled.peak_bytes() >= unpooled.peak_bytes()


def test_the_reference_formula_counts_every_layer_of_a_model_that_is_one_unit():
    # A model with no wrapped units whose forward fails on meta (DeBERTa-v2: no
    # _no_split_modules, a .item() in its forward) kept its embeddings' and head's activations
    # only: 137,728 of 2,251,264 bytes, its peak planned 70% under the measured one.
    model = d.from_transformer(num_layers=2, hidden_size=64, num_heads=4, vocab_size=256)
    alone = dataclasses.replace(model, block_unit_numels=(), root_unit_numel=model.num_params)
    config = _engine(3, micro_batch_size=4, seq_len=64)
    assert t.unit_numels(alone) == []
    per_block, one_unit = (t.activation_terms(x, config) for x in (model, alone))
    assert one_unit.at_loss == per_block.at_loss > 2_000_000
