"""Calibration: the planner's prediction against the engine run for real (nano GPT, 2 and 4 gloo
ranks), and the per-layer activation formula against what autograd actually saves."""

from __future__ import annotations

import dataclasses
import functools
import threading

import pytest
import torch

import zeroshard
from zeroshard.engine import ShardConfig
from zeroshard.models.gpt import GPT, PRESETS
from zeroshard.planner import calibrate, describe, timeline
from zeroshard.planner import memory as m
from zeroshard.planner.calibrate import MODEL_STATES_TOLERANCE, Case
from zeroshard.testing import WorkerError


def _saved_bytes(cfg, batch: int) -> dict[str, int]:
    """Bytes of the distinct activation storages autograd saves, inside each block ("block i")
    and outside them ("head"), for one forward of the reference GPT with the loss."""
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, saved = ["head"], {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved.setdefault(where[0], {})[ptr] = t.untyped_storage().nbytes()
        return t

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda mod, a, i=i: where.__setitem__(0, f"block {i}"))
        block.register_forward_hook(lambda mod, a, o: where.__setitem__(0, "head"))
    x, y = (torch.randint(0, cfg.vocab_size, (batch, cfg.block_size)) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return {k: sum(v.values()) for k, v in saved.items()}


@pytest.mark.parametrize("name", ["nano", "tiny"])
def test_autograd_saves_what_the_planner_counts(name):
    cfg, batch = PRESETS[name], 2
    saved = _saved_bytes(cfg, batch)
    tokens = batch * cfg.block_size
    per_layer = timeline.saved_activation_bytes_per_layer(
        micro_batch_size=batch,
        seq_len=cfg.block_size,
        hidden_size=cfg.n_embd,
        num_heads=cfg.n_head,
        activation_bytes=4,
        flash_attention=True,  # scaled_dot_product_attention's fused kernel, on CPU too
    )
    assert per_layer == tokens * (4 * (16 * cfg.n_embd + cfg.n_head) + 16)
    for i in range(cfg.n_layer):
        assert saved[f"block {i}"] == per_layer
    # Outside the blocks: ln_f's input and output and statistics, token ids, targets and
    # positions (int64), the loss's fp32 log-probabilities, and the scalar loss itself.
    head = tokens * (2 * 4 * cfg.n_embd + 8) + 16 * tokens + 8 * cfg.block_size
    assert saved["head"] == head + 4 * tokens * cfg.vocab_size + 4


def test_engine_config_is_the_engines():
    from zeroshard.engine import ShardConfig

    cfg = calibrate.engine_config(Case(preset="tiny", stage=3), 4)
    assert cfg.num_units_prefetch == ShardConfig().num_prefetch
    assert cfg.num_buckets == ShardConfig().max_inflight_reductions
    assert cfg.bucket_per_unit and not cfg.activation_checkpointing
    assert not cfg.step_in_backward and not cfg.reduce_stages_input  # gloo: sends into the output
    sib = calibrate.engine_config(Case(preset="tiny", stage=3, step_in_backward=True), 4)
    assert sib.step_in_backward
    # Replicated parameters: tiny fits one 25 MiB bucket; 100m's units each overflow one.
    assert not calibrate.engine_config(Case(preset="tiny", stage=2), 2).bucket_per_unit
    assert calibrate.engine_config(Case(preset="100m", stage=2), 2).bucket_per_unit
    assert cfg.seq_len == PRESETS["tiny"].block_size
    assert cfg.bytes_per_param.total == 16 and cfg.fragmentation_fraction == 0


def _check(rows: list[dict]) -> None:
    for row in rows:
        p, meas = row["predicted"], row["measured"]
        assert calibrate.within_tolerance(row), calibrate.render([row])
        for category in m.MODEL_STATES:
            got, want = meas["model_states"][category], p["model_states"][category]
            assert abs(got - want) <= MODEL_STATES_TOLERANCE * want, (category, got, want)
        # After the step, nothing but model states is alive: the tracker and the storages agree,
        # up to a few scalars (the loss, a found-inf flag) and the optimizer's agreement flags
        # (FP32: found_inf, then one per parameter tensor), which gloo may still hold for a
        # moment after the all-reduce returned.
        # At stage 3 the tracker also sees the placeholder element each parameter views at rest
        # (4 bytes each), which no model state's storage holds.
        num_tensors = len(list(GPT(PRESETS[row["case"]["preset"]]).parameters()))
        flags_bytes = 4 * (1 + num_tensors)
        rest_bytes = 4 * num_tensors if row["case"]["stage"] == 3 else 0
        assert (
            abs(sum(meas["model_states"].values()) - meas["model_states_bytes"])
            <= 64 + flags_bytes + rest_bytes
        )
        # Stage 3's constant buffers stay too, free between steps: as much as the step gathered
        # at once (the root and two blocks), up to padding.
        pooled, n = meas["constant_buffers_bytes"], row["num_ranks"]
        num_units = PRESETS[row["case"]["preset"]].n_layer + 1
        assert abs(pooled - p["constant_buffers_bytes"]) <= 4 * (n - 1) * num_units
        assert (pooled > 0) == (row["case"]["stage"] == 3)
        # The ledger against dp_communication, collective by collective; zeroshard pads each
        # flat buffer to a multiple of the rank count (at most N - 1 elements per unit).
        assert set(meas["comm_numel"]) == set(p["comm_numel"])
        for key, want in p["comm_numel"].items():
            assert 0 <= meas["comm_numel"][key] - want <= 2 * (n - 1) * num_units, key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_calibration_nano_two_ranks(workers2, stage):
    _check(workers2.run(calibrate.calibrate, Case(preset="nano", stage=stage)))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_calibration_mixed_precision_two_ranks(workers2, stage):
    # BF16 keeps FP32 masters and an FP32 gradient shard beside its 2-byte copies: ZeRO's
    # 2 + 2 + 12 under-counted it by 11-12% at stages 0-2 (20 bytes per parameter at stage 0).
    rows = workers2.run(calibrate.calibrate, Case(preset="tiny", stage=stage, precision="bf16"))
    for row in rows:
        assert calibrate.within_tolerance(row), calibrate.render([row])
        states = row["measured"]["model_states"]  # (the engine files masters under params)
        want = row["predicted"]["model_states_bytes"]
        assert abs(sum(states.values()) - want) <= MODEL_STATES_TOLERANCE * want
    if stage == 0:
        assert rows[0]["predicted"]["model_states_bytes"] == 20 * 842_496


def test_calibration_nano_two_ranks_step_in_backward(workers2):
    rows = workers2.run(calibrate.calibrate, Case(preset="nano", stage=3, step_in_backward=True))
    _check(rows)
    for row in rows:
        assert row["measured"]["model_states"]["grads"] == 0  # every shard stepped and dropped
        assert row["predicted"]["model_states"]["grads"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_calibration_step_in_backward_with_accumulation(workers2, stage):
    # Measured as `zeroshard train` runs it (only the last micro-batch synchronized: stepping in
    # backward refuses one before it; every rank failed); at rest after the step no shard is
    # left (the plan counted those held between micro-batches: +25% / +33%).
    case = Case(preset="nano", stage=stage, step_in_backward=True, grad_accum=2)
    _check(workers2.run(calibrate.calibrate, case))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_calibration_nano_four_ranks(workers4, stage):
    _check(workers4.run(calibrate.calibrate, Case(preset="nano", stage=stage)))


@pytest.mark.parametrize(
    "stage, batch, seq, sib, moment",
    [
        # Stage 3's constant buffers hold the root and two blocks throughout: the loss's
        # backward, every block's activations saved, is the largest moment.
        (3, 2, None, False, "loss backward"),
        # 8 tokens, model states dominate. Stage 3: the end of the second block's backward,
        # its whole gradient (autograd's), the third block's reduction in flight, the first
        # block prefetched (the first block's own backward holds no idle buffer beside it: the
        # pool frees it); stepping in backward, no shard exists: the first collect (the last
        # block's), its gradient held twice (autograd's and the flat copy).
        (3, 1, 8, False, "unit backward end 2"),
        (3, 1, 8, True, "unit post-backward 0"),
        # With replicated parameters the tiny model is one gradient bucket, reduced after the
        # last unit's backward (stage 2: its full gradient and the shard written).
        (2, 1, 8, False, "bucket reduction"),
        (1, 1, 8, False, "unit backward 0"),
    ],
)
def test_calibration_tiny_peaks_where_the_timeline_says(workers2, stage, batch, seq, sib, moment):
    case = Case(
        preset="tiny", stage=stage, micro_batch_size=batch, seq_len=seq, step_in_backward=sib
    )
    rows = workers2.run(calibrate.calibrate, case)
    _check(rows)
    assert rows[0]["predicted"]["peak_moment"] == moment


def test_render_names_every_configuration():
    model = describe.from_gpt("nano")
    row = {
        "case": {"preset": "nano", "stage": 2, "micro_batch_size": 4, "seq_len": 64},
        "num_ranks": 2,
        "rank": 0,
        "predicted": calibrate.predict(Case(preset="nano", stage=2), 2),
    }
    row["measured"] = dict(row["predicted"])
    text = calibrate.render([row])
    assert "| nano | 4x64 | 2 | 2 |" in text and "+0.000%" in text
    assert "1 of 1 configurations within tolerance" in text
    assert row["predicted"]["comm_numel"] == {
        "reduce_scatter/grads": model.num_params,
        "all_gather/params": model.num_params,
    }


@pytest.mark.parametrize("batch, seq", [(2, 16), (8, 64)])
@pytest.mark.parametrize("name", ["gpt2", "t5", "llama", "bert"])
def test_calibration_hf_stage3_two_ranks(workers2, name, batch, seq):
    """Hugging Face families wrapped by their _no_split_modules, stage 3 on 2 gloo ranks: the
    peak the planner predicts from the built model (its units, and what autograd saves in each,
    measured on meta) against MemTracker's, per rank. 2 x 16 tokens: the units' parameters and
    gradients dominate; 8 x 64: activations do (dropout masks, eager attention
    probabilities, T5's cross-attention and relative position bias, each family's own MLP)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(config=HF_CONFIGS[name], stage=3, micro_batch_size=batch, seq_len=seq)
    rows = workers2.run(calibrate.calibrate, case)
    model = calibrate.describe_case(case)
    assert model.activations is not None  # measured, not the reference GPT's formula
    for row in rows:
        p, meas = row["predicted"], row["measured"]
        assert calibrate.within_tolerance(row), calibrate.render([row])
        # Each unit's parameters gathered at once, never the whole model: between steps the
        # root and at most 1 + prefetch units (the constant buffers the engine keeps), from the
        # built model's own unit sizes; in backward a unit more, where the gradient in flight
        # holds the buffer its unit gave back while the next units are gathered.
        most = 4 * (model.root_numel + 2 * model.largest_unit_numel)
        assert p["constant_buffers_bytes"] <= most
        one_unit = 4 * max(model.largest_unit_numel, model.root_numel)
        assert p["constant_buffers_bytes"] <= p["peak"]["gathered_units"] <= most + one_unit
        pad = 4 * row["num_ranks"] * (1 + len(model.block_unit_numels))
        assert 0 < meas["constant_buffers_bytes"] <= p["constant_buffers_bytes"] + one_unit + pad
        for key, want in p["comm_numel"].items():
            assert 0 <= meas["comm_numel"][key] - want <= 2 * len(model.block_unit_numels) + 2, key
        if batch * seq >= 256:
            # Activations are most of the peak: the bound above is a bound on them. (T5's forward
            # end, its logits and key cache alive unsaved, is above its loss backward.)
            assert p["peak_moment"] == ("loss forward" if name == "t5" else "loss backward")
            assert p["peak"]["activation_working"] > p["peak_bytes"] / 2


_MOE_EVERY_OTHER_LAYER = dict(
    model_type="qwen2_moe", num_hidden_layers=4, hidden_size=128, intermediate_size=256,
    moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=16,
    num_experts_per_tok=2, decoder_sparse_step=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=64,
)  # fmt: skip


def test_units_of_two_sizes_by_turns_keep_one_buffer_per_size_at_stage_3(workers2):
    """Experts every other layer: units of two sizes by turns, so the engine's pool lends one
    buffer of each size at a time (of 1 + prefetch consecutive units, one of each); the plan
    kept 1 + prefetch per size, a large unit's buffer more than the engine: +8.3% here (stage
    0, which gathers nothing, +1.6% then: a weight's gradient and the head's counted as held
    beside the experts' working set, none of them held at stages 0-2), +10.2% on an explorer's
    larger config; now +4.4% (stage 0: 0.0%)."""
    pytest.importorskip("transformers")
    errors = {}
    for stage in (0, 3):
        case = calibrate.HFCase(
            config=_MOE_EVERY_OTHER_LAYER, stage=stage, micro_batch_size=2, seq_len=16
        )
        row = workers2.run(calibrate.calibrate, case)[0]
        assert calibrate.within_tolerance(row), calibrate.render([row])
        p, meas = row["predicted"], row["measured"]
        errors[stage] = (p["peak_bytes"] - meas["peak_bytes"]) / meas["peak_bytes"]
    assert abs(errors[0]) < 0.005 and 0 <= errors[3] < 0.06, errors


@pytest.mark.parametrize("ci", [2, 4])
def test_calibration_hf_with_activation_checkpoints(workers2, ci):
    """T5 (2 + 2 blocks) with checkpoints every ``ci`` units: the engine starts a span at the
    decoder's first block (fed its own embeddings, not the encoder's output), so ``ci`` = 4
    runs the spans of 2. The plan cut one span across encoder and decoder: +33%."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(
        config=HF_CONFIGS["t5"], stage=3, micro_batch_size=4, seq_len=32, checkpoint_every=ci
    )
    for row in workers2.run(calibrate.calibrate, case):
        assert calibrate.within_tolerance(row), calibrate.render([row])


