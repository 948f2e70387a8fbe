"""``zeroshard plan``: the table, the JSON keys the README documents, and user mistakes."""

import argparse
import json
import warnings

import pytest
from test_planner_hf import HF_CONFIGS

from zeroshard.cli import plan
from zeroshard.models.gpt import GPT, PRESETS
from zeroshard.planner.memory import MODEL_STATES, OFFLOADS


def _parse(argv):
    parser = argparse.ArgumentParser(prog="zeroshard")
    plan.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def _run(argv, capsys):
    assert plan.run(_parse(argv)) == 0
    return capsys.readouterr().out


def _json(argv, capsys):
    return json.loads(_run([*argv, "--json"], capsys))


def tiny_gpt():
    """A factory for --module (built on the meta device by the planner)."""
    return GPT(PRESETS["tiny"])


def tiny_hf_gpt2():
    """A Hugging Face GPT-2 for --module: the same model as --hf with its config."""
    import transformers
    from test_planner_hf import HF_CONFIGS

    values = {k: v for k, v in HF_CONFIGS["gpt2"].items() if k != "model_type"}
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**values))


def pixels():
    """A linear classifier of 3 x 4 x 4 images, for --module --input-shape."""
    from test_planner_describe import _Pixels

    return _Pixels()


def test_a_model_without_token_ids_is_planned_on_its_input_shape(capsys):
    argv = ["--module", "test_cli_plan:pixels", "--stage", "3", "--batch", "2"]
    blind = _json(argv, capsys)
    assert not blind["model"]["activations_measured"] and blind["model"]["inputs"] is None
    seen = _json([*argv, "--input-shape", "3x4x4"], capsys)
    assert seen["model"]["activations_measured"] and seen["model"]["inputs"] == "3x4x4"
    assert seen["stages"][0]["device_bytes"] > blind["stages"][0]["device_bytes"]
    assert "inputs 3x4x4" in _run([*argv, "--input-shape", "3x4x4"], capsys)
    # a model that takes its images by keyword
    wrong = _json([*argv, "--input-shape", "images=3x4x4"], capsys)
    assert not wrong["model"]["activations_measured"]


def test_an_encoder_decoder_is_planned_on_its_features_and_decoder_ids(capsys, tmp_path):
    """Whisper takes audio features and the decoder's token ids: the ids were made as floats,
    which its embedding refused, and the plan fell back to the GPT formulas (15% under the
    measured stage-3 peak; with them measured on meta: 7% over, an explorer's config)."""
    pytest.importorskip("transformers")
    config = dict(
        model_type="whisper", encoder_layers=2, decoder_layers=2, d_model=64,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, vocab_size=1000, num_mel_bins=16, max_source_positions=32,
        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, architectures=["WhisperForConditionalGeneration"],
    )  # fmt: skip
    path = tmp_path / "whisper.json"
    path.write_text(json.dumps(config))
    argv = [
        "--hf",
        str(path),
        "--stage",
        "3",
        "--batch",
        "4",
        "--input-shape",
        "input_features=16x64",
    ]
    seen = _json([*argv, "--input-shape", "decoder_input_ids=16"], capsys)
    assert seen["model"]["activations_measured"], seen["model"]
    assert seen["model"]["num_params"] == 252_928


