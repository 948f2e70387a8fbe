"""The report ``zeroshard plan`` prints: built from planner objects and numbers, rendered for
people, and safe for JSON."""

import math

import pytest

from zeroshard.planner import describe as d
from zeroshard.planner import report
from zeroshard.planner.memory import MemoryConfig


def test_plan_report_worked_example():
    out = report.plan_report(
        d.from_params(7_500_000_000),
        MemoryConfig(stage=0, num_dp_ranks=64),
        stages=(0, 3),
        offloads=("none",),
    )
    assert [r["model_states_bytes"] for r in out["stages"]] == [120_000_000_000, 1_875_000_000]
    text = report.render_plan(out)
    assert "Psi = 7.5e9 parameters, Nd = 64" in text and "1.88 GB" in text
    assert "units (" not in text  # a bare count has no units to show


def test_units_line_for_a_built_model():
    model = d.ModelDescription(
        num_params=1000,
        root_unit_numel=400,
        block_unit_numels=(300, 300),
        largest_unit_numel=300,
        wrap_policy="--wrap Block",
        name="toy",
    )
    out = report.plan_report(model, MemoryConfig(stage=3), stages=(3,), offloads=("none",))
    assert out["model"]["num_units"] == 3
    text = report.render_plan(out)
    assert "units (--wrap Block): 3; root unit 400 parameters, largest other unit 300" in text
    # Stage 3 gathers the largest unit, the root here, and its next one, at 2 bytes each.
    assert out["stages"][0]["memory"]["device"]["gathered_units"] == 2 * 2 * 400 + 2 * 400


def test_communication_counts_the_root_kept_and_replicated():
    """Stage 3 gathers the root once per step (kept from forward to backward, as the engine
    does); tensor parallelism leaves it whole on every rank."""
    model = d.ModelDescription(
        num_params=1000, root_unit_numel=400, block_unit_numels=(300, 300),
        largest_unit_numel=300,
    )  # fmt: skip
    numel = {}
    for mp in (1, 2):
        config = MemoryConfig(stage=3, num_mp_ranks=mp)
        out = report.plan_report(model, config, stages=(3,), offloads=("none",))
        gathers = [c for c in out["stages"][0]["communication"]["collectives"]]
        numel[mp] = {(c["op"], c["when"]): c["numel"] for c in gathers}
    assert numel[1] == {
        ("all_gather", "forward"): 1000,
        ("all_gather", "backward"): 600,  # the root stayed gathered
        ("reduce_scatter", "backward"): 1000,
    }
    # 400 whole + 600 / 2 per tensor-parallel rank
    assert numel[2][("all_gather", "forward")] == 700
    assert numel[2][("all_gather", "backward")] == 300


def test_no_offered_row_is_an_error():
    with pytest.raises(ValueError, match="no stage in --stage 0 supports --offload cpu-all"):
        report.plan_report(
            d.from_params(10**6), MemoryConfig(stage=0), stages=(0,), offloads=("cpu-all",)
        )


@pytest.mark.parametrize(
    "stage, offload, in_backward, why",
    [
        (3, "nvme-states", True, "step_in_backward: states or gradients on NVMe"),
        (1, "nvme-states", False, "gradients leave the device only when partitioned"),
        (2, "cpu-all", False, "parameters are streamed from CPU/NVMe per unit only when"),
    ],
)
def test_a_refused_placement_is_refused_for_its_own_reason(stage, offload, in_backward, why):
    """The error names the reason of the placement refused (it said "offloading needs stage >=
    1, and parameters or NVMe need stage 3" whatever it was: at stage 3 with step_in_backward,
    or for nvme-states at stage 1, which stage 2 plans)."""
    config = MemoryConfig(stage=stage, step_in_backward=in_backward)
    with pytest.raises(ValueError, match=f"stage {stage} {offload}: {why}"):
        report.plan_report(d.from_params(10**6), config, stages=(stage,), offloads=(offload,))


def test_rows_left_out_are_said_in_a_note():
    """Placements that some stages cannot run are noted with the reason (their rows vanished
    without a word)."""
    config = MemoryConfig(stage=3, step_in_backward=True)
    out = report.plan_report(
        d.from_params(10**6), config, stages=(3,), offloads=("nvme-states", "cpu-all")
    )
    assert [r["offload"] for r in out["stages"]] == ["cpu-all"]
    assert out["not_planned"] == [
        "not planned: stage 3 nvme-states: step_in_backward: states or gradients on NVMe are "
        "streamed in step order, not during backward (the engine refuses it)"
    ]
    assert "note: not planned: stage 3 nvme-states: step_in_backward" in report.render_plan(out)


def test_finite_replaces_inf_and_nan_with_none():
    out = report.finite({"a": [1.0, math.inf], "b": {"c": math.nan}, "d": "x"})
    assert out == {"a": [1.0, None], "b": {"c": None}, "d": "x"}