OPT = dict(
    model_type="opt", num_hidden_layers=2, hidden_size=64, ffn_dim=256, num_attention_heads=4,
    vocab_size=256, max_position_embeddings=512, word_embed_proj_dim=64, pad_token_id=1,
)  # fmt: skip


BLOOM = dict(model_type="bloom", n_layer=2, hidden_size=64, n_head=16, vocab_size=256)


def test_the_forward_under_checkpoints_holds_what_a_unit_returns(workers2):
    """BLOOM's blocks return their attention probabilities (batch x heads x T x T), which its
    model's loop holds until the next block returns. Saved anyway without checkpoints; with a
    checkpoint per block they are no saved tensor, yet alive through the next block's forward,
    whose own scores are made beside them: the peak is in the forward. The plan took the
    forward's peak as the checkpoints' and put the peak in the backward: -25.6% in FP32 at
    2 x 256 tokens (-14% in BF16 at 2 x 512)."""
    pytest.importorskip("transformers")
    case = calibrate.HFCase(
        config=BLOOM, stage=3, micro_batch_size=2, seq_len=256, checkpoint_every=1
    )
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert p["peak_moment"] == "loss forward", calibrate.render([row])
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= 0.01, row


@pytest.mark.parametrize("name, precision", [("bloom", "fp32"), ("llama", "bf16"), ("t5", "fp32")])
def test_a_span_s_recomputation_is_followed(workers2, name, precision):
    """Two units per span, stage 0, 4 x 64 tokens: the peak is in the last unit's backward as it
    recomputes its span. BLOOM's recomputed attention holds its scores and masked weights (its
    code's locals) beside the saves: not followed, -5.7% (and its head's gradient of the tied
    embedding, held by autograd, was not counted: a custom ``Function``, its GeLU, hid the
    head's use of it, -0.8%). In BF16, Llama's first norm saves its input's FP32 copy alone: the
    span's input is a storage of its own, held by the checkpoint, -0.9%. T5's recomputed first
    block's position bias is alive through the second's recomputation, -0.3%."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    config = BLOOM if name == "bloom" else HF_CONFIGS[name]
    _peak_at(
        workers2, config, 0.001, stage=0, micro_batch_size=4, seq_len=64, precision=precision,
        checkpoint_every=2,
    )  # fmt: skip


def _peak_at(workers2, config: dict, within: float, moment: str = "unit backward", **case) -> None:
    """``config`` calibrated (``HFCase`` fields in ``case``; a checkpoint per unit unless it
    says): on every rank the plan's peak is at ``moment`` (a prefix), within ``within`` of the
    measured one."""
    case = calibrate.HFCase(config=config, **{"checkpoint_every": 1, **case})
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert p["peak_moment"].startswith(moment), calibrate.render([row])
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= within, row


@pytest.mark.parametrize("name", ["opt", "llama", "gpt2"])
def test_a_unit_s_backward_working_set_is_followed(workers2, name):
    """A checkpoint per unit, stage 3, 32 x 64 tokens: the peak is inside the last unit's
    recomputed backward, whose working set depends on its operators. OPT's ReLU saves its output
    (the projection's saved input), so its backward holds it beside two gradients of the MLP's
    width; Llama's gated MLP holds three at once; GPT-2's GELU frees what its projection saved
    first. The plan counted one such gradient for every family: OPT -15.9%, Llama -9.1%, GPT-2
    -5.5% (+9.9% at 8 x 256 tokens)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    config = OPT | {"dropout": 0.0} if name == "opt" else HF_CONFIGS[name]
    _peak_at(workers2, config, 0.01, stage=3, micro_batch_size=32, seq_len=64)


GPT_NEOX = dict(
    model_type="gpt_neox", num_hidden_layers=2, hidden_size=64, intermediate_size=256,
    num_attention_heads=4, vocab_size=256, max_position_embeddings=128, rotary_pct=0.25,
)  # fmt: skip


@pytest.mark.parametrize("ci", [1, 2])
def test_a_fused_projection_under_checkpoints_is_planned_without_the_cache(workers2, ci):
    """Under activation checkpointing the engine runs Hugging Face models without their
    key/value cache; GPT-NeoX's value then stays a view of its fused query-key-value
    projection, which the attention saves whole (with the cache, a copy of the value alone).
    The plan measured the forward with the cache: 5.7% and 7.6% low at ci 1 and 2 (Falcon,
    Phi-3 alike)."""
    pytest.importorskip("transformers")
    case = calibrate.HFCase(
        config=GPT_NEOX, stage=3, micro_batch_size=8, seq_len=64, checkpoint_every=ci
    )
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= 0.01, row


@pytest.mark.parametrize("name, stage", [("llama", 0), ("t5", 3)])
def test_calibration_hf_mixed_precision(workers2, name, stage):
    """BF16 on Hugging Face families: FP32 masters and gradient beside BF16 working copies,
    BF16 activations measured on meta (``HFCase`` ran FP32 only)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(
        config=HF_CONFIGS[name], stage=stage, micro_batch_size=4, seq_len=64, precision="bf16"
    )
    for row in workers2.run(calibrate.calibrate, case):
        assert calibrate.within_tolerance(row), calibrate.render([row])


@pytest.mark.parametrize("name, stage", [("qwen2_moe", 0), ("qwen2_moe", 3), ("gpt_neo", 3)])
def test_calibration_more_families(workers2, name, stage):
    """Qwen2-MoE's experts multiply through ``torch._grouped_mm``, whose meta kernel took BF16
    only: the forward on meta failed and the plan fell back to the GPT formulas (with a
    warning). GPT-Neo slices a 512 x 512 causal-mask buffer in every layer: each slice counted
    the whole buffer as a saved activation (+7.6% at stage 3), and the buffers were missing
    from the model states alive after the step (-31%)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(config=HF_CONFIGS[name], stage=stage, micro_batch_size=4)
    case = dataclasses.replace(case, seq_len=64)
    assert calibrate.describe_case(case).activations is not None
    for row in workers2.run(calibrate.calibrate, case):
        assert calibrate.within_tolerance(row), calibrate.render([row])


OLMOE = dict(
    model_type="olmoe", num_hidden_layers=2, hidden_size=64, intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
    pad_token_id=0, num_experts=16, num_experts_per_tok=2,
)  # fmt: skip
PHI3 = dict(
    model_type="phi3", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
    pad_token_id=0,
)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        # The reference GPT's formula (a preset): 12 hd of its 16 hd per token split, the layer
        # norms' inputs and outputs and the rowwise biases whole.
        Case(preset="tiny", stage=3, micro_batch_size=4, seq_len=64, tp=2),
        Case(preset="tiny", stage=0, micro_batch_size=2, seq_len=16, tp=2),
        # Measured on meta: what lies between Llama's colwise and rowwise projections (its
        # base_model_tp_plan) counted 1/Nm, the norms and the rotary tables whole.
        calibrate.HFCase(config="llama", stage=3, micro_batch_size=4, seq_len=64, tp=2),
        calibrate.HFCase(config="llama", stage=2, micro_batch_size=2, seq_len=16, tp=2),
        # Phi-3's fused projections gather their outputs (colwise_gather_output), and the next
        # Linear saves its slice of them, a copy 1/Nm (rowwise_split_input): +4.6% when that
        # input was counted whole, as saved (OLMo2, gathered q/k/v: -1.5%, the copy missed).
        calibrate.HFCase(config=PHI3, stage=3, micro_batch_size=4, seq_len=64, tp=2),
        # OLMoE's experts stay whole (its plan splits the attention): each unit was planned
        # gathered 1/Nm, as if all split: -9.9%.
        calibrate.HFCase(config=OLMOE, stage=3, micro_batch_size=2, seq_len=16, tp=2),
    ],
    ids=["gpt-s3", "gpt-s0", "llama-s3", "llama-s2", "phi3-s3", "olmoe-s3"],
)
def test_calibration_tensor_parallel(workers2, case):
    """Two gloo ranks as one tensor-parallel pair: model states and the per-rank peak against
    MemTracker's. The activations between a colwise Linear and its rowwise partner are 1/Nm per
    rank (both were over-predicted by 21-34% when they were counted whole)."""
    if isinstance(case, calibrate.HFCase):
        pytest.importorskip("transformers")
        from test_planner_hf import HF_CONFIGS

        if isinstance(case.config, str):
            case = dataclasses.replace(case, config=HF_CONFIGS[case.config])
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= 0.02, row
        assert calibrate.within_tolerance(row), calibrate.render([row])
        assert set(meas["comm_numel"]) == set(p["comm_numel"])