def _rows(text):
    """The table's data rows, split on runs of two or more spaces."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith("note"):
            break
        rows.append([c.strip() for c in line.split("  ") if c.strip()])
    return rows


def test_worked_example_table(capsys):
    text = _run(["--params", "7.5B", "--dp", "64"], capsys)
    rows = _rows(text)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[2] for r in rows] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]
    assert [r[-1] for r in rows] == ["2 Psi = 30 GB"] * 3 + ["3 Psi = 45 GB"]
    assert "Psi = 7.5e9 parameters, Nd = 64" in text
    assert "2 + 2 + 12 = 16 bytes per parameter" in text


def test_worked_example_json(capsys):
    out = _json(["--params", "7.5e9", "--dp", "64"], capsys)
    got = {s["stage"]: s["model_states_bytes"] for s in out["stages"]}
    assert got == {0: 120_000_000_000, 1: 31_406_250_000, 2: 16_640_625_000, 3: 1_875_000_000}
    row = out["stages"][3]
    assert row["communication"]["numel"] == 3 * 7_500_000_000
    assert set(row["memory"]["device"]) >= {"params", "grads", "optimizer_states"}
    assert row["device_bytes"] == row["model_states_bytes"] + row["residual_states_bytes"]


def test_precision_sets_the_bytes_the_engine_keeps(capsys):
    """--precision fp32 is FP32 AdamW as the calibration measures it (4,4,8: the parameter is
    its own master; 4-byte activations); bf16 and fp16 are the engine's mixed precision: FP32
    masters and an FP32 gradient beside 2-byte copies (ZeRO's 2,2,12 is the default)."""
    from zeroshard.planner.calibrate import FP32_ADAMW
    from zeroshard.planner.memory import ENGINE_MIXED

    model = ["--module", "test_cli_plan:tiny_gpt", "--dp", "2", "--seq", "64"]
    fp32 = _json([*model, "--precision", "fp32"], capsys)
    assert fp32 == _json([*model, "--bytes-per-param", "4,4,8", "--activation-bytes", "4"], capsys)
    assert fp32["bytes_per_param"] == vars(FP32_ADAMW)
    mixed = _json([*model, "--precision", "bf16"], capsys)
    assert mixed == _json([*model, "--precision", "fp16"], capsys)
    assert mixed["bytes_per_param"] == vars(ENGINE_MIXED)
    plain = {s["stage"]: s["model_states_bytes"] for s in _json(model, capsys)["stages"]}
    wide = {s["stage"]: s["model_states_bytes"] for s in fp32["stages"]}
    engine = {s["stage"]: s["model_states_bytes"] for s in mixed["stages"]}
    psi = mixed["model"]["num_params"]
    assert wide[0] == plain[0] == 16 * psi  # 16 bytes a parameter, either way
    assert wide[1] > plain[1]  # fp32 shards 8 of 16 bytes, mixed precision 12
    # bf16: 20 at stage 0; 4 + 16/2 at 1; 2 + 16/2 at 2; 16/2 at 3 (Nd = 2, even sizes)
    assert [engine[k] / psi for k in range(4)] == pytest.approx([20, 12, 10, 8], rel=1e-3)
    with pytest.raises(ValueError, match="--precision fp32 sets --activation-bytes: pass one"):
        plan.run(_parse([*model, "--precision", "fp32", "--activation-bytes", "2"]))
    # The default is not train's: the table says so; --seq-len is train's name for --seq.
    said = "16-bit mixed precision (--precision fp32 for train's default)"
    assert plan.run(_parse(model)) == 0 and said in capsys.readouterr().out
    model[-2] = "--seq-len"
    assert plan.run(_parse([*model, "--precision", "fp32"])) == 0
    assert said not in capsys.readouterr().out


def test_transformer_json_keys(capsys):
    argv = ["--layers", "96", "--hidden", "8192", "--heads", "64", "--seq", "1024"]
    out = _json([*argv, "--batch", "2", "--ci", "1", "--dp", "1024"], capsys)
    assert out["activation_checkpoint_bytes"] == 2 * 2 * 1024 * 8192 * 96
    assert out["activation_working_bytes"] == 2 * 1024 * 1 * (16 * 8192 + 2 * 64 * 1024)
    assert out["model_state_working_bytes"] == 4 * 8192 * 4 * 8192
    assert out["model"]["shape"]["num_heads"] == 64


def test_efficiency_json(capsys):
    argv = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--batch", "1"]
    out = _json([*argv, "--bandwidth", "70GB/s", "--peak-flops", "70TFLOP/s"], capsys)
    eff = out["efficiency"]
    assert set(eff) == {"params_grads", "optimizer_states", "activation_checkpoints"}
    assert round(eff["params_grads"], 3) == 0.506
    assert eff["activation_checkpoints"] > eff["params_grads"] > eff["optimizer_states"]


def test_required_bandwidth_printed(capsys):
    argv = ["--params", "1B", "--seq", "1024", "--batch", "2", "--peak-flops", "70T"]
    text = _run([*argv, "--target-efficiency", "0.9"], capsys)
    assert "needs 1.23 TB/s for efficiency 0.9" in text


def test_offload_rows_and_efficiency(capsys):
    argv = ["--preset", "1b", "--dp", "8", "--offload", "all", "--stage", "2,3"]
    out = _json([*argv, "--bandwidth", "25GB/s", "--peak-flops", "70TFLOP/s"], capsys)
    offloads = [(r["stage"], r["offload"]) for r in out["stages"]]
    assert offloads == [
        (2, "none"),
        (2, "cpu-optimizer"),
        (2, "nvme-optimizer"),  # as the engine runs it, and the benchmark measures it
        (2, "nvme-states"),  # Offload(optimizer="nvme", gradients="nvme"): it had no row
        (3, "none"),
        (3, "cpu-optimizer"),
        (3, "nvme-optimizer"),
        (3, "nvme-states"),
        (3, "nvme-params"),  # Offload(parameters="nvme") alone: it had no row
        (3, "cpu-all"),
        (3, "nvme-all"),
        (3, "nvme-everything"),
    ]
    by = {(r["stage"], r["offload"]): r for r in out["stages"]}
    assert by[(3, "none")]["efficiency"] is None
    assert by[(3, "cpu-optimizer")]["efficiency"] == pytest.approx(
        out["efficiency"]["optimizer_states"]
    )
    assert (
        by[(3, "nvme-all")]["nvme_bytes"] > 0
        and by[(3, "nvme-all")]["memory"]["device"]["params"] == 0
    )
    # Offload(gradients="nvme") too: the gradient shards move from the CPU column to NVMe.
    every, nvme_all = by[(3, "nvme-everything")]["memory"], by[(3, "nvme-all")]["memory"]
    assert every["cpu"]["grads"] == 0 and every["nvme"]["grads"] == nvme_all["cpu"]["grads"] > 0
    low = _json(["--preset", "1b", "--dp", "8", "--offload", "all", "--stage", "1"], capsys)
    assert "nvme-states" not in {
        r["offload"] for r in low["stages"]
    }  # (stage 1: nvme-optimizer's twin)
    states = by[(2, "nvme-states")]["memory"]
    assert states["nvme"]["grads"] > 0 and states["nvme"]["optimizer_states"] > 0
    assert states["device"]["grads"] == states["device"]["optimizer_states"] == 0
    assert states["device"]["params"] > 0


def test_memory_gb_and_gib_told_apart(capsys):
    # Stage 0, no residual shape, no fragmentation: 16 Psi + 2 x 25 MiB buckets = 83.25e9 bytes,
    # more than 80 GB (80e9) and less than 80 GiB (85.9e9).
    argv = ["--params", "5.2B", "--stage", "0", "--fragmentation", "0"]
    gb = _json([*argv, "--memory", "80GB"], capsys)
    gib = _json([*argv, "--memory", "80GiB"], capsys)
    assert gb["device_memory_bytes"] == 80 * 10**9 and gib["device_memory_bytes"] == 80 * 2**30
    assert gb["stages"][0]["fits"] is False and gib["stages"][0]["fits"] is True
    assert _rows(_run([*argv, "--memory", "80GB"], capsys))[0][-1] == "NO (device)"


def test_the_fits_column_counts_the_cpu_and_the_nvme_per_node(capsys):
    """``--cpu-memory`` and ``--nvme`` (per node, shared by ``--devices-per-node`` devices)
    decide the fits column too; they were read by --advise only ("fits yes" with 47 GB on a
    1 GB NVMe)."""
    argv = ["--preset", "3b", "--dp", "2", "--stage", "3", "--offload", "nvme-everything"]
    row = _json([*argv, "--memory", "80GB"], capsys)["stages"][0]
    nvme, cpu = row["nvme_bytes"], row["cpu_bytes"]
    assert nvme > 10**10 and row["fits"] is True
    short = _json([*argv, "--memory", "80GB", "--nvme", str(2 * nvme - 1)], capsys)["stages"][0]
    assert short["fits"] is False and short["short"] == ["nvme"]  # two ranks share the node
    alone = ["--devices-per-node", "1", "--nvme", str(nvme), "--cpu-memory", str(cpu - 1)]
    row = _json([*argv, *alone], capsys)["stages"][0]  # no --memory: the column still shows
    assert row["fits"] is False and row["short"] == ["cpu"]
    assert _rows(_run([*argv, *alone], capsys))[0][-1] == "NO (cpu)"
    more = ["--nvme", str(2 * nvme), "--devices-per-node", "8"]  # only 2 devices exist
    assert _json([*argv, *more], capsys)["stages"][0]["fits"] is True


def test_other_model_sources(capsys, tmp_path):
    tiny = PRESETS["tiny"].num_params()
    assert _json(["--preset", "tiny"], capsys)["model"]["num_params"] == tiny
    assert _json(["--module", "test_cli_plan:tiny_gpt"], capsys)["model"]["num_params"] == tiny
    cfg = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 10, "n_positions": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _json(["--hf", str(tmp_path)], capsys)["model"]["shape"]["hidden_size"] == 64


def test_hf_and_module_find_the_engines_units(capsys, tmp_path):
    pytest.importorskip("transformers")
    from test_planner_hf import HF_CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["gpt2"]))
    argv = ["--stage", "3", "--dp", "2", "--seq", "16"]
    by_hf = _json(["--hf", str(tmp_path / "config.json"), *argv], capsys)
    by_module = _json(["--module", "test_cli_plan:tiny_hf_gpt2", *argv], capsys)
    block = 12 * 64 * 64 + 13 * 64  # one GPT2Block with biases
    root = 256 * 64 + 64 * 64 + 2 * 64  # token and position embeddings, ln_f (the head is tied)
    for out in (by_hf, by_module):
        m = out["model"]
        assert m["num_params"] == root + 2 * block
        assert m["wrap_policy"] == "_no_split_modules (GPT2Block)"
        assert (m["num_units"], m["root_unit_numel"], m["largest_unit_numel"]) == (3, root, block)
    # Stage 3 gathers the largest unit (here the root), not the whole backbone at once.
    unit = max(root, block)
    assert by_hf["stages"][0]["memory"]["device"]["gathered_units"] == 2 * 2 * unit + 2 * unit
    # --module has no shape, but the same units and model states, and the same activations:
    # both measured on the built model (meta device), not taken from a GPT-shaped formula.
    assert by_hf["model"]["activations_measured"] and by_module["model"]["activations_measured"]
    assert by_hf["activation_working_bytes"] == by_module["activation_working_bytes"] > 0
    for category in (
        "params",
        "grads",
        "optimizer_states",
        "gathered_units",
        "activation_checkpoints",
        "activation_working",
        "logits",
    ):
        got = by_module["stages"][0]["memory"]["device"][category]
        assert got == by_hf["stages"][0]["memory"]["device"][category], category
    text = _run(["--hf", str(tmp_path), *argv], capsys)
    assert "units (_no_split_modules (GPT2Block)): 3; root unit 20,608 parameters" in text
    wrapped = _json(["--hf", str(tmp_path), "--wrap", "GPT2Attention,GPT2MLP", *argv], capsys)
    assert wrapped["model"]["num_units"] == 5


