"""What autograd saves, measured on the meta device (``zeroshard.planner.saved``), against the
same models run for real on the CPU in the test: every family's bytes per unit, parameters left
out, storages counted once, and the checkpointed terms built from them."""

from __future__ import annotations

import pytest
import torch
from test_planner_hf import HF_CONFIGS

from zeroshard.models.gpt import GPT, PRESETS
from zeroshard.planner import describe, memory, saved, timeline


def _real_saved(model, unit_names, batch: int, seq: int, vocab: int, call: str) -> dict:
    """Bytes of the distinct storages autograd saves in a real CPU forward and loss, parameters
    and buffers left out (they are model states and buffers: a saved view of one, BERT's
    ``token_type_ids``, takes no memory), by unit (forward index) and "root": the reference
    the meta measurement must match."""
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    where, found = ["root"], {}
    for i, name in enumerate(unit_names):
        unit = model.get_submodule(name)
        unit.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i))
        unit.register_forward_hook(lambda m, a, o: where.__setitem__(0, "root"))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in found:
            found[storage.data_ptr()] = (where[0], storage.nbytes(), t)
        return t

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x, labels=y).loss if call == "hf" else model(x, y)
    out: dict = {}
    for w, num_bytes, _ in found.values():
        out[w] = out.get(w, 0) + num_bytes
    return out


@pytest.mark.parametrize("name", ["gpt2", "t5", "llama", "bert"])
def test_meta_measurement_is_what_a_real_forward_saves(name):
    pytest.importorskip("transformers")
    from zeroshard.planner import hf

    model = describe.from_hf_config(HF_CONFIGS[name])
    profile = model.activations
    assert profile is not None and profile.call == "hf"
    got = profile.at(micro_batch_size=3, seq_len=24)
    torch.manual_seed(0)
    real = hf.build(HF_CONFIGS[name], device="cpu").train()
    want = _real_saved(real, profile.unit_names, 3, 24, HF_CONFIGS[name]["vocab_size"], "hf")
    assert got.unit_bytes == tuple(want.get(i, 0) for i in range(len(profile.unit_names)))
    assert sum(got.before_unit_bytes) + got.tail_bytes == want["root"]
    assert len(got.unit_bytes) == len(model.block_unit_numels)
    # The loss's fp32 log-probabilities are the root's largest saved tensor after the units.
    assert got.largest_tail_tensor_bytes == 3 * 24 * HF_CONFIGS[name]["vocab_size"] * 4


def test_reference_gpt_measured_as_the_formula_counts():
    """The reference GPT through ``from_module``: each block saves exactly what the fitted
    formula says (fused attention: a log-sum-exp per head), measured on meta."""
    cfg = PRESETS["nano"]
    model = describe.from_module(lambda: GPT(cfg), wrap="Block")
    got = model.activations.at(micro_batch_size=2, seq_len=cfg.block_size)
    per_layer = timeline.saved_activation_bytes_per_layer(
        micro_batch_size=2,
        seq_len=cfg.block_size,
        hidden_size=cfg.n_embd,
        num_heads=cfg.n_head,
        activation_bytes=4,
        flash_attention=True,
    )
    assert got.unit_bytes == (per_layer,) * cfg.n_layer
    # The head's parameters: ln_f (weight and bias) and the tied embedding (lm_head).
    assert got.tail_param_numel == 2 * cfg.n_embd + cfg.vocab_size * cfg.n_embd


def test_parameters_and_shared_storages_are_not_counted():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x, y):
            h = self.emb(x)
            for b in self.blocks:
                h = b(h) * h  # the product saves h twice: one storage
            return h.sum()

    model = describe.from_module(Tiny, wrap="Linear")
    got = model.activations.at(micro_batch_size=2, seq_len=5)
    tokens_bytes = 2 * 5 * 8 * 4
    # Block 0 saves its input (the embedding's output) for its weight gradient; the product
    # after it (in the root) saves h and the block's output: h is that storage already.
    assert got.unit_bytes == (tokens_bytes, tokens_bytes)
    assert got.before_unit_bytes[0] == 2 * 5 * 8  # the int64 token ids, saved by the embedding
    assert got.unit_input_bytes == (tokens_bytes, tokens_bytes)
    assert model.activations.largest_param_numel == 64


def test_bf16_measures_in_bf16():
    pytest.importorskip("transformers")
    profile = describe.from_hf_config(HF_CONFIGS["llama"]).activations
    fp32 = profile.at(micro_batch_size=2, seq_len=16, activation_bytes=4)
    bf16 = profile.at(micro_batch_size=2, seq_len=16, activation_bytes=2)
    # Half as much in the blocks, but not less: RMSNorm's fp32 upcasts stay fp32.
    for a, b in zip(fp32.unit_bytes, bf16.unit_bytes, strict=True):
        assert a / 2 < b < a
    # The loss runs on logits.float(): its log-probabilities are fp32 either way.
    assert bf16.largest_tail_tensor_bytes == fp32.largest_tail_tensor_bytes