def test_a_unit_s_own_gradients_are_counted_as_they_are_made(workers2):
    """Stage 3, a checkpoint per unit: the peak is inside the last unit's recomputed backward,
    where autograd holds each of the unit's weights' gradients from its making until the
    unit's post-backward. The plan counted the unit's largest weight's gradient beside its
    working set's peak, whichever were made by then: a mixture of experts' stacked gate/up
    weights (OLMoE: 16 x 128 x 64) get theirs after that peak, where only the down weights'
    (half the size) exists: +5.5% at 4 x 64 tokens (Qwen2-MoE +3.0%, Mixtral +2.5%); here, at
    2 x 32, those made before a later moment are more than the largest one: -1.6%. Now the
    gradients made up to each moment, followed on meta."""
    pytest.importorskip("transformers")
    _peak_at(workers2, OLMOE, 0.005, stage=3, micro_batch_size=2, seq_len=32)


def _saved_at_config(case):
    """The saved activations the plan reads for ``case`` on 2 ranks."""
    from zeroshard.planner import saved

    return saved.at_config(calibrate.describe_case(case), calibrate.engine_config(case, 2))


class _Unpicklable(Exception):
    """An error that cannot cross to the other ranks as it is (it holds a lock)."""

    def __init__(self) -> None:
        super().__init__("no plan for this case")
        self.lock = threading.Lock()