def test_a_forward_that_fails_on_meta_is_a_note(capsys):
    # The reference GPT refuses more tokens than its block size: the plan says so and keeps the
    # model states; with a sequence it takes, its activations are measured.
    refused = _json(["--module", "test_cli_plan:tiny_gpt", "--seq", "1024"], capsys)
    notes = refused["stages"][0]["memory"]["notes"]
    assert any("activations not measured" in n and "exceeds block_size" in n for n in notes)
    assert refused["stages"][0]["memory"]["device"]["activation_working"] == 0
    taken = _json(["--module", "test_cli_plan:tiny_gpt", "--seq", "128"], capsys)
    assert taken["model"]["activations_measured"]
    assert taken["stages"][0]["memory"]["device"]["activation_working"] > 0


def test_hf_without_transformers_warns_on_stderr(capsys, tmp_path, monkeypatch):
    import sys

    from test_planner_hf import HF_CONFIGS

    monkeypatch.setitem(sys.modules, "transformers", None)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["gpt2"]))
    assert plan.run(_parse(["--hf", str(tmp_path), "--json"])) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # the warning stays off stdout
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("zeroshard plan: warning: gpt2: counting with the GPT-shaped formula")
    assert "transformers is not installed: ModuleNotFoundError" in line


def test_plain_numbers_are_bytes_per_second(capsys):
    argv = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--peak-flops", "7e13"]
    plain = _json([*argv, "--bandwidth", "70000000000", "--net-bandwidth", "1e11"], capsys)
    units = _json([*argv, "--bandwidth", "70GB/s", "--net-bandwidth", "100GB/s"], capsys)
    assert plain["efficiency"] == units["efficiency"]
    assert round(plain["efficiency"]["params_grads"], 3) == 0.506
    assert [r["communication"]["seconds"] for r in plain["stages"]] == [
        r["communication"]["seconds"] for r in units["stages"]
    ]


def test_unit_flag(capsys):
    rows = _rows(_run(["--params", "1024", "--stage", "0", "--unit", "KiB"], capsys))
    assert rows[0][2] == "16 KiB"