def test_checkpointing_keeps_span_inputs_and_recomputes_one_span():
    pytest.importorskip("transformers")
    model = describe.from_hf_config(HF_CONFIGS["t5"])  # 4 units: 2 encoder, 2 decoder blocks
    s = model.activations.at(micro_batch_size=2, seq_len=16)
    root = sum(s.before_unit_bytes) + s.tail_bytes
    for ci, starts in ((1, (0, 1, 2, 3)), (2, (0, 2)), (4, (0,))):
        plan = memory.plan_memory(
            model,
            memory.MemoryConfig(
                stage=3,
                micro_batch_size=2,
                seq_len=16,
                activation_bytes=4,
                num_layers_per_checkpoint=ci,
            ),
        )
        assert plan.device["activation_checkpoints"] == sum(s.unit_input_bytes[i] for i in starts)
        span = max(sum(s.unit_bytes[i : i + ci]) for i in starts)
        assert plan.device["activation_working"] == span + root
        assert plan.device["logits"] == 2 * s.largest_tail_tensor_bytes


def test_a_model_returning_logits_is_measured_with_trains_loss():
    """``zeroshard train --model``'s contract, ``model(x) -> logits``: measured with the loss
    that training adds (``next_token_loss``), as the same network returning that loss is."""

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.head = torch.nn.Linear(8, 32)

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = torch.tanh(b(h))
            return self.head(h)

    class WithLoss(LM):
        def forward(self, x, y):
            logits = super().forward(x)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    logits = describe.from_module(LM, wrap="Linear")
    loss = describe.from_module(WithLoss, wrap="Linear")
    assert (logits.activations.call, loss.activations.call) == ("logits", "xy")
    got = logits.activations.at(micro_batch_size=2, seq_len=6)
    want = loss.activations.at(micro_batch_size=2, seq_len=6)
    assert got == want and got.tail_bytes > 2 * 6 * 32 * 4  # the log-probabilities, at least


class _TorchEncoder(torch.nn.Module):
    """Token ids -> ``nn.TransformerEncoderLayer`` x 2 -> logits; ``model(x, y)`` is the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        layer = dict(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(**layer) for _ in range(2)
        )
        self.head = torch.nn.Linear(64, 256)

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_multi_head_attention_is_measured_with_the_cpus_fused_kernel():
    # nn.MultiheadAttention calls scaled_dot_product_attention from inside another torch
    # function, where the measuring mode was off: the math path's probabilities were counted
    # (a wrapped nn.Transformer's peak planned +32%).
    torch.manual_seed(0)
    real = _TorchEncoder().train()
    model = describe.from_module(real, wrap=("TransformerEncoderLayer",))
    profile = model.activations
    got = profile.at(micro_batch_size=4, seq_len=64)
    want = _real_saved(real, profile.unit_names, 4, 64, 256, "xy")
    assert got.unit_bytes == tuple(want.get(i, 0) for i in range(len(profile.unit_names)))
    assert torch.nn.functional.scaled_dot_product_attention.__name__ == (
        "scaled_dot_product_attention"  # (put back)
    )


def test_a_forward_that_fails_gives_the_model_s_own_error():
    """Whisper fed token ids fails in its encoder; torch's MemTracker (the forward's peak), as
    the forward unwound, put "cannot register a hook on a tensor that doesn't require gradient"
    in place of that error in the plan's note, for each way of calling it."""
    transformers = pytest.importorskip("transformers")
    from zeroshard.planner import saved

    config = transformers.WhisperConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
        num_mel_bins=8, max_source_positions=16, max_target_positions=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.WhisperForConditionalGeneration(config)
    units = ("model.encoder.layers.0", "model.decoder.layers.0")
    with pytest.raises(ValueError) as info:
        saved.profile(model, units)
    said = str(info.value)
    assert "cannot register a hook" not in said, said
    assert "hf: the forward at 1 x 8 tokens failed on meta (AttributeError" in said, said


def test_a_mask_that_needs_a_gradient_takes_the_math_path_on_meta_as_on_the_cpu():
    # T5's position bias is trained: the CPU takes the math path for it (the fused kernel has
    # no gradient for a mask), and on meta the plan ran the fused one and failed (a reviewer).
    import torch.nn.functional as F

    q = torch.randn(1, 4, 8, 16, requires_grad=True)
    k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16)
    bias = torch.randn(1, 4, 8, 8, requires_grad=True)
    assert torch._fused_sdp_choice(q, k, v, bias, 0.0, False) == 0  # (the math path)

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, device="meta", requires_grad=t.requires_grad)

    with saved._cpu_attention_choice():
        out = F.scaled_dot_product_attention(meta(q), meta(k), meta(v), attn_mask=meta(bias))
    assert out.shape == q.shape and out.requires_grad


def test_a_question_answering_head_is_measured():
    # Its start and end logits stand in for its loss (every way of calling it failed: no
    # activations counted, a reviewer).
    transformers = pytest.importorskip("transformers")

    def build():
        config = transformers.BertConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32,
        )  # fmt: skip
        return transformers.BertForQuestionAnswering(config)

    model = describe.from_module(build)
    assert model.activations is not None and model.activations.call == "hf_logits"
    assert model.activations.at(micro_batch_size=2, seq_len=16).total_bytes > 0


def test_the_forward_peak_tracker_agrees_with_torch_s_memtracker():
    """The planner's tracker keeps the process's peak only (torch's updates every module's
    peak at every operator: planning 500 small blocks took 43 s, now 21 s): the same peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from zeroshard.planner.saved import _global_peak_tracker

    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
        x = torch.randn(8, 32, requires_grad=True)
    peaks = []
    for tracker in (MemTracker(), _global_peak_tracker()):
        model.zero_grad(set_to_none=True)
        tracker.track_external(model)
        with tracker:
            model(x).square().sum().backward()
        peaks.append(tracker.get_tracker_snapshot("peak"))
    assert peaks[0] == peaks[1] and peaks[0][torch.device("meta")]["Total"] > 0, peaks