def _plan_fails(case) -> dict:
    def fail(*args):
        raise _Unpicklable()

    calibrate.predict, before = fail, calibrate.predict
    try:
        return calibrate.calibrate(case)
    finally:
        calibrate.predict = before


def test_a_plan_that_fails_on_rank_0_is_raised_on_every_rank(workers2):
    """Rank 0 makes the plan for all: its error (one that does not pickle, too) is raised
    there and said on the others, none left waiting in the broadcast."""
    with pytest.raises(WorkerError, match="no plan for this case"):
        workers2.run(_plan_fails, Case(preset="nano", stage=3, micro_batch_size=2, seq_len=16))
    assert workers2.run(_rank_of) == [0, 1]  # (the pool goes on)


def _rank_of() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_a_span_input_its_unit_does_not_save_is_counted():
    """Llama's RMSNorm computes in FP32: in BF16 it saves its upcast copy, not the BF16 input,
    which the span's checkpoint frame keeps beside it through the unit's recomputed backward
    (``SavedActivations.input_saved``); in FP32 the upcast is the input itself."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    for precision, saves in [("bf16", False), ("fp32", True)]:
        case = calibrate.HFCase(
            config=HF_CONFIGS["llama"], micro_batch_size=1, seq_len=8, precision=precision,
            checkpoint_every=1,
        )  # fmt: skip
        s = _saved_at_config(case)
        assert s.input_saved == (saves,) * len(s.unit_bytes), precision


def test_a_span_input_a_unit_inside_its_first_unit_saves_is_saved():
    """BERT wrapped per layer and per attention: the layer's input is saved by its attention
    unit's q/k/v Linears, one storage with the span's checkpoint; it was counted again as a
    checkpoint of its own (+1.7% at stage 3, --ci 1, 4 x 64 tokens; an explorer)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(
        config=HF_CONFIGS["bert"], wrap=("BertLayer", "BertAttention"), micro_batch_size=1,
        seq_len=8, checkpoint_every=1,
    )  # fmt: skip
    s = _saved_at_config(case)
    assert len(s.input_saved) == 4 and all(s.input_saved), s.input_saved


@pytest.mark.parametrize(
    "batch, seq, ci, moment", [(4, 64, 1, "unit backward"), (2, 16, 0, "root reduction finish")]
)
def test_bf16_reductions_are_counted_in_the_reduce_dtype(workers2, batch, seq, ci, moment):
    """BF16 at stage 3 (Qwen2-MoE): a reduce-scatter's output is BF16 (the reduce dtype) while
    in flight, and the FP32 shard is made from it as it finishes, beside it and the full
    gradient. With a checkpoint per unit (4 x 64 tokens) the peak is in the last unit's
    backward, beside the previous unit's reduction in flight and the span's BF16 input, which
    the unit does not save (its norm saves an FP32 copy): counted as an FP32 shard and missed,
    +1.5% (OLMoE +3.4%, Llama +0.6%; FP32 exact). With few tokens (2 x 16) the peak is the last
    unit's reduction finishing before the root's collect, which was no moment: -2.5% (OLMoE
    -3.5%, Mixtral -3.1%)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    _peak_at(
        workers2, HF_CONFIGS["qwen2_moe"], 0.002, moment, stage=3, micro_batch_size=batch,
        seq_len=seq, precision="bf16", checkpoint_every=ci,
    )  # fmt: skip


GEMMA3 = dict(
    model_type="gemma3_text", num_hidden_layers=2, hidden_size=64, intermediate_size=172,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
    max_position_embeddings=128, pad_token_id=0, sliding_window=32,
    layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip


@pytest.mark.parametrize("name, stage", [("llama", 1), ("qwen2_moe", 0), ("llama", 2)])
def test_gradients_copied_into_persistent_buckets_are_not_held(workers2, name, stage):
    """Stages 0-2 with a checkpoint per unit, 4 x 64 tokens: the peak is in the last unit's
    backward. Its weights' gradients go into the persistent buckets as autograd makes them, and
    the head's is in the root's bucket since the loss's backward: none is held beside the
    unit's working set, as they are at stage 3 until each unit's reduction (both were: Llama
    +3.3%, Qwen2-MoE +3.8%)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    _peak_at(workers2, HF_CONFIGS[name], 0.005, stage=stage, micro_batch_size=4, seq_len=64)


@pytest.mark.parametrize("name, within", [("llama", 0.005), ("gemma3", 0.025)])
def test_a_tensor_parallel_unit_s_backward_working_set_is_followed(workers2, name, within):
    """tp 2, a checkpoint per unit, stage 3, 4 x 64 tokens: the peak is inside a recomputed
    unit's backward. Its working set is followed on a copy of the model holding one rank's
    pieces (the whole gradients beside the split ones: Gemma3's four norms of the residual
    stream, Llama's gated MLP); it was taken as the unit's input's and largest saved tensor's
    sizes: Llama -2.5%, Gemma3 -3.8%, low by more than that, as the gradient shards of the
    units reduced were counted by the whole model's shares (not those of the parameters a rank
    holds: 26% of a unit's gradient too much at that moment; followed alone, +0.9% and
    +2.4%)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    config = GEMMA3 if name == "gemma3" else HF_CONFIGS[name]
    _peak_at(workers2, config, within, stage=3, micro_batch_size=4, seq_len=64, tp=2)


def test_calibration_one_rank_reduces_without_a_staging_copy(workers1):
    """One data-parallel rank (a single process, or tensor parallelism over every rank): the
    reduce-scatter is a copy into the shard, with no backend staging a third copy of the bucket
    (gloo's did: 17% above the plan at the bucket's reduction)."""
    rows = workers1.run(
        calibrate.calibrate, Case(preset="tiny", stage=2, micro_batch_size=1, seq_len=8)
    )
    _check(rows)
    assert rows[0]["predicted"]["peak_moment"] == "bucket reduction"


@pytest.mark.parametrize(
    "case",
    [
        Case(preset="tiny", stage=3, micro_batch_size=4, seq_len=128, checkpoint_every=1),
        Case(preset="tiny", stage=3, micro_batch_size=4, seq_len=128, checkpoint_every=2, tp=2),
        Case(preset="tiny", stage=2, micro_batch_size=2, seq_len=64, checkpoint_every=3),
    ],
    ids=["ci1", "ci2-tp2", "ci3-s2"],
)
def test_calibration_with_activation_checkpoints(workers2, case):
    """With checkpoints the engine timeline (``MemoryConfig.engine_timeline``) holds each span's
    input and recomputes one span at a time, at its last unit's backward; the papers' sum of
    every term at once was 25-38% above these runs."""
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= 0.02, row
        assert calibrate.within_tolerance(row), calibrate.render([row])
        assert p["peak_moment"].startswith("unit backward")  # a span recomputed


def test_calibration_of_a_span_longer_than_the_gathered_units(workers2):
    """Stage 3, one span of every block (``tiny``: 4): the recomputation frees the span's units
    but the computing and prefetched ones, and their backward gathers them again: counted in
    the plan's all-gathers (+24% measured against it before) and its peak. The constant gather
    buffers kept for the third unit after the step are not (model states ~10% over)."""
    case = Case(preset="tiny", stage=3, micro_batch_size=4, seq_len=128, checkpoint_every=4)
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= 0.02, row
        assert p["comm_numel"] == meas["comm_numel"], row


class _TableBlock(torch.nn.Module):
    """A block holding a 4 MB buffer (a lookup table), as rotary or ALiBi tables are."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        self.register_buffer("table", torch.zeros(1000, 1000))

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) + self.table[0, :32]


class _TableLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList(_TableBlock() for _ in range(2))
        self.head = torch.nn.Linear(32, 256)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _measure_table_lm(build, stage: int, precision: str = "fp32") -> dict:
    """``calibrate.measure_module`` of a ``_TableLM`` kind (``build``), wrapped per block, on
    4 x 32 tokens."""

    def loss(model, gen):
        x = torch.randint(0, 256, (4, 32), generator=gen)
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())

    wrap = zeroshard.wrap.by_class(_TableBlock)
    mixed = None if precision == "fp32" else precision
    return calibrate.measure_module(
        build, loss, stage=stage, wrap=wrap, num_steps=2, mixed_precision=mixed
    )