def test_advise(capsys):
    argv = ["--preset", "1b", "--advise", "--devices", "8", "--memory", "8GB", "--seq", "2048"]
    argv += ["--global-batch", "256", "--peak-flops", "70TFLOP/s", "--net-bandwidth", "100GB/s"]
    argv += ["--bandwidth", "25GB/s", "--batch", "1,2,4,8", "--offload", "all"]
    text = _run(argv, capsys)
    assert "rank  stage  offload" in text
    assert "stage 0 none: needs 21.9 GB per device, has 8 GB" in text
    assert "not offered:" in text
    out = _json(argv, capsys)
    assert set(out) >= {"feasible", "rejected", "why_not"}
    steps = [c["step_seconds"] for c in out["feasible"]]
    assert steps == sorted(steps) and all(c["device_bytes"] <= 8e9 for c in out["feasible"])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--params", "0"], "positive"),
        (["--params", "0.5"], "not a whole number"),
        (["--params", "1B", "--bytes-per-param", "3,3,10"], "a dtype's width, 1, 2, 4 or 8"),
        (["--params", "-5"], "positive"),
        (["--params", "1B", "--dp", "0"], "--dp must be at least 1"),
        (["--params", "1B", "--dp", "-4"], "--dp must be at least 1"),
        (["--params", "1B", "--mp", "0"], "--mp must be at least 1"),
        (["--params", "1B", "--seq", "0"], "--seq must be at least 1"),
        (["--params", "1B", "--batch", "0"], "--batch must be at least 1"),
        (["--params", "1B", "--ci", "-1"], "--ci must be at least 0"),
        (
            ["--params", "1B", "--ci", "0,1", "--advise", "--memory", "8GB"]
            + ["--peak-flops", "1T", "--net-bandwidth", "1e9", "--global-batch", "8"],
            "--ci 0 \\(no checkpointing\\) is for a plan without --advise",
        ),
        (
            ["--preset", "tiny", "--mp", "2", "--ci", "0", "--partition-activations"],
            "there are none",
        ),
        (["--layers", "2", "--hidden", "100", "--heads", "3"], "does not divide"),
        (["--layers", "0", "--hidden", "64", "--heads", "4"], "--layers must be at least 1"),
        (["--layers", "2", "--hidden", "64"], "needs --heads"),
        (["--params", "1B", "--memory", "80GX"], "cannot read memory size"),
        (["--params", "1B", "--memory", "0GB"], "--memory: memory size must be a positive"),
        (["--params", "1B", "--bucket", "0"], "--bucket: memory size must be a positive"),
        (["--params", "1B", "--cpu-memory", "0"], "--cpu-memory: memory size must be"),
        (
            ["--params", "1B", "--fragmentation", "-0.5"],
            r"--fragmentation is a fraction in \[0, 1\)",
        ),
        (
            ["--params", "1B", "--advise", "--memory", "8GB", "--global-batch", "8"]
            + ["--peak-flops", "1T", "--net-bandwidth", "1GB/s", "--grad-accum", "4"],
            "would ignore --grad-accum 4; drop --grad-accum .--global-batch sets the batch.",
        ),
        (
            ["--params", "1B", "--advise", "--memory", "8GB", "--global-batch", "8"]
            + ["--peak-flops", "1T", "--net-bandwidth", "1GB/s", "--devices", "2", "--dp", "4"],
            "--dp 4 x --mp 1 is not --devices 2",
        ),
        (["--params", "1B", "--memory", "80Gb"], "bits"),
        (["--params", "1B", "--bandwidth", "fast", "--peak-flops", "70T"], "bandwidth"),
        (["--params", "1B", "--stage", "4"], "--stage takes 0, 1, 2 or 3"),
        (["--params", "1B", "--offload", "tape"], "unknown --offload"),
        (["--params", "1B", "--bytes-per-param", "2,2"], "--bytes-per-param"),
        (["--params", "1B", "--stage", "0", "--offload", "cpu-all"], "no stage"),
        (["--params", "1B", "--batch", "1,2"], "unless --advise"),
        (["--params", "1B", "--target-efficiency", "0.9"], "--peak-flops"),
        (["--params", "1B", "--advise"], "--advise needs --memory"),
        (["--params", "1B", "--unit", "parsecs"], "is not a unit of bytes"),
        (["--params", "1B", "--unit", "2GB"], "'2GB' is not a unit of bytes"),  # (read as 12e9)
        (["--module", "test_cli_plan:tiny_gpt", "--wrap", ","], "--wrap ',' names no class"),
        ([], "no model given"),
        (["--preset", "1b", "--params", "1B"], "--params overrides"),
        (["--preset", "1b", "--layers", "2"], "describe the model once"),
        (["--preset", "huge"], "unknown model preset"),
        (["--module", "no_such_module:f"], "--module"),
        (["--params", "1B", "--wrap", "Block"], "--wrap names the units"),
        (["--preset", "nano", "--wrap", "Block"], "--wrap names the units"),
        (["--preset", "nano", "--input-shape", "3x8x8"], "--input-shape gives the inputs"),
        (["--module", "test_cli_plan:pixels", "--input-shape", "3x0"], "one sample's shape"),
        (["--module", "test_cli_plan:pixels", "--input-shape", "1x=3"], "NAME=3x224x224"),
        (
            ["--module", "test_cli_plan:pixels", "--input-shape", "x=3", "--input-shape", "x=4"],
            "gives x twice",
        ),
        (["--params", "1B", "--bandwidth", "70GB", "--peak-flops", "70T"], "70GB/s"),
        (
            ["--params", "1B", "--dp", "8", "--shard-group-size", "3"],
            "--shard-group-size 3 does not divide the 8 data-parallel ranks; use a divisor of 8 "
            r"\(1, 2, 4, 8\)",
        ),
        (["--params", "1B", "--dp", "8", "--shard-group-size", "16"], "16 is larger than the 8"),
        (["--params", "1B", "--dp", "8", "--shard-group-size", "-1"], r"must be 0 \(every rank\)"),
        (
            ["--params", "1B", "--step-in-backward", "--stage", "0,1,2,3"],
            "--step-in-backward needs partitioned gradients \\(stage 2 or 3\\), but --stage has "
            "0,1; pass --stage 2,3",
        ),
        (["--params", "1B", "--step-in-backward", "--stage", "1,3"], "--stage has 1;"),
        (
            ["--params", "1B", "--dp", "8", "--inter-node-bandwidth", "25GB/s"],
            "--inter-node-bandwidth prices the all-reduce across shard groups; add "
            "--shard-group-size K",
        ),
        (
            ["--params", "1B", "--dp", "8", "--shard-group-size", "8"]
            + ["--inter-node-bandwidth", "1e9"],
            "add --shard-group-size K with K < 8",
        ),
    ],
)
def test_user_mistakes(argv, match):
    with pytest.raises(ValueError, match=match):
        plan.run(_parse(argv))


