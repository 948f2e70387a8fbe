"""Calibration of the planner: predicted against measured memory and communication per rank.

For every GPT preset, ZeRO stage and rank count, one torchrun job per rank count (gloo, CPU, one
thread per rank) trains the preset with FP32 AdamW for a few steps and measures, on every rank,
the model states right after the optimizer step and the peak over a whole step (MemTracker) and
the elements each collective moved (the ledger); the planner predicts the same numbers from the
engine's settings (``zeroshard.planner.calibrate``). Prints the Markdown table; exits 1 when a
configuration misses the tolerances (model states 2%, peak 10%).

    python bench/bench_calibration.py                       # nano and tiny, stages 0-3, 1/2/4 ranks
    python bench/bench_calibration.py --ranks 2 --json rows.json
    python bench/bench_calibration.py --presets tiny --batch 1 --seq 8   # model states dominate
    python bench/bench_calibration.py --presets 100m --batch 2 --seq 64 --ranks 2 \
        --stages 0,1,2,3,3s       # 3s: stage 3 with zeroshard.optimizer(step_in_backward=True)

The same grid as ``zeroshard plan --measure``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

from zeroshard.planner import calibrate  # noqa: E402


def _stage(text: str) -> int | str:
    """0-3, or 2s/3s (step in backward)."""
    text = text.strip()
    if text in ("0", "1", "2", "3"):
        return int(text)
    if text in ("2s", "3s"):
        return text
    raise SystemExit(f"--stages takes 0, 1, 2, 3, 2s or 3s (step in backward), got {text!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", default="nano,tiny")
    p.add_argument(
        "--stages",
        default="0,1,2,3",
        help="stages to run; 2s or 3s: that stage stepping the optimizer in backward",
    )
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--seq", type=int, help="tokens per sample (default: the preset's block_size)")
    p.add_argument("--steps", type=int, default=2, help="steps; the last one is measured")
    p.add_argument("--json", metavar="PATH", help="also write every rank's rows here")
    args = p.parse_args()
    start = time.monotonic()
    rows = calibrate.run_grid(
        presets=tuple(args.presets.split(",")),
        stages=tuple(_stage(s) for s in args.stages.split(",")),
        ranks=tuple(int(n) for n in args.ranks.split(",")),
        micro_batch_size=args.batch,
        seq_len=args.seq,
        num_steps=args.steps,
    )
    print(calibrate.render(rows))
    print(f"\n{time.monotonic() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(calibrate.within_tolerance(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