def _table_lm_peak(stage: int, precision: str = "fp32") -> int:
    return _measure_table_lm(_TableLM, stage, precision)["peak_bytes"]


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (3, "fp32"), (3, "bf16")])
def test_buffers_are_counted(workers2, stage, precision):
    # 8 MB of buffers beside 0.3 MB of model states: the plan left them out (-95%). BF16 keeps
    # them (persistent, floating) in BF16: 4 MB.
    model = describe.from_module(_TableLM, wrap="_TableBlock")
    assert model.buffer_bytes == 2 * 4_000_000
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=stage, precision=precision), 2),
        micro_batch_size=4,
        seq_len=32,
        bucket_per_unit=timeline.bucket_per_unit(model, stage, ShardConfig().bucket_bytes),
    )
    plan = m.plan_memory(model, config)
    assert plan.device["buffers"] == 2 * 1_000_000 * (2 if precision == "bf16" else 4)
    predicted = plan.peak_bytes()
    measured = max(workers2.run(_table_lm_peak, stage, precision))
    tolerance = 0.02 if precision == "fp32" else calibrate.PEAK_TOLERANCE  # (BF16: +4.6%)
    assert abs(predicted - measured) <= tolerance * measured, (predicted, measured)


class _FrozenEmbeddingLM(_TableLM):
    """A large frozen embedding (a fine-tune's): no gradient, no optimizer state, an FP32
    master all the same."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.table = torch.zeros(1, 32)
        self.emb = torch.nn.Embedding(4096, 32).requires_grad_(False)


def _frozen_states(stage: int) -> int:
    return _measure_table_lm(_FrozenEmbeddingLM, stage)["model_states_bytes"]


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_parameters_are_measured_and_planned(workers2, stage):
    # torch's MemTracker hooks every parameter's gradient: measuring a model with a frozen one
    # raised "cannot register a hook on a tensor that doesn't require gradient".
    model = describe.from_module(_FrozenEmbeddingLM, wrap="_TableBlock")
    config = dataclasses.replace(calibrate.engine_config(Case(stage=stage), 2), micro_batch_size=4)
    predicted = m.plan_memory(model, config).model_states_bytes()
    # What the plan leaves out (the optimizer's step counters, a few scalars: ``timeline``'s
    # "Not counted") is about 300 B of these 347 KB at stage 3: 0.1% left 40 B of margin, and
    # failed now and then in a busy test run (by how much, not recorded).
    for measured in workers2.run(_frozen_states, stage):
        assert abs(predicted - measured) <= 0.002 * measured, (predicted, measured)


@pytest.mark.parametrize(
    "stage, precision, unreduced",
    [(0, "bf16", False), (1, "bf16", False), (2, "bf16", True), (3, "bf16", True),
     (2, "fp32", True), (3, "fp32", False)],
)  # fmt: skip
def test_calibration_gradient_accumulation(workers2, stage, precision, unreduced):
    """Two micro-batches per step. The FP32 gradient of mixed precision appears at the last
    micro-batch's reduction (stages 0-1, and stages 2-3 accumulating unreduced): it was
    counted from the start (+12-18%). At stage 2 accumulating unreduced the buckets are the
    local gradient: counted twice (+17%). Collectives that run every micro-batch, twice. The
    model states at rest after the step hold the gradient shards only (accumulating
    unreduced, the whole local gradient was counted there: +20-25%)."""
    case = Case(
        preset="tiny", stage=stage, seq_len=64, precision=precision, grad_accum=2,
        accumulate_unreduced=unreduced,
    )  # fmt: skip
    for row in workers2.run(calibrate.calibrate, case):
        assert (
            abs(calibrate.error(row["predicted"]["peak_bytes"], row["measured"]["peak_bytes"]))
            < 0.005
        ), calibrate.render([row])
        assert calibrate.within_tolerance(row), calibrate.render([row])
        assert row["predicted"]["comm_numel"] == row["measured"]["comm_numel"]


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_a_gradient_in_its_units_gather_buffer_is_counted_once(workers2, name):
    """On the CPU each unit's collected gradient takes the gather buffer its parameters just
    gave back (the constant buffers, by default): the plan counted it twice, in the pool and
    apart, at the post-backward moments that are the peak when model states dominate (Llama
    +6.5%, a Mixtral +12.4%, an explorer's runs)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(config=HF_CONFIGS[name], stage=3, micro_batch_size=2, seq_len=16)
    for row in workers2.run(calibrate.calibrate, case):
        error = calibrate.error(row["predicted"]["peak_bytes"], row["measured"]["peak_bytes"])
        assert abs(error) <= 0.03, calibrate.render([row])


class _UnusedHeadLM(torch.nn.Module):
    """A language model with a large second head its loss never reaches (a decoder built
    without its encoder's input: BART's cross-attention in ``BartForCausalLM``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList(_TableBlock() for _ in range(2))
        for block in self.blocks:
            block.table = torch.zeros(1, 32)
        self.head = torch.nn.Linear(32, 256)
        self.other_head = torch.nn.Linear(32, 4096)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _unused_head_states(stage: int, precision: str) -> int:
    return _measure_table_lm(_UnusedHeadLM, stage, precision)["model_states_bytes"]


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (2, "bf16"), (3, "fp32")])
def test_parameters_the_loss_never_reaches_have_no_optimizer_states(workers2, stage, precision):
    # They get no gradient, so torch's optimizer makes no state for them: the plan charged
    # Adam's 8 bytes for each (+38% optimizer states for a BART decoder built as a causal LM).
    # Their FP32 masters exist all the same. The unused head lies in the root unit's second
    # half: rank 0 holds the states of nearly every reached parameter, rank 1 few, so the plan
    # is the busiest rank's.
    model = describe.from_module(_UnusedHeadLM, wrap="_TableBlock")
    assert model.stepped is not None
    case = Case(stage=stage, precision=precision)
    config = dataclasses.replace(calibrate.engine_config(case, 2), micro_batch_size=4)
    predicted = m.plan_memory(model, config).model_states_bytes()
    measured = workers2.run(_unused_head_states, stage, precision)
    assert abs(predicted - max(measured)) <= 0.001 * max(measured), (predicted, measured)


def _ordered_lm(order: tuple[int, ...], vocab: int = 256) -> torch.nn.Module:
    """Blocks run in ``order`` (``test_planner_describe.OrderedLM``), wide enough for their
    gathers to matter."""
    from test_planner_describe import OrderedLM

    return OrderedLM(order, width=128, vocab=vocab)


def _ordered_lm_peak(
    order: tuple[int, ...], checkpoint_every: int, batch=(1, 8), vocab: int = 256
) -> int:
    def loss(model, gen):
        x = torch.randint(0, vocab, batch, generator=gen)
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())

    build = functools.partial(_ordered_lm, order, vocab=vocab)
    wrap = zeroshard.wrap.by_class("OrderBlock")
    return calibrate.measure_module(
        build, loss, stage=3, wrap=wrap, num_steps=2, checkpoint_every=checkpoint_every
    )["peak_bytes"]


def _ordered_lm_plan(
    order: tuple[int, ...], checkpoint_every: int, batch=(1, 8), vocab: int = 256
) -> int:
    build = functools.partial(_ordered_lm, order, vocab=vocab)
    model = describe.from_module(build, wrap="OrderBlock")
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3, checkpoint_every=checkpoint_every), 2),
        micro_batch_size=batch[0],
        seq_len=batch[1],
    )
    return m.plan_memory(model, config).peak_bytes()


class _KeepBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.proj = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class _KeepsEveryOutput(torch.nn.Module):
    """Every block's output kept in a list until the head (as ``output_hidden_states`` keeps
    them): under checkpoints, those are the span inputs themselves."""

    def __init__(self, width: int = 128, vocab: int = 256, depth: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_KeepBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 16)

    def forward(self, x, y=None):
        h, outputs = self.embed(x), []
        for block in self.blocks:
            h = block(h)
            outputs.append(h)
        logits = self.head(torch.stack(outputs).sum(0))
        if y is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), (y % 16).flatten())


def _keeps_every_output_peak(checkpoint_every: int) -> int:
    def loss(model, gen):
        x = torch.randint(0, 256, (4, 64), generator=gen)
        return model(x, x)

    wrap = zeroshard.wrap.by_class(_KeepBlock)
    return calibrate.measure_module(
        _KeepsEveryOutput, loss, stage=3, wrap=wrap, num_steps=2, checkpoint_every=checkpoint_every
    )["peak_bytes"]


@pytest.mark.parametrize("checkpoint_every", [1, 2])
def test_span_inputs_the_model_keeps_are_counted_once(workers2, checkpoint_every):
    # The forward measured under checkpoints holds the kept outputs, which are the checkpoints'
    # storages: the plan added the checkpoints on top, +27% / +15% at --ci 1 / 2 (a reviewer).
    model = describe.from_module(_KeepsEveryOutput, wrap="_KeepBlock")
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3, checkpoint_every=checkpoint_every), 2),
        micro_batch_size=4,
        seq_len=64,
    )
    predicted = m.plan_memory(model, config).peak_bytes()
    measured = max(workers2.run(_keeps_every_output_peak, checkpoint_every))
    assert abs(predicted - measured) <= 0.06 * measured, (predicted, measured)


class _BiasedBlock(torch.nn.Module):
    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x, bias):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        q, k, v = (u.transpose(1, 2) for u in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.out(a.transpose(1, 2).reshape(b, t, w))


class _SharedBias(torch.nn.Module):
    """A (B, heads, T, T) bias the root makes once and gives every block beside its input (as
    T5's position bias, Gemma2's masks): the engine keeps it for the recomputations."""

    def __init__(self, width: int = 64, heads: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.rel = torch.nn.Parameter(torch.zeros(heads, 1, 1))
        self.blocks = torch.nn.ModuleList(_BiasedBlock(width, heads) for _ in range(4))

    def forward(self, x, y=None):
        b, t = x.shape
        h = self.embed(x)
        bias = self.rel * h.new_ones(b, self.rel.shape[0], t, t)
        for block in self.blocks:
            h = block(h, bias)
        logits = self.head(h)
        if y is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _checkpointed_peak(root: type, block: type, batch: int) -> int:
    """The measured peak of ``root`` (blocks of class ``block``, token ids in, loss out) at
    stage 3 with a checkpoint per block, ``batch`` x 256 tokens."""

    def loss(model, gen):
        x = torch.randint(0, 256, (batch, 256), generator=gen)
        return model(x, x)

    wrap = zeroshard.wrap.by_class(block)
    return calibrate.measure_module(
        root, loss, stage=3, wrap=wrap, num_steps=2, checkpoint_every=1
    )["peak_bytes"]


def _planned_and_measured(workers2, root: type, block: type, batch: int) -> tuple[int, int]:
    """(predicted, measured) peak bytes of ``_checkpointed_peak``'s run (every rank's most)."""
    model = describe.from_module(root, wrap=block.__name__)
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3, checkpoint_every=1), 2),
        micro_batch_size=batch,
        seq_len=256,
    )
    predicted = m.plan_memory(model, config).peak_bytes()
    return predicted, max(workers2.run(_checkpointed_peak, root, block, batch))


def test_what_a_checkpointed_unit_is_given_beside_its_input_is_counted(workers2):
    # The engine keeps every call's other arguments for the recomputation; the plan counted
    # the first input only: -14% with a 2 MiB bias given to 4 blocks (explorer218).
    predicted, measured = _planned_and_measured(workers2, _SharedBias, _BiasedBlock, 2)
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)


class _GatedBlock(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x, gate):
        return x + gate * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _SharedGate(torch.nn.Module):
    """A learned gate the root makes once, (B, T, width), that needs a gradient, given to every
    block beside its input."""

    def __init__(self, width: int = 64, vocab: int = 256) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.gate = torch.nn.Parameter(torch.zeros(width))
        self.blocks = torch.nn.ModuleList(_GatedBlock(width) for _ in range(4))

    def forward(self, x, y):
        h = self.embed(x)
        g = torch.sigmoid(self.gate) * h.new_ones(h.shape)
        for block in self.blocks:
            h = block(h, g)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_an_extra_input_s_gradient_is_held_by_each_unit_s_backward_hook(workers2):
    # The engine passes a unit's positional inputs through one identity node (its backward
    # hook), which runs once all their gradients are in: each block's gradient of the gate
    # waits there until its backward is done, beside the sum of the later blocks'. The plan's
    # backward on meta, without that node, summed it at once: 3.5% low at --ci 1 (explorer225).
    predicted, measured = _planned_and_measured(workers2, _SharedGate, _GatedBlock, 4)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


FALCON_ALIBI = dict(
    model_type="falcon", alibi=True, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
    vocab_size=128, new_decoder_architecture=False,
)  # fmt: skip


def test_an_extra_input_a_unit_saves_is_one_storage_in_its_recomputation(workers2):
    """Falcon with ALiBi gives every block a (batch, heads, T, T) mask, which the engine keeps
    for the recomputation (an extra input) and the first block's attention saves: its
    recomputation saves the very storage kept, no second one. The plan counted it twice at that
    block's backward (among its saves and as the extra input): +30% at 1 x 128 tokens (+27.6%
    in FP32 and +12.9% in BF16 with 4 layers of 64 at 2 x 256)."""
    pytest.importorskip("transformers")
    case = calibrate.HFCase(
        config=FALCON_ALIBI, stage=3, micro_batch_size=1, seq_len=128, checkpoint_every=1
    )
    for row in workers2.run(calibrate.calibrate, case):
        p, meas = row["predicted"], row["measured"]
        assert abs(calibrate.error(p["peak_bytes"], meas["peak_bytes"])) <= 0.01, row
    extras = (
        calibrate.describe_case(case)
        .activations.at(micro_batch_size=1, seq_len=128, checkpointing=True)
        .extra_inputs
    )
    assert [e.saved_by for e in extras if e.nbytes == 4 * 4 * 128 * 128] == [0], extras


def test_a_unit_that_never_runs_takes_no_prefetched_unit_s_place(workers2):
    # The engine prefetches along the forward it recorded, without the unit that never runs:
    # the plan left it in the window (its size 0), one gathered unit short: 5.5% low (a
    # reviewer); before, it counted the unit as gathered, 3.9% high.
    model = describe.from_module(functools.partial(_ordered_lm, (0, 2, 3)), wrap="OrderBlock")
    assert model.activations.at(micro_batch_size=1, seq_len=8).ran == (True, False, True, True)
    predicted = _ordered_lm_plan((0, 2, 3), 0)
    measured = max(workers2.run(_ordered_lm_peak, (0, 2, 3), 0))
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


@pytest.mark.parametrize("order, checkpoint_every", [((3, 2, 1, 0), 1), ((0, 2, 1, 3), 2)])
def test_units_run_out_of_their_registration_order_are_planned_as_they_run(
    workers2, order, checkpoint_every
):
    # The engine's gathers and checkpoint spans follow the calls; the plan followed the
    # registration order, with a warning only: 52% high for blocks run in reverse at --ci 1,
    # 17% for two swapped at --ci 2 (width 64, 8 x 64 tokens).
    predicted = _ordered_lm_plan(order, checkpoint_every, (4, 64))
    measured = max(workers2.run(_ordered_lm_peak, order, checkpoint_every, (4, 64)))
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


@pytest.mark.parametrize("order", [(1, 0, 1), (0, 1, 2, 2, 1, 0)])
def test_a_forward_ending_on_an_earlier_unit_keeps_its_head_in_the_tail(workers2, order):
    # The head's saves went to the unit after the last one called in the plan's order, not to
    # the tail: 0.80x the measured peak (a reviewer). Blocks called in turn still leave the
    # plan above the peak (a unit's calls counted at once), or within 3% below (a palindrome).
    predicted = _ordered_lm_plan(order, 0, (4, 64), vocab=2048)
    measured = max(workers2.run(_ordered_lm_peak, order, 0, (4, 64), 2048))
    assert -0.03 * measured <= predicted - measured <= 0.06 * measured, (predicted, measured)


def _bert_classifier():
    import transformers

    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _bert_classifier_peak() -> int:
    def loss(model, gen):
        x = torch.randint(0, 1000, (8, 64), generator=gen)
        return model(input_ids=x, labels=torch.randint(0, 3, (8,), generator=gen)).loss

    wrap = zeroshard.wrap.by_class("BertLayer")
    return calibrate.measure_module(_bert_classifier, loss, stage=3, wrap=wrap, num_steps=2)[
        "peak_bytes"
    ]


def test_a_sequence_classifier_s_activations_are_measured(workers2):
    # Its head takes one label per sequence: the planner's probe gave it a language model's
    # labels, every way of calling it failed, and the plan counted no activations with
    # --module (0.33x the measured peak) or a GPT's logits over the vocabulary with --hf
    # (1.40x; an explorer). Its logits' cross-entropy now stands in for its loss.
    pytest.importorskip("transformers")
    model = describe.from_module(_bert_classifier, wrap="BertLayer")
    assert model.activations is not None and model.activations.call == "hf_logits"
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3), 2), micro_batch_size=8, seq_len=64
    )
    predicted = m.plan_memory(model, config).peak_bytes()
    measured = max(workers2.run(_bert_classifier_peak))
    assert abs(predicted - measured) <= calibrate.PEAK_TOLERANCE * measured, (predicted, measured)


_BART_CAUSAL = dict(  # BART's decoder alone (BartForCausalLM): its cross-attention never runs
    model_type="bart",
    architectures=["BartForCausalLM"],
    vocab_size=512,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=128,
)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_decoder_built_without_its_encoder(workers2, stage):
    """A third of each BART decoder layer (cross-attention) gets no gradient, so no optimizer
    state: the plan charged them (+13% model states), and at stage 1 the ranks differ (the
    states follow where the reached parameters fall in each bucket): the plan is the busiest
    rank's. The forward on meta failed too (transformers checks BART's padding mask of ones
    with ``.item()``): the activations came from the reference GPT's formulas."""
    pytest.importorskip("transformers")
    case = calibrate.HFCase(config=_BART_CAUSAL, stage=stage, micro_batch_size=4, seq_len=64)
    model = calibrate.describe_case(case)
    assert model.activations is not None and model.stepped is not None
    rows = workers2.run(calibrate.calibrate, case)
    predicted = rows[0]["predicted"]
    busiest = max(r["measured"]["model_states_bytes"] for r in rows)
    assert abs(calibrate.error(predicted["model_states_bytes"], busiest)) <= 0.001, rows
    peak = max(r["measured"]["peak_bytes"] for r in rows)
    assert abs(calibrate.error(predicted["peak_bytes"], peak)) <= 0.01, rows