def test_bad_model_files_and_factories(tmp_path, monkeypatch):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "gpt2",')
    (tmp_path / "mods.py").write_text("def raises():\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps(HF_CONFIGS["gpt2"]))
    for argv, match in (
        (["--hf", str(gpt2), "--mp", "2"], "--mp 2: GPT2LMHeadModel has no tensor-parallel plan"),
        (["--preset", "tiny", "--sequence-parallel"], None),
        (["--hf", str(listed)], "holds a JSON list, not a config object"),
        (["--hf", str(broken)], "broken.json is not a JSON config"),
        (["--module", "mods:raises"], r"factory failed .*\(RuntimeError: boom\)"),
    ):
        if match is None:  # the built-in GPT has the plan: accepted
            assert plan.run(_parse([*argv, "--mp", "2", "--json"])) == 0
            continue
        if "--mp" in argv:
            pytest.importorskip("transformers")
        with pytest.raises(ValueError, match=match):
            plan.run(_parse(argv))


def test_step_in_backward_shows_stages_2_and_3_by_default(capsys):
    stages = [r["stage"] for r in _json(["--params", "1B", "--step-in-backward"], capsys)["stages"]]
    assert sorted(set(stages)) == [2, 3]


def test_step_in_backward_flag(capsys, monkeypatch):
    argv = ["--params", "1B", "--dp", "8", "--stage", "2,3", "--offload", "all"]
    plain = {(r["stage"], r["offload"]): r for r in _json(argv, capsys)["stages"]}
    stepped = {
        (r["stage"], r["offload"]): r
        for r in _json([*argv, "--step-in-backward"], capsys)["stages"]
    }
    # NVMe-held states or gradients are streamed in step order: not offered with it.
    assert set(stepped) == {k for k in plain if "nvme" not in k[1]}
    for key, row in stepped.items():
        before, after = plain[key]["memory"], row["memory"]
        for tier in ("device", "cpu"):
            assert after[tier]["grads"] == 0  # every shard stepped and dropped in backward
            assert after[tier]["params"] == before[tier]["params"]
        lower = before["device"]["grads"] + before["cpu"]["grads"]
        assert sum(before["device"].values()) + sum(before["cpu"].values()) - lower >= sum(
            after["device"].values()
        ) + sum(after["cpu"].values())
    # Through main: a stage without partitioned gradients is one line, exit 2.
    from zeroshard.cli import main

    assert main.main(["plan", "--params", "1B", "--step-in-backward", "--stage", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-in-backward needs partitioned gradients" in err[0]


def test_hybrid_sharding_table_and_json(capsys):
    argv = ["--params", "7.5B", "--dp", "64", "--shard-group-size", "8"]
    argv += ["--net-bandwidth", "300GB/s", "--inter-node-bandwidth", "25GB/s"]
    text = _run(argv, capsys)
    assert "Nd = 64, sharded in 8 groups of k = 8 (hybrid)" in text
    assert "intra-group/step  inter-group/step    comm time" in text
    rows = _rows(text)
    # Model states with Nd = 8: 2 + 2 + 12/8, 2 + 14/8, 16/8 bytes per parameter.
    assert [r[2] for r in rows] == ["120 GB", "41.2 GB", "28.1 GB", "15 GB"]
    assert [r[-3:] for r in rows] == [
        ["2 Psi = 30 GB", "-", "1.2 s"],  # stage 0: one all-reduce over every rank, 25 GB/s
        ["2 Psi = 30 GB", "0.25 Psi = 3.75 GB", "0.25 s"],  # 30/300 + 3.75/25
        ["2 Psi = 30 GB", "0.25 Psi = 3.75 GB", "0.25 s"],
        ["3 Psi = 45 GB", "0.25 Psi = 3.75 GB", "0.3 s"],
    ]
    assert "note: stage 0 shards nothing" in text
    out = _json(argv, capsys)
    assert (out["shard_group_size"], out["num_shard_groups"], out["num_dp_ranks"]) == (8, 8, 64)
    assert out["net_bandwidth_bytes_per_s"] == 300e9
    assert out["inter_node_bandwidth_bytes_per_s"] == 25e9
    c = out["stages"][3]["communication"]
    assert set(c) == {
        "numel", "bytes", "seconds", "intra_group", "inter_group", "collectives", "notes"
    }  # fmt: skip
    assert set(c["inter_group"]) == {"numel", "bytes", "seconds"}
    assert c["inter_group"]["numel"] == 2 * 7_500_000_000 // 8
    assert c["intra_group"]["numel"] == 3 * 7_500_000_000
    assert c["numel"] == c["intra_group"]["numel"] + c["inter_group"]["numel"]
    assert c["seconds"] == pytest.approx(45 / 300 + 3.75 / 25)
    assert [x["scope"] for x in c["collectives"]] == ["shard"] * 3 + ["replicate"]
    # Without hybrid sharding (the default, or k = Nd) nothing crosses groups.
    for extra in ([], ["--shard-group-size", "64"]):
        out = _json(["--params", "7.5B", "--dp", "64", *extra], capsys)
        assert (out["shard_group_size"], out["num_shard_groups"]) == (64, 1)
        assert all(r["communication"]["inter_group"]["numel"] == 0 for r in out["stages"])
        assert "comm/step" in _run(["--params", "7.5B", "--dp", "64", *extra], capsys)


def test_advise_with_hybrid_sharding(capsys):
    argv = ["--preset", "1b", "--advise", "--devices", "32", "--memory", "80GB", "--seq", "2048"]
    argv += ["--global-batch", "256", "--peak-flops", "300TFLOP/s", "--batch", "1,2,4"]
    argv += ["--net-bandwidth", "300GB/s", "--offload", "none", "--stage", "1,2,3"]
    hybrid = [*argv, "--shard-group-size", "8", "--inter-node-bandwidth", "25GB/s"]
    assert "intra-group  inter-group" in _run(hybrid, capsys)
    out = _json(hybrid, capsys)
    assert all(c["time_seconds"]["inter_group"] > 0 for c in out["feasible"])
    flat = _json(argv, capsys)
    assert all(c["time_seconds"]["inter_group"] == 0 for c in flat["feasible"])
    with pytest.raises(ValueError, match="--shard-group-size 5 does not divide the 32"):
        plan.run(_parse([*argv, "--shard-group-size", "5"]))


def test_through_main(capsys, monkeypatch):
    from zeroshard.cli import main

    if "plan" not in main.SUBCOMMANDS:  # until the lead registers it: dispatch to plan alone
        monkeypatch.setattr(main, "SUBCOMMANDS", ("plan",))
    assert main.main(["plan", "--params", "7.5B", "--dp", "64"]) == 0
    assert "1.88 GB" in capsys.readouterr().out
    assert main.main(["plan", "--params", "7.5B", "--dp", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["zeroshard plan: error: --dp must be at least 1, got 0"]
    # a negative value after a space is a value, said negative (argparse took it for an
    # option: the whole usage, then "expected one argument")
    for argv, said in [
        (["--params", "-7.5B"], "a count must be positive, got '-7.5B'"),
        (["--params", "7.5B", "--memory", "-80GB"], "memory size must be positive"),
        (["--params", "7.5B", "--memory", "1e400"], "memory size must be finite"),
        (["--params", "7.5B", "--unit", "2GB"], "unit '2GB' is not a unit of bytes"),
        (["--params", "7.5B", "--param-prefetch", "-1"], "--param-prefetch must be >= 0"),
    ]:
        assert main.main(["plan", *argv, "--dp", "64"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_measure_prints_the_calibration_table(capsys, monkeypatch):
    from zeroshard.planner import calibrate

    seen = {}

    def fake_grid(**kw):
        seen.update(kw)
        row = {
            "case": {"preset": "nano", "stage": 3, "micro_batch_size": 4, "seq_len": 64},
            "num_ranks": 2,
            "rank": 0,
            "predicted": calibrate.predict(calibrate.Case(preset="nano", stage=3), 2),
        }
        return [row | {"measured": dict(row["predicted"])}]

    monkeypatch.setattr(calibrate, "run_grid", fake_grid)
    text = _run(["--measure", "--stage", "3", "--measure-ranks", "2"], capsys)
    assert seen["stages"] == (3,) and seen["ranks"] == (2,) and seen["presets"] == ("nano", "tiny")
    assert "| nano | 4x64 | 3 | 2 |" in text and "1 of 1 configurations within tolerance" in text


def test_measure_mistakes():
    with pytest.raises(ValueError, match="unknown --measure-presets"):
        plan.run(_parse(["--measure", "--measure-presets", "huge"]))
    with pytest.raises(ValueError, match="--measure-steps"):
        plan.run(_parse(["--measure", "--measure-steps", "1"]))
    # It measures its own grid: model and training flags would be silently ignored.
    with pytest.raises(ValueError, match="would ignore --preset, --dp;"):
        plan.run(_parse(["--measure", "--preset", "small", "--dp", "4", "--seq", "32"]))
    with pytest.raises(ValueError, match="would ignore --dp"):
        plan.run(_parse(["--measure", "--dp", "4"]))
    with pytest.raises(ValueError, match="--measure-ranks 3 is not a multiple of --mp 2"):
        plan.run(_parse(["--measure", "--measure-ranks", "2,3", "--mp", "2"]))
    with pytest.raises(ValueError, match="--measure takes one --ci"):
        plan.run(_parse(["--measure", "--ci", "1,2"]))
    with pytest.raises(ValueError, match="--accumulate-unreduced needs stage 2 or 3"):
        plan.run(_parse(["--measure", "--accumulate-unreduced"]))
    with pytest.raises(ValueError, match="--accumulate-unreduced needs stage 2 or 3"):
        plan.run(_parse(["--measure", "--stage", "0", "--accumulate-unreduced", "--grad-accum=2"]))
    # (each rank of the grid failed, a traceback each)
    with pytest.raises(ValueError, match="--seq 100 exceeds the 64 positions of preset 'nano'"):
        plan.run(_parse(["--measure", "--measure-presets", "nano", "--seq", "100"]))
    # Refused before any job (it failed inside the measured run, with its traceback).
    with pytest.raises(ValueError, match="--step-in-backward cannot be combined with fp16"):
        plan.run(_parse(["--measure", "--stage", "2", "--precision", "fp16", "--step-in-backward"]))


def test_measure_runs_the_training_flags(capsys):
    """--ci, --mp, --precision, --grad-accum and --seq reach the measured runs (they were
    refused: the planner's activation checkpointing and tensor parallelism could only be
    checked through Python), and each row names them."""
    argv = ["--measure", "--measure-presets", "nano", "--measure-ranks", "2", "--stage", "3"]
    argv += ["--mp", "2", "--ci", "1", "--precision", "bf16", "--grad-accum", "2", "--seq", "32"]
    rows, text = plan.measure(_parse(argv))
    assert {r["rank"] for r in rows} == {0, 1}
    for r in rows:
        case = r["case"]
        assert (case["tp"], case["checkpoint_every"], case["precision"]) == (2, 1, "bf16"), case
        assert (case["grad_accum"], case["seq_len"], case["stage"]) == (2, 32, 3), case
    assert "| nano tp=2 checkpoint_every=1 bf16 grad_accum=2 | 4x32 | 3 | 2 |" in text, text
    assert "1 of 1 configurations within tolerance" in text, text


def test_advise_device_type(capsys):
    argv = ["--preset", "nano", "--advise", "--memory", "8GB", "--global-batch", "8"]
    argv += ["--peak-flops", "1TFLOP/s", "--net-bandwidth", "10GB/s", "--bandwidth", "10GB/s"]
    argv += ["--offload", "all", "--stage", "3"]
    gpu = _json(argv, capsys)  # the default: a GPU cluster, where the engine offloads nothing
    assert {c["offload"] for c in gpu["feasible"]} == {"none"}
    assert "on a cuda device is not implemented yet" in _run(argv, capsys)
    cpu = _json([*argv, "--device-type", "cpu"], capsys)
    assert {c["offload"] for c in cpu["feasible"]} == set(OFFLOADS)
    with pytest.raises(SystemExit):
        _parse([*argv, "--device-type", "tpu"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("timeline", [["--ci", "2", "--timeline"], ["--ci", "2"], []])
def test_advise_counts_the_memory_the_table_counts(capsys, timeline):
    """Every candidate's device bytes are the table's for the same configuration: along the
    engine's timeline with ``--timeline`` (the advisor summed each category's largest value,
    30% above the table at stage 3, and refused configurations the table said fit)."""
    shape = ["--preset", "tiny", "--batch", "4", "--seq", "128", "--precision", "fp32"]
    table = _json([*shape, *timeline, "--dp", "2"], capsys)["stages"]
    argv = [*shape, *timeline, "--advise", "--devices", "2", "--global-batch", "8"]
    argv += ["--peak-flops", "1TFLOP/s", "--net-bandwidth", "10GB/s", "--memory", "1GB"]
    advised = _json(argv, capsys)["feasible"]
    by_stage = {c["stage"]: c["device_bytes"] for c in advised if c["offload"] == "none"}
    assert by_stage == {r["stage"]: r["device_bytes"] for r in table if r["offload"] == "none"}
    fits = min(by_stage.values())  # exactly the smallest: that stage alone fits
    argv[argv.index("--memory") + 1] = str(fits)
    assert [c["device_bytes"] for c in _json(argv, capsys)["feasible"]] == [fits]


def test_train_s_tp_flag_is_plan_s_mp(capsys):
    # "unrecognized arguments: --tp 2": train's name for the degree, refused by plan.
    argv = ["--preset", "nano", "--dp", "2"]
    assert _json([*argv, "--tp", "2"], capsys) == _json([*argv, "--mp", "2"], capsys)


def test_advise_on_a_cpu_device_shows_its_whole_need(capsys):
    """Training on the CPU, a candidate's device bytes include what it places on the CPU tier
    (the same memory), as its fit is checked: the column showed the device tier alone (19%
    below the need at which it was refused)."""
    argv = ["--preset", "nano", "--advise", "--devices", "2", "--memory", "1GB"]
    argv += ["--global-batch", "8", "--peak-flops", "1TFLOP/s", "--net-bandwidth", "10GB/s"]
    argv += ["--bandwidth", "10GB/s", "--device-type", "cpu", "--batch", "4", "--seq", "64"]
    argv += ["--offload", "cpu-optimizer", "--stage", "2"]
    (c,) = _json(argv, capsys)["feasible"]
    memory = c["memory"]
    peak = sum((memory.get("peak") or memory["device"]).values())
    assert sum(memory["cpu"].values()) > 0
    assert c["device_bytes"] == peak + sum(memory["cpu"].values())
    argv[argv.index("--memory") + 1] = str(c["device_bytes"] - 1)
    assert "needs" in _json(argv, capsys)["rejected"][0]["problem"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mp", "3"], "--mp 3: tensor parallelism splits attention by heads: n_head=2"),
        (["--partition-activations"], "there are none (Nm = 1)"),
        (["--mp", "2", "--sequence-parallel", "--seq", "33"], "seq 33 does not split in Nm = 2"),
        (["--mp", "2", "--sequence-parallel", "--partition-activations"], "so does Pa"),
        (["--precision", "fp16", "--step-in-backward"], "fp16's dynamic loss scaling"),
    ],
)
def test_the_table_refuses_what_the_engine_would(capsys, flags, message):
    """Layouts the engine refuses are one-line errors in the table too, as --advise skips them."""
    from zeroshard.cli import main

    assert main.main(["plan", "--preset", "nano", "--seq", "64", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_sequences_and_heads_are_checked_against_the_model(capsys, tmp_path):
    """As ``zeroshard train`` checks them: a preset's block size or a config's positions bound
    ``--seq`` (unset, it becomes the bound when that is shorter than 1024), and a config's
    key/value heads must split in ``--mp``."""
    from zeroshard.cli import main

    assert main.main(["plan", "--preset", "nano", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 64  # nano's block size
    assert main.main(["plan", "--preset", "nano", "--seq", "65"]) == 2
    assert "--seq 65 exceeds the 64 positions of preset 'nano'" in capsys.readouterr().err
    config = tmp_path / "llama.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }))  # fmt: skip
    assert main.main(["plan", "--hf", str(config), "--mp", "4"]) == 2
    assert "2 key/value heads" in capsys.readouterr().err
    # Whisper's decoder positions (it was planned at 1024 tokens, and train failed in the ranks)
    config.write_text(json.dumps({
        "model_type": "whisper", "vocab_size": 256, "d_model": 64, "encoder_layers": 1,
        "decoder_layers": 1, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_target_positions": 64,
    }))  # fmt: skip
    assert main.main(["plan", "--hf", str(config), "--seq", "128"]) == 2
    assert "--seq 128 exceeds the 64 positions" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ci_0_is_the_engine_without_checkpoints(capsys, stage):
    # zeroshard train's default keeps every activation (--checkpoint-every 0): the plan then
    # counts the device along the engine's timeline, the calibrated prediction
    # (test_planner_calibrate holds it against measured runs), not the papers' allowance.
    from zeroshard.planner import calibrate

    flags = ["--preset", "tiny", "--dp", "2", "--precision", "fp32", "--fragmentation", "0"]
    flags += ["--batch", "2", "--seq", "64", "--stage", str(stage)]
    out = _json([*flags, "--checkpoint-every", "0"], capsys)
    row = out["stages"][0]
    case = calibrate.Case(preset="tiny", stage=stage, micro_batch_size=2, seq_len=64)
    predicted = calibrate.predict(case, 2)
    assert row["device_bytes"] == sum(predicted["peak"].values())
    assert row["memory"]["peak_moment"] == predicted["peak_moment"]
    assert out["num_layers_per_checkpoint"] == 0 and "activation_checkpoint_bytes" not in out
    allowance = _json([*flags, "--ci", "1"], capsys)["stages"][0]["device_bytes"]
    assert row["device_bytes"] != allowance
    text = _run([*flags, "--ci", "0"], capsys)
    assert "largest moment of the engine's step" in text
    # The column holds the model states of that moment; at stages 2-3 the shards of units not
    # reduced yet are missing from it, and the formula's figure at rest is said beside it.
    at_rest = predicted["model_states_bytes"]
    assert row["model_states_at_rest_bytes"] == at_rest
    assert row["model_states_bytes"] == sum(predicted["peak"][c] for c in MODEL_STATES)
    said = f"at rest after the step they are stage {stage} {at_rest / 1e9:.3g} GB"
    assert (said in text) == (stage >= 2 and row["model_states_bytes"] != at_rest), text
    # --timeline: checkpoints counted as the engine keeps them, as calibrate measures them.
    timed = _json([*flags, "--ci", "2", "--timeline"], capsys)["stages"][0]
    case = calibrate.Case(
        preset="tiny", stage=stage, micro_batch_size=2, seq_len=64, checkpoint_every=2
    )
    predicted = calibrate.predict(case, 2)
    assert timed["device_bytes"] == sum(predicted["peak"].values())
    assert timed["memory"]["peak_moment"] == predicted["peak_moment"]
    paper = _json([*flags, "--ci", "2"], capsys)["stages"][0]["device_bytes"]
    assert timed["device_bytes"] < paper  # not every term at once
    assert "one span recomputed at a time" in _run([*flags, "--ci", "2", "--timeline"], capsys)


def test_accumulate_unreduced_flag(capsys):
    argv = ["--params", "1B", "--dp", "8", "--stage", "1,3", "--offload", "none"]
    argv += ["--grad-accum", "2"]
    plain = {r["stage"]: r for r in _json(argv, capsys)["stages"]}
    unreduced = {r["stage"]: r for r in _json([*argv, "--accumulate-unreduced"], capsys)["stages"]}
    # stage 3 holds the whole local gradient between micro-batches, as stage 1 always does
    assert unreduced[3]["memory"]["device"]["grads"] == plain[1]["memory"]["device"]["grads"]
    assert unreduced[3]["memory"]["device"]["grads"] > plain[3]["memory"]["device"]["grads"]
    assert unreduced[1]["memory"] == plain[1]["memory"]


def test_grad_accum_keeps_the_shards_of_a_step_in_backward(capsys):
    argv = ["--params", "1B", "--dp", "8", "--stage", "3", "--offload", "none"]
    plain = _json(argv, capsys)["stages"][0]["memory"]["device"]["grads"]
    stepped = _json([*argv, "--step-in-backward"], capsys)["stages"][0]["memory"]["device"]
    held = _json([*argv, "--step-in-backward", "--grad-accum", "4"], capsys)["stages"][0]
    assert stepped["grads"] == 0 and held["memory"]["device"]["grads"] == plain > 0
    # Along the engine's timeline (--ci 0) too; the advisor counts its own accumulation.
    at = ["--preset", "100m", "--dp", "2", "--stage", "3", "--step-in-backward", "--ci", "0"]
    one, four = (_json([*at, *more], capsys)["stages"][0] for more in ([], ["--grad-accum", "4"]))
    assert one["memory"]["peak"]["grads"] == 0 < four["memory"]["peak"]["grads"]
    assert four["memory"]["peak"]["grads"] == four["memory"]["device"]["grads"]


def test_grad_accum_repeats_what_runs_every_micro_batch(capsys):
    # Stages 2-3 reduce-scatter (and stage 3 gathers) in every micro-batch: comm/step counted
    # them once, 2.5x and 4x short of the ledger of a 4-micro-batch step (measured here: stage 2
    # moved 714,496 bytes, stage 3 1,549,568); the advisor counted them right.
    argv = ["--preset", "nano", "--dp", "2", "--precision", "fp32", "--stage", "0,1,2,3"]
    argv += ["--net-bandwidth", "1GB/s"]
    one, four = (
        {r["stage"]: r["communication"] for r in _json([*argv, *more], capsys)["stages"]}
        for more in ([], ["--grad-accum", "4"])
    )
    psi = 35_712
    for stage in (0, 1):  # replicated gradients: reduced once per step, whatever N
        assert four[stage]["bytes"] == one[stage]["bytes"] == 2 * 4 * psi
    assert four[2]["bytes"] == pytest.approx(5 * 4 * psi, rel=1e-3)  # 4 reduce-scatters, 1 gather
    every = sum(c["num_bytes"] for c in one[3]["collectives"] if c["every_micro_batch"])
    assert four[3]["bytes"] == one[3]["bytes"] + 3 * every and every > 0
    assert four[3]["seconds"] == pytest.approx(four[3]["bytes"] / 1e9)


def test_accumulate_unreduced_only_where_train_takes_it(capsys):
    # zeroshard train refuses it below stage 2 or with one micro-batch; plan took both without
    # a word, and --advise ranked such candidates first (stage 1, one micro-batch) with it.
    for argv in (["--stage", "0,1", "--grad-accum", "2"], ["--stage", "2"]):
        with pytest.raises(ValueError, match="--accumulate-unreduced needs stage 2 or 3"):
            plan.plan(_parse(["--preset", "nano", "--dp", "2", "--accumulate-unreduced", *argv]))
    _run(["--preset", "nano", "--dp", "2", "--accumulate-unreduced", "--grad-accum", "2"], capsys)
    argv = ["--preset", "nano", "--advise", "--device-type", "cpu", "--memory", "8GB"]
    argv += ["--peak-flops", "1TFLOP/s", "--net-bandwidth", "10GB/s", "--devices", "2"]
    argv += ["--global-batch", "8", "--batch", "1,4", "--accumulate-unreduced"]
    feasible = _json(argv, capsys)["feasible"]
    takes = {(c["stage"], c["num_micro_batches"]): c["accumulate_unreduced"] for c in feasible}
    assert takes == {(s, n): s >= 2 and n > 1 for s, n in takes}, takes
    assert any(takes.values()) and not all(takes.values())
    plain = _json([a for a in argv if a != "--accumulate-unreduced"], capsys)["feasible"]
    one_micro = {c["stage"]: c["device_bytes"] for c in plain if c["num_micro_batches"] == 1}
    for c in feasible:  # with one micro-batch, planned as without it
        if c["num_micro_batches"] == 1:
            assert c["device_bytes"] == one_micro[c["stage"]], c


def test_advise_flags_without_advise_are_refused():
    # --devices 64 planned for Nd = 1 without a word (132 GB per device against 2.12 GB).
    argv = ["--params", "7.5B", "--devices", "64", "--global-batch", "3", "--top", "0"]
    with pytest.raises(ValueError, match="--devices, --global-batch, --top are for --advise"):
        plan.plan(_parse(argv))
    with pytest.raises(ValueError, match="--nvme-bandwidth is for --advise"):
        plan.plan(_parse(["--params", "1B", "--nvme-bandwidth", "1GB/s"]))


def test_a_stage_given_twice_is_planned_once(capsys):
    rows = _json(["--params", "1B", "--dp", "8", "--stage", "1,3,1"], capsys)["stages"]
    assert [r["stage"] for r in rows] == [1, 3]


def frozen_gpt():
    """A factory for --module whose every parameter is frozen."""
    return GPT(PRESETS["nano"]).requires_grad_(False)


def test_a_module_with_nothing_to_train_is_refused():
    # (planned with exit 0, where zeroshard train --model refuses the same factory); its
    # forward on meta was said to fail, with MemTracker's error (its hooks on outputs that
    # need no gradient), and its activations taken from the GPT formulas
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="no parameter is trainable"):
            plan.plan(_parse(["--module", "test_cli_plan:frozen_gpt"]))
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "forward on the meta device failed" in m], said


def test_activation_checkpoints_go_where_the_flag_says(capsys):
    argv = ["--preset", "nano", "--stage", "3", "--dp", "2", "--ci", "1"]
    for flags, tier in (([], "device"), (["--offload-activations"], "cpu"),
                        (["--offload-activations", "nvme"], "nvme")):  # fmt: skip
        (row,) = _json([*argv, *flags], capsys)["stages"]
        held = {t: row["memory"][t]["activation_checkpoints"] for t in ("device", "cpu", "nvme")}
        assert held[tier] > 0 and sum(held.values()) == held[tier], (flags, held)
