"""ZeRO-Infinity's arithmetic intensity and its published conclusions (§8)."""

import pytest

from zeroshard.planner import bandwidth as b
from zeroshard.planner.describe import TransformerShape

PEAK = 70e12  # the paper's achievable FLOP/s of a V100
SEQ = 1024


def _shape(hd, nl=8):
    return TransformerShape(num_layers=nl, hidden_size=hd, num_heads=16, vocab_size=100)


def test_intensities_follow_from_flops_and_bytes():
    # ait = FLOPs / bytes moved, with Psi = 12 nl hd^2.
    bsz, nl, hd, ci = 3, 8, 256, 2
    flops = b.flops_per_iteration(micro_batch_size=bsz, seq_len=SEQ, num_layers=nl, hidden_size=hd)
    psi = 12 * nl * hd**2
    assert flops == b.flops_per_iteration_params(num_params=psi, micro_batch_size=bsz, seq_len=SEQ)
    assert flops / (2 * 4 * psi) == b.ait_params_grads(micro_batch_size=bsz, seq_len=SEQ)
    assert flops / (2 * 16 * psi) == b.ait_optimizer_states(micro_batch_size=bsz, seq_len=SEQ)
    act_bytes = 4 * (nl / ci) * hd * SEQ * bsz
    assert flops / act_bytes == b.ait_activation_checkpoints(
        hidden_size=hd, num_layers_per_checkpoint=ci
    )


def test_params_and_grads_over_half_at_batch_1_and_70_gbps():
    ait = b.ait_params_grads(micro_batch_size=1, seq_len=SEQ)
    assert round(b.efficiency(ait, 70e9, PEAK), 3) == 0.506


def test_optimizer_states_need_four_times_the_bandwidth():
    for bsz in (1, 2, 8):
        for target in (0.5, 0.9):
            pg = b.ait_params_grads(micro_batch_size=bsz, seq_len=SEQ)
            opt = b.ait_optimizer_states(micro_batch_size=bsz, seq_len=SEQ)
            need_pg = b.required_bandwidth(pg, PEAK, target)
            assert b.required_bandwidth(opt, PEAK, target) == pytest.approx(4 * need_pg)


def test_optimizer_states_90_percent_at_batch_2_needs_1_23_tbps():
    ait = b.ait_optimizer_states(micro_batch_size=2, seq_len=SEQ)
    need = b.required_bandwidth(ait, PEAK, 0.9)
    assert round(need / 1e12, 2) == 1.23
    assert need < 1.5e12  # "nearly 1.5 TB/s" in the paper's text


def test_activation_checkpoints():
    # Above 50% at 2 GB/s for hd = 2K ...
    ait_2k = b.ait_activation_checkpoints(hidden_size=2048, num_layers_per_checkpoint=1)
    assert b.efficiency(ait_2k, 2e9, PEAK) > 0.5
    # ... and under 1 GB/s suffices once hd >= 8K.
    for hd in (8192, 16384, 32768):
        ait = b.ait_activation_checkpoints(hidden_size=hd, num_layers_per_checkpoint=1)
        assert b.required_bandwidth(ait, PEAK, 0.5) < 1e9
    # Not so below 8K: at hd = 1K, 50% needs more than 2 GB/s.
    ait_1k = b.ait_activation_checkpoints(hidden_size=1024, num_layers_per_checkpoint=1)
    assert b.required_bandwidth(ait_1k, PEAK, 0.5) > 2e9


def test_efficiency_and_required_bandwidth_invert():
    for ait in (1.0, 256.0, 49152.0):
        for target in (0.1, 0.5, 0.99):
            need = b.required_bandwidth(ait, PEAK, target)
            assert b.efficiency(ait, need, PEAK) == pytest.approx(target)


def test_intensity_object():
    i = b.intensity(
        micro_batch_size=2, seq_len=SEQ, shape=_shape(8192), num_layers_per_checkpoint=1
    )
    assert i.as_dict() == {
        "params_grads": 2048.0,
        "optimizer_states": 512.0,
        "activation_checkpoints": 24 * 8192.0,
    }
    eff = i.efficiencies(70e9, PEAK)
    assert eff["params_grads"] > eff["optimizer_states"]
    bare = b.intensity(micro_batch_size=1, seq_len=SEQ)
    assert bare.activation_checkpoints is None
    assert bare.efficiencies(70e9, PEAK)["activation_checkpoints"] is None
    # ci beyond nl is capped at nl.
    capped = b.intensity(
        micro_batch_size=1, seq_len=SEQ, shape=_shape(64, nl=2), num_layers_per_checkpoint=10
    )
    assert capped.activation_checkpoints == 24 * 64 * 2


def test_combined_efficiency():
    one = b.combined_efficiency([1024.0], [70e9], PEAK)
    assert one == pytest.approx(b.efficiency(1024.0, 70e9, PEAK))
    two = b.combined_efficiency([1024.0, 256.0], [70e9, 70e9], PEAK)
    assert two < b.efficiency(256.0, 70e9, PEAK)


@pytest.mark.parametrize(
    "call",
    [
        lambda: b.efficiency(0, 1e9, PEAK),
        lambda: b.efficiency(1, -1e9, PEAK),
        lambda: b.efficiency(1, 1e9, 0),
        lambda: b.required_bandwidth(1, PEAK, 1.0),
        lambda: b.required_bandwidth(1, PEAK, 0),
        lambda: b.intensity(micro_batch_size=0, seq_len=SEQ),
    ],
)
def test_errors(call):
    with pytest.raises(ValueError):
        call()