@pytest.mark.parametrize("ci", [1, 2])
def test_units_inside_units_in_checkpoint_spans(workers2, ci):
    """MBart's decoder alone: its attention units run inside its layer units, its
    cross-attention never. The engine recomputes them with their layer; the plan opened a span
    at each, so a layer joined the span of the cross-attention before it: -30% at ci 2."""
    pytest.importorskip("transformers")
    config = dict(_BART_CAUSAL, model_type="mbart", architectures=["MBartForCausalLM"])
    case = calibrate.HFCase(
        config=config, stage=3, micro_batch_size=8, seq_len=64, checkpoint_every=ci
    )
    assert any(calibrate.describe_case(case).activations.at(micro_batch_size=1, seq_len=8).inner)
    for row in workers2.run(calibrate.calibrate, case):
        assert calibrate.within_tolerance(row), calibrate.render([row])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_tied_embedding_s_gradients_at_the_root_s_backward(workers2, stage):
    """A head tied to the input embedding: autograd holds the head's gradient until the
    embedding's backward, at the end, adds its own into a third tensor of the weight's size.
    The timeline had no moment for the root's own backward: a GPT-2 whose embedding is large
    beside its blocks was planned 10.5% (stage 3) and 4.1% (stage 0) below its measured peak
    (the same model untied: within 0.2%)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    config = HF_CONFIGS["gpt2"] | {"vocab_size": 2048}
    case = calibrate.HFCase(config=config, stage=stage, micro_batch_size=2, seq_len=16)
    for row in workers2.run(calibrate.calibrate, case):
        error = calibrate.error(row["predicted"]["peak_bytes"], row["measured"]["peak_bytes"])
        assert abs(error) <= 0.01, calibrate.render([row])
        assert row["predicted"]["peak_moment"] == "root backward"


def test_a_reduce_scatter_s_inbox_on_four_ranks(workers4):
    """On 3 or more gloo ranks a reduce-scatter receives its later sources' messages through
    an inbox, held while it is in flight: uncounted, the tied GPT-2 above was 1.7% low on 4
    ranks at its root backward, where the last units' reductions are in flight (a reviewer)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    config = HF_CONFIGS["gpt2"] | {"vocab_size": 2048}
    case = calibrate.HFCase(config=config, stage=3, micro_batch_size=2, seq_len=16)
    rows = workers4.run(calibrate.calibrate, case)
    measured = max(r["measured"]["peak_bytes"] for r in rows)
    error = calibrate.error(rows[0]["predicted"]["peak_bytes"], measured)
    assert abs(error) <= 0.005, calibrate.render(rows)


