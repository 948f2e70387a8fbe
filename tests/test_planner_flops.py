"""FLOPs counted on the built model: by hand for a CNN, equal to a real CPU run's count for
transformers, and what the advisor's compute time and the report's intensities divide."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.models.gpt import GPT, Block, GPTConfig
from zeroshard.planner import describe as d
from zeroshard.planner import flops, report
from zeroshard.planner.advise import Cluster, Workload, advise
from zeroshard.planner.memory import MemoryConfig
from zeroshard.planner.saved import Inputs

BATCH, C, SIDE = 4, 8, 16


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return x + F.relu(self.conv(x))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1),
        Residual(),
        Residual(),
        nn.Flatten(),
        nn.Linear(C * SIDE * SIDE, 10),
    )


def _cnn_description():
    return d.from_module(_cnn, wrap="Residual", inputs=Inputs((3, SIDE, SIDE)))


def test_a_cnn_s_flops_are_its_convolutions_and_its_head():
    counted = _cnn_description().activations.flops(micro_batch_size=BATCH, seq_len=1)
    pixels = BATCH * SIDE * SIDE
    stem, block, head = 2 * 3 * C * 9 * pixels, 2 * C * C * 9 * pixels, 2 * C * SIDE**2 * 10 * BATCH
    assert counted.forward == stem + 2 * block + head
    # Gradients of the weights everywhere, of the inputs everywhere but the image's.
    assert counted.backward == stem + 2 * (2 * block) + 2 * head
    assert counted.recomputed == 2 * block  # the wrapped blocks', not the stem's or head's
    assert counted.per_iteration(checkpointing=True) == 2 * stem + 8 * block + 3 * head


def _real_count(model, run) -> tuple[int, int]:
    with flops.counter() as mode:
        loss = run(model)
        forward = mode.get_total_flops()
        loss.backward()
    return forward, mode.get_total_flops() - forward


def test_counted_on_meta_as_a_real_cpu_run_counts_a_gpt():
    config = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=96, block_size=32)
    torch.manual_seed(0)
    x, y = torch.randint(0, 96, (2, 2, 32))
    counted = d.from_module(lambda: GPT(config)).activations.flops(micro_batch_size=2, seq_len=32)
    real = _real_count(GPT(config), lambda m: m(x, y))
    assert (counted.forward, counted.backward) == real
    # Attention is counted (the CPU's fused kernel: torch's own counter gives it 0).
    with torch.utils.flop_counter.FlopCounterMode(display=False) as torch_mode:
        GPT(config)(x, y).backward()
    assert torch_mode.get_total_flops() < sum(real)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_counted_on_meta_as_a_real_cpu_run_counts_a_transformers_model(family):
    transformers = pytest.importorskip("transformers")
    shape = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if family == "llama":
        make = lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))  # noqa: E731
    else:
        config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        make = lambda: transformers.MixtralForCausalLM(config)  # noqa: E731
    counted = d.from_module(make).activations.flops(micro_batch_size=2, seq_len=16)
    ids = torch.randint(0, 128, (2, 16))
    real = _real_count(make(), lambda m: m(input_ids=ids, labels=ids).loss)
    assert (counted.forward, counted.backward) == real
    if family == "mixtral":  # the experts' grouped matmuls (torch counts them as 0)
        with flops.counter() as mode:
            make()(input_ids=ids)
        grouped = mode.get_flop_counts()["Global"][torch.ops.aten._grouped_mm]
        assert grouped == 2 * (2 * 16) * 2 * (3 * 64 * 96) * 2  # tokens, top 2, 3 matmuls, layers


def test_the_advisor_computes_the_counted_flops():
    model = _cnn_description()
    cluster = Cluster(
        num_devices=2,
        device_memory_bytes=10**12,
        peak_flops=1e12,
        net_bandwidth_bytes_per_s=1e11,
        device_type="cpu",
    )
    workload = Workload(
        seq_len=1, global_batch_size=8, micro_batch_sizes=(BATCH,), stages=(0,), offloads=("none",)
    )
    (candidate,) = advise(model, cluster, workload).feasible
    counted = model.activations.flops(micro_batch_size=BATCH, seq_len=1, checkpointing=True)
    expected = counted.per_iteration(checkpointing=True) / 1e12
    assert candidate.time_seconds["compute"] == pytest.approx(expected)  # was 8 Psi bsz seq


@pytest.mark.parametrize("ci", [0, 1])
def test_the_report_s_intensities_divide_the_counted_flops(ci):
    model = _cnn_description()
    config = MemoryConfig(
        stage=3, micro_batch_size=BATCH, seq_len=1, activation_checkpointing=bool(ci)
    )
    out = report.plan_report(model, config, stages=(3,), offloads=("none",))
    counted = model.activations.flops(micro_batch_size=BATCH, seq_len=1, checkpointing=bool(ci))
    total = counted.per_iteration(checkpointing=bool(ci))
    assert out["flops"] == {
        "per_iteration": total,
        "counted": True,
        "forward": counted.forward,
        "backward": counted.backward,
        "recomputed": counted.recomputed if ci else 0,
    }
    psi = model.num_params
    assert out["intensity"]["params_grads"] == pytest.approx(total / (8 * psi))
    assert out["intensity"]["optimizer_states"] == pytest.approx(total / (32 * psi))
    if ci:  # each checkpoint written once and read once
        checkpoints = out["activation_checkpoint_bytes"]
        assert out["intensity"]["activation_checkpoints"] == pytest.approx(
            total / (2 * checkpoints)
        )
    assert "counted: forward" in report.render_plan(out)


def test_a_shape_alone_keeps_the_paper_s_count():
    model = d.from_gpt("tiny")
    config = MemoryConfig(stage=0, micro_batch_size=2, seq_len=64)
    out = report.plan_report(model, config, stages=(0,), offloads=("none",))
    s = model.shape
    assert out["flops"] == {
        "per_iteration": 96 * 2 * 64 * s.num_layers * s.hidden_size**2,
        "counted": False,
    }
    assert out["intensity"]["params_grads"] == 2 * 64
    assert "the paper's 8*Psi*bsz*seq" in report.render_plan(out)


def test_a_model_whose_backward_fails_on_meta_falls_back_to_the_paper_s_count():
    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("no backward here")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
            self.block = Block(config)
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

        def forward(self, x):  # logits
            return self.head(NoBackward.apply(self.block(self.emb(x))))

    model = d.from_module(Net, wrap="Block")
    config = MemoryConfig(stage=0, micro_batch_size=1, seq_len=8, activation_checkpointing=False)
    with pytest.raises(ValueError, match="counting FLOPs failed on meta .*no backward here"):
        model.activations.flops(micro_batch_size=1, seq_len=8)
    total, counted = flops.of_config(model, config)
    assert counted is None and total == 8 * model.num_params * 8


def test_a_model_without_matmuls_gets_the_paper_s_count():
    """torch counts matmuls, convolutions and attention only: a lookup table's count is 0,
    whose intensities would be 0 (an efficiency of 0 refused as an intensity)."""
    model = d.from_module(lambda: nn.Embedding(32, 32))  # its logits: one row per token id
    config = MemoryConfig(stage=0, micro_batch_size=2, seq_len=8)
    assert model.activations.flops(micro_batch_size=2, seq_len=8).forward == 0
    out = report.plan_report(
        model,
        config,
        stages=(0,),
        offloads=("none",),
        bandwidth_bytes_per_s=1e9,
        peak_flops=1e12,
    )
    assert out["flops"] == {"per_iteration": 8 * model.num_params * 16, "counted": False}
    assert out["intensity"]["params_grads"] == 16
