"""The calibration's verdict and table: the tolerances a prediction is held to, the relative
error, and the Markdown table of predicted against measured per configuration (the worst rank),
as ``zeroshard plan --measure`` and ``bench/bench_calibration.py`` print it. Rows come from
``zeroshard.planner.calibrate``."""

from __future__ import annotations

MODEL_STATES_TOLERANCE = 0.02
"""Relative error allowed on model states (the ZeRO formulas; padding aside they are exact)."""
PEAK_TOLERANCE = 0.10
"""Relative error allowed on the per-rank peak."""


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured if measured else float(predicted != 0)


def within_tolerance(row: dict) -> bool:
    p, m = row["predicted"], row["measured"]
    return (
        abs(error(p["model_states_bytes"], m["model_states_bytes"])) <= MODEL_STATES_TOLERANCE
        and abs(error(p["peak_bytes"], m["peak_bytes"])) <= PEAK_TOLERANCE
    )


_LABELLED = {"precision": "fp32", "tp": 1, "checkpoint_every": 0, "grad_accum": 1,
             "accumulate_unreduced": False}  # fmt: skip
"""Settings of a case named beside its model in the table when not these defaults."""


def summarize(rows: list[dict]) -> list[dict]:
    """One line per configuration: the worst rank's errors (ranks are symmetric here)."""
    by_config: dict[tuple, list[dict]] = {}
    for r in rows:
        case = r["case"]
        stage = f"{case['stage']}{'s' if case.get('step_in_backward') else ''}"
        name = case["preset"] + "".join(  # (rows differing in these alone stay apart)
            f" {v}" if k == "precision" else f" {k}={v}"
            for k, v in case.items()
            if k in _LABELLED and v != _LABELLED[k]
        )
        key = (name, stage, r["num_ranks"], case.get("micro_batch_size", 0))
        key += (case.get("seq_len", 0),)
        by_config.setdefault(key, []).append(r)
    lines = []
    for (name, stage, n, batch, seq), group in sorted(by_config.items()):
        worst = max(
            group,
            key=lambda r: abs(error(r["predicted"]["peak_bytes"], r["measured"]["peak_bytes"])),
        )
        p, m = worst["predicted"], worst["measured"]
        lines.append(
            {
                "preset": name,
                "stage": int(stage.rstrip("s")),
                "step_in_backward": stage.endswith("s"),
                "num_ranks": n,
                "tokens": f"{batch}x{seq}",
                "model_states": (p["model_states_bytes"], m["model_states_bytes"]),
                "peak": (p["peak_bytes"], m["peak_bytes"]),
                "peak_moment": p["peak_moment"],
                "comm": (sum(p["comm_numel"].values()), sum(m["comm_numel"].values())),
                "ok": all(within_tolerance(r) for r in group),
            }
        )
    return lines


def render(rows: list[dict]) -> str:
    """The Markdown table: predicted / measured / error per configuration (worst rank)."""

    head = (
        "| model | batch x seq | stage | ranks | model states B predicted / measured | error "
        "| peak B predicted / measured | error | peak at | comm elements predicted / measured "
        "| error |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    summary = summarize(rows)
    for s in summary:
        (ps, ms), (pp, mp), (pc, mc) = s["model_states"], s["peak"], s["comm"]
        stage = f"{s['stage']}" + (", step in backward" if s["step_in_backward"] else "")
        lines.append(
            f"| {s['preset']} | {s['tokens']} | {stage} | {s['num_ranks']} | {ps:,} / {ms:,} "
            f"| {error(ps, ms):+.3%} | {pp:,} / {mp:,} | {error(pp, mp):+.3%} "
            f"| {s['peak_moment']} | {pc:,} / {mc:,} | {error(pc, mc):+.3%} |"
        )
    ok = sum(s["ok"] for s in summary)
    lines.append("")
    lines.append(
        f"{ok} of {len(summary)} configurations within tolerance (model states "
        f"{MODEL_STATES_TOLERANCE:.0%}, peak {PEAK_TOLERANCE:.0%}, on every rank); the worst "
        "rank shown; error = (predicted - measured) / measured."
    )
    return "\n".join(lines)