@pytest.mark.parametrize("batch, seq", [(2, 16), (4, 64)])
def test_t5_s_forward_end_and_its_unit_sizes(workers2, batch, seq):
    """T5's peak is at its forward's end (the logits, the decoder's unscaled output and
    transformers' key cache alive unsaved), with the constant-buffer pool holding one free buffer
    per unit size (five sizes: an idle encoder-block buffer). The timeline had neither: 4.8% low
    at 2 x 16, 1.4% at 4 x 64 (an explorer's measurement of every storage at the peak)."""
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    case = calibrate.HFCase(config=HF_CONFIGS["t5"], stage=3, micro_batch_size=batch, seq_len=seq)
    for row in workers2.run(calibrate.calibrate, case):
        error = calibrate.error(row["predicted"]["peak_bytes"], row["measured"]["peak_bytes"])
        assert abs(error) <= 0.002, calibrate.render([row])
        assert row["predicted"]["peak_moment"] == "loss forward"


def test_calibration_stage_2_with_blocks_sharing_several_buckets(workers2):
    """Blocks of 12 MB, two to a 25 MiB bucket, four of them: planned -11% (one bucket alive,
    where the engine held every bucket: the root's shared one bound through the whole
    backward). The root has a bucket of its own now, and the plan counts the reduction in
    flight beside the bucket filling."""
    pytest.importorskip("transformers")
    config = dict(
        model_type="qwen2", num_hidden_layers=4, hidden_size=512, intermediate_size=1536,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    case = calibrate.HFCase(config=config, stage=2, micro_batch_size=2, seq_len=32)
    for row in workers2.run(calibrate.calibrate, case):
        assert calibrate.within_tolerance(row), calibrate.render([row])


class _ConvBlock(torch.nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.conv, self.norm = (
            torch.nn.Conv2d(channels, channels, 3, padding=1),
            torch.nn.BatchNorm2d(channels),
        )

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


class _ConvNet(torch.nn.Module):
    """A CNN of four residual blocks on 3 x 32 x 32 images: no token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = torch.nn.Sequential(*(_ConvBlock() for _ in range(4)))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _vit():
    import transformers

    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
        image_size=64, patch_size=8, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


class _ImageToImage(torch.nn.Module):
    """Four residual blocks from 3 channels to 32 and back: it returns an image, whose loss
    is smaller than what its last convolution saves."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = torch.nn.Sequential(*(_ConvBlock() for _ in range(4)))
        self.out = torch.nn.Conv2d(32, 3, 3, padding=1)

    def forward(self, x):
        return self.out(self.blocks(self.stem(x)))


_IMAGES = {  # build, wrap, one image's shape, whether it is a transformers model
    "cnn": (_ConvNet, "_ConvBlock", (3, 32, 32), False),
    "vit": (_vit, "ViTLayer", (3, 64, 64), True),
    "image to image": (_ImageToImage, "_ConvBlock", (3, 32, 32), False),
}


def _image_model_peak(which: str, checkpoint_every: int) -> int:
    build, wrap, shape, hf_model = _IMAGES[which]

    def loss(model, gen):
        x = torch.randn((4, *shape), generator=gen)
        out = model(pixel_values=x).logits if hf_model else model(x)
        if out.dim() > 2:  # an image: the mean square error against the input
            return (out - x).square().mean()
        return torch.nn.functional.cross_entropy(out, torch.randint(0, 10, (4,), generator=gen))

    return calibrate.measure_module(
        build,
        loss,
        stage=3,
        wrap=zeroshard.wrap.by_class(wrap),
        num_steps=2,
        checkpoint_every=checkpoint_every,
    )["peak_bytes"]


@pytest.mark.parametrize(
    "which, checkpoint_every",
    [("cnn", 0), ("cnn", 1), ("vit", 0), ("vit", 1), ("image to image", 0)],
)
def test_a_model_without_token_ids_has_its_activations_measured_on_its_inputs(
    workers2, which, checkpoint_every
):
    # Without token ids the planner counted no activations (or the GPT formulas' with a
    # shape): this CNN at 0.08-0.13x its measured peak, a ViT at 0.48-0.83x (and a ResNet at
    # 0.18-0.26x). One image's shape is given for the CNN; the ViT's comes from its config.
    # A model returning an image had the loss's two gradients taken at the size of its last
    # convolution's input, not its output's (+5-6%, a reviewer).
    build, wrap, shape, hf_model = _IMAGES[which]
    if hf_model:
        pytest.importorskip("transformers")
    inputs = None if hf_model else describe.Inputs((shape,))
    model = describe.from_module(build, wrap=wrap, inputs=inputs)
    assert model.activations is not None and model.activations.call == "inputs"
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3, checkpoint_every=checkpoint_every), 2),
        micro_batch_size=4,
    )
    predicted = m.plan_memory(model, config).peak_bytes()
    measured = max(workers2.run(_image_model_peak, which, checkpoint_every))
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


_BERT_SMALL = dict(
    vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    intermediate_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip


def _bert_multiple_choice():
    import transformers

    return transformers.BertForMultipleChoice(transformers.BertConfig(**_BERT_SMALL))


def _t5_encoder():
    import transformers

    config = transformers.T5Config(
        vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_heads=4,
        dropout_rate=0.0,
    )  # fmt: skip
    return transformers.T5EncoderModel(config)


_HEADLESS = {
    "multiple choice": (_bert_multiple_choice, "BertLayer"),
    "encoder": (_t5_encoder, "T5Block"),
}


def _headless_peak(which: str) -> int:
    """2 questions x 4 choices of 64 tokens for the multiple-choice head; 8 x 64 tokens and
    a loss over the hidden states for the T5 encoder, which has no head."""

    def loss(model, gen):
        if which == "multiple choice":
            x = torch.randint(0, 1000, (2, 4, 64), generator=gen)
            logits = model(input_ids=x).logits
            return torch.nn.functional.cross_entropy(
                logits, torch.randint(0, 4, (2,), generator=gen)
            )
        hidden = model(input_ids=torch.randint(0, 512, (8, 64), generator=gen)).last_hidden_state
        return hidden.square().mean()

    build, wrap = _HEADLESS[which]
    wrap = zeroshard.wrap.by_class(wrap)
    return calibrate.measure_module(build, loss, stage=3, wrap=wrap, num_steps=2)["peak_bytes"]


@pytest.mark.parametrize("which", ["multiple choice", "encoder"])
def test_a_multiple_choice_head_and_a_model_without_a_head_are_measured(workers2, which):
    # A multiple-choice head takes (batch, choices, seq) ids, and a backbone (BertModel,
    # T5EncoderModel) returns hidden states, no logits: every way of calling them failed on
    # meta and their activations were not counted (0.36x and 0.22x the measured peak).
    # The planner's micro-batch counts sequences: 2 questions x 4 choices are 8.
    pytest.importorskip("transformers")
    build, wrap = _HEADLESS[which]
    model = describe.from_module(build, wrap=wrap)
    assert model.activations is not None
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3), 2), micro_batch_size=8, seq_len=64
    )
    predicted = m.plan_memory(model, config).peak_bytes()
    measured = max(workers2.run(_headless_peak, which))
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)


def _albert(groups: int):
    """ALBERT: 6 positions sharing ``groups`` layers, each layer called 6 / groups times."""
    import transformers

    config = transformers.AlbertConfig(
        vocab_size=512, embedding_size=32, hidden_size=64, num_hidden_layers=6,
        num_hidden_groups=groups, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.AlbertForMaskedLM(config)


def _albert_loss(model, gen):
    x = torch.randint(0, 512, (8, 64), generator=gen)
    return model(input_ids=x, labels=x).loss


def _albert_measured(groups: int, checkpoint_every: int) -> dict:
    build = functools.partial(_albert, groups)
    wrap = zeroshard.wrap.by_class("AlbertLayer")
    return calibrate.measure_module(
        build, _albert_loss, stage=3, wrap=wrap, num_steps=2, checkpoint_every=checkpoint_every
    )


def _albert_peak(groups: int, checkpoint_every: int) -> int:
    return _albert_measured(groups, checkpoint_every)["peak_bytes"]


@pytest.mark.parametrize("groups, checkpoint_every", [(1, 1), (2, 2)])
def test_a_unit_called_several_times_is_checkpointed_per_call(workers2, groups, checkpoint_every):
    # ALBERT's shared layers: the plan counted one span input per unit and recomputed every
    # call at once, 3.6-3.8x the measured peak; the engine checkpoints each call's input and
    # recomputes one call at a time (a call may join the span of the unit before it).
    pytest.importorskip("transformers")
    model = describe.from_module(functools.partial(_albert, groups), wrap="AlbertLayer")
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3, checkpoint_every=checkpoint_every), 2),
        micro_batch_size=8,
        seq_len=64,
    )
    predicted = m.plan_memory(model, config).peak_bytes()
    measured = max(workers2.run(_albert_peak, groups, checkpoint_every))
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def _albert_gathers(checkpoint_every: int) -> int:
    return _albert_measured(1, checkpoint_every)["comm_numel"]["all_gather/params"]


@pytest.mark.parametrize("checkpoint_every", [0, 3])
def test_a_unit_called_several_times_is_gathered_for_each_call_s_backward(
    workers2, checkpoint_every
):
    # ALBERT's shared layer, called 6 times, is gathered anew for each call's backward: the
    # plan counted one backward gather per unit, a third of the engine's all-gathers (a
    # reviewer).
    pytest.importorskip("transformers")
    from zeroshard.planner import comm

    model = describe.from_module(functools.partial(_albert, 1), wrap="AlbertLayer")
    config = dataclasses.replace(
        calibrate.engine_config(Case(stage=3, checkpoint_every=checkpoint_every), 2),
        micro_batch_size=8,
        seq_len=64,
    )
    config = timeline.as_engine_buckets(model, config)
    collectives = comm.dp_communication(
        model.num_params,
        stage=3,
        num_params_replicated=model.replicated_numel,
        param_dtype_bytes=4,
        reduce_dtype_bytes=4,
        num_params_kept_gathered=model.kept_gathered_numel,
        num_params_gathered_again=comm.gathered_again(model, config),
    )
    planned = sum(
        comm.total_numel((c,), 1)
        for c in collectives
        if (c.op, c.label) == ("all_gather", "params")
    )
    assert planned == max(workers2.run(_albert_gathers, checkpoint_every))
