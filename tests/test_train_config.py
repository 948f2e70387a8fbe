"""``TrainConfig`` and the train command's input checks: every bad value is one line naming the
field, the value and what is allowed, exit status 2, before any process starts (no torch job)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from zeroshard.cli.main import main
from zeroshard.models.gpt import PRESETS
from zeroshard.train_config import TrainConfig, field_docs


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert captured.out == ""  # nothing ran: no progress, no "done"
    return err


@pytest.mark.parametrize(
    ("toml", "needles"),
    [
        ('steps = "ten"', ["steps = 'ten'", "must be an integer"]),
        ('lr = "3e-3"', ["lr = '3e-3'", "must be a number", "no quotes"]),
        ("warmup_steps = -5", ["warmup_steps = -5", ">= 0"]),
        ("grad_clip = -1", ["grad_clip = -1", ">= 0"]),
        ("lr = nan", ["lr = nan", "finite"]),
        ("weight_decay = inf", ["weight_decay = inf", "finite"]),
        ("steps = 1.5", ["steps = 1.5", "integer"]),
        ("seed = true", ["seed = True", "integer"]),
        ('preset = "nano"', ["seq_len = 128", "block size 64", "nano", "--seq-len 64"]),
        ('lr_schedule = "step"', ["lr_schedule = 'step'", "cosine, linear, constant"]),
        ("stage = 4", ["stage = 4", "0, 1, 2, 3"]),
        ("max_skipped_steps = 0", ["max_skipped_steps = 0", ">= 1"]),
        ("grad_accum = 3", ["batch_size = 16", "grad_accum = 3", "multiple of 3"]),
        ('model = "no_colon"', ["model = 'no_colon'", "package.module:factory"]),
        ('tokenizer = "gpt2"', ["tokenizer = 'gpt2'", "--data"]),
        # TOML has no None: an example of the kind (it said "e.g. wrap = None")
        ('wrap = ["Blk"]', ["wrap = ['Blk'] is a list", 'e.g. wrap = "..." (or leave it out)']),
        ("lr = true", ["must be a number", "e.g. lr = 0.003"]),
    ],
)
def test_bad_config_values_are_one_line(capsys, tmp_path, toml, needles):
    config = tmp_path / "c.toml"
    config.write_text(toml + "\n")
    err = _one_line_error(capsys, ["train", "--config", str(config), "--out-dir", str(tmp_path)])
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"steps"'])
def test_a_json_config_that_is_not_an_object(capsys, tmp_path, text):
    config = tmp_path / "c.json"
    config.write_text(text)
    err = _one_line_error(capsys, ["train", "--config", str(config), "--out-dir", str(tmp_path)])
    assert "must hold an object of fields" in err, err


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--steps", "ten"], ["--steps 'ten'", "integer", "--steps 200"]),
        (["--seed", str(2**64)], ["seed = 18446744073709551616", "below 2**64"]),
        (["--lr", "inf"], ["lr = inf", "finite"]),
        (["--port", "70000"], ["--port 70000", "1-65535"]),
        (["--nproc", "two"], ["--nproc 'two' is not an integer"]),
        (["--model", "no.such.module:build"], ["no.such.module", "PYTHONPATH"]),
        (["--model", "json:no_such_factory"], ["no attribute 'no_such_factory'"]),
        # "No module named 'mymods.py'", and advice to put its folder on PYTHONPATH
        (["--model", "mymods.py:build"], ["name the module, not its file: --model mymods:build"]),
        (
            ["--model", "/home/u/proj/mymods.py:build"],
            ["mymods:build (/home/u/proj on PYTHONPATH)"],
        ),
        # Taken without a word where it does nothing (zeroshard plan refused it)
        (["--accumulate-unreduced", "true"], ["stage 2 or 3 and grad_accum >= 2", "stage 3"]),
        (
            ["--accumulate-unreduced", "true", "--stage", "1", "--grad-accum", "2"],
            ["got stage 1, grad_accum = 2"],
        ),
        (["--hf", "missing/config.json"], ["hf = 'missing/config.json'", "cannot read"]),
        (["--data", "missing.txt"], ["'missing.txt' does not exist (from the working directory"]),
        (["--model", "m:f", "--hf", "c.json"], ["pass one of --model and --hf"]),
        (["--nproc", "2", "--batch-size", "6", "--grad-accum", "2"], ["multiple of 4"]),
        (
            ["--nproc", "4", "--tp", "2", "--stage", "2", "--offload-optimizer", "nvme"]
            + ["--offload-gradients", "nvme", "--offload-folder", "swap"],
            ["grad_clip = 1.0 with tp = 2", "--offload-gradients cpu"],
        ),
    ],
)
def test_bad_flags_are_one_line(capsys, tmp_path, flags, needles):
    err = _one_line_error(capsys, ["train", *flags, "--out-dir", str(tmp_path)])
    for needle in needles:
        assert needle in err, err


def test_hf_config_shorter_than_seq_len(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_positions": 32}')
    argv = ["train", "--hf", str(config), "--seq-len", "64", "--out-dir", str(tmp_path)]
    err = _one_line_error(capsys, argv)
    assert "seq_len = 64 exceeds the 32 positions" in err and "--seq-len 32" in err, err


def test_data_too_small_for_the_batch(capsys, tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("hello world " * 20)  # 240 bytes: 216 for training, 24 for validation
    argv = ["train", "--data", str(text), "--preset", "nano", "--seq-len", "32"]
    err = _one_line_error(capsys, [*argv, "--out-dir", str(tmp_path)])
    assert "16 sequences" in err and "216 tokens has 5" in err, err
    assert "lower the batch size or seq_len (train: --batch-size, --seq-len)" in err, err


def test_tensorboard_missing(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a)
    )
    argv = ["train", "--log", "tensorboard", "--preset", "nano", "--seq-len", "32"]
    err = _one_line_error(capsys, [*argv, "--out-dir", str(tmp_path)])
    assert "pip install tensorboard" in err and "metrics.jsonl" in err, err


def test_tensorboard_that_fails_to_import(capsys, tmp_path, monkeypatch):
    # Installed but broken (a protobuf it does not support): rank 0 crashed after launch.
    pytest.importorskip("tensorboard")
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import then fails
    argv = ["train", "--log", "tensorboard", "--preset", "nano", "--seq-len", "32"]
    err = _one_line_error(capsys, [*argv, "--out-dir", str(tmp_path)])
    assert "cannot import tensorboard (ModuleNotFoundError: " in err, err
    assert "repair its install" in err, err


def test_every_field_has_a_docstring_and_a_checked_type():
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        assert len(docs.get(f.name, "")) > 10, f.name
        if f.default is not None and not isinstance(f.default, str):
            with pytest.raises(ValueError, match=f"^{f.name} = "):
                TrainConfig(**{f.name: "1"})  # a string where a number belongs


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"zeroshard \d+\.\d+\.\d+\S*", out.strip()), out


def test_a_signal_while_parsing_is_one_line_or_none_in_a_rank(capsys, monkeypatch):
    """Outside torchrun one line; a rank stopped by its agent as it starts says nothing (its
    launcher says why: a line from each rank would repeat it)."""
    import zeroshard.cli.main as cli_main

    monkeypatch.setattr(cli_main, "_parse", lambda argv: 15)  # SIGTERM came while parsing
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(["train"]) == 143
    assert capsys.readouterr().err == "zeroshard: interrupted\n"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert main(["train"]) == 143
    assert capsys.readouterr().err == ""


def test_help_teaches_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        shown = "none" if f.default is None else f.default
        first_words = " ".join(docs[f.name].split()[:4])
        assert flag in text and first_words in text, f.name
        assert f"(default: {shown}" in text, f.name
        for choice in TrainConfig.CHOICES.get(f.name, ()):
            assert str(choice) in text
    for name, cfg in PRESETS.items():
        assert re.search(rf"{name} +[\d.]+[KMB] parameters: {cfg.n_layer} blocks", text), name


def test_example_configs_are_valid():
    from pathlib import Path

    from zeroshard.cli.train import load_config

    examples = sorted(Path(__file__).parent.parent.joinpath("examples").glob("*.toml"))
    assert examples
    for path in examples:
        assert isinstance(load_config(path, {}), TrainConfig), path


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        (
            {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 30,
             "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256},
            ["transformers refuses this config", "hidden size (30) is not a multiple"],
        ),
        (
            {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32,
             "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 256},
            ["attends both ways", '"is_decoder": true'],
        ),
        # Encoders no list named (trained on the next token they saw, without a word)
        *(
            (
                {"model_type": family, "num_hidden_layers": 1, "hidden_size": 32,
                 "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 256},
                ["attends both ways", f"a {family} config"],
            )
            for family in ("megatron-bert", "roformer", "xlm-roberta-xl")
        ),
    ],
)  # fmt: skip
def test_hf_configs_transformers_refuses_or_that_see_ahead(capsys, tmp_path, config, needles):
    """Checked before launch: transformers' own validation (it raised a class of its own on
    every rank, a traceback), and an encoder config that would train on next tokens it sees."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    err = _one_line_error(capsys, ["train", "--hf", str(path), "--out-dir", str(tmp_path)])
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("pad_token_id", 999, "AssertionError: Padding_idx"), ("hidden_act", "bogus", "KeyError"),
     ("head_dim", -4, "negative dimension")],  # (intermediate_size: the size check)
)  # fmt: skip
def test_hf_configs_transformers_cannot_build_are_one_line(tmp_path, field, value, needle):
    """Fields transformers' config takes and its model cannot build with: a traceback from each
    rank and exit 1 (only its ValueErrors were said in one line)."""
    pytest.importorskip("transformers")
    from zeroshard.models import loading

    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
              "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config | {field: value}))
    with pytest.raises(ValueError, match="transformers cannot build a llama model") as info:
        loading._build_hf(str(path), 256)
    assert needle in str(info.value), info.value
    path.write_text(json.dumps(config))
    loading._build_hf(str(path), 256)  # (the config itself builds)


def test_model_states_beyond_the_node_s_memory_are_refused(capsys, tmp_path, monkeypatch):
    """3b at stage 3 on 2 ranks keeps 16 bytes per parameter in memory (47 GB): refused before
    launch (it passed, and the kernel killed a rank two minutes later); with every state on
    NVMe it is not."""
    from zeroshard.cli import train_checks

    monkeypatch.setattr(train_checks, "memory_available_bytes", lambda: 30 * 10**9)
    monkeypatch.setattr(train_checks, "_check_eager_build_fits", lambda *a: None)
    argv = ["train", "--preset", "3b", "--nproc", "2", "--out-dir", str(tmp_path)]
    err = _one_line_error(capsys, argv)
    assert "keeps 47.2 GB of model states" in err and "--offload-optimizer nvme" in err, err
    train_checks._check_states_fit(
        train_checks.TrainConfig(preset="3b", stage=3, offload_optimizer="nvme",
                                 offload_gradients="nvme", offload_params="nvme",
                                 offload_folder=str(tmp_path / "swap")),
        2, 2,
    )  # fmt: skip


def test_paths_in_a_config_file_expand_the_home_folder():
    """``out_dir = "~/runs/a"`` in a TOML file made a folder named ``~`` in the working
    directory (a shell expands it on a flag; nothing did in a file)."""
    cfg = TrainConfig(out_dir="~/runs/a", offload_optimizer="nvme", offload_folder="~/swap")
    assert cfg.out_dir == str(Path.home() / "runs" / "a")
    assert cfg.offload_folder == str(Path.home() / "swap")
    assert TrainConfig(out_dir="runs/~a").out_dir == "runs/~a"  # only a leading ~


def test_fp32_modules_at_fp32_are_refused():
    """Taken without a word (everything computes in FP32): its help says bf16/fp16 only."""
    with pytest.raises(ValueError, match="fp32_modules = 'LayerNorm' with precision = 'fp32'"):
        TrainConfig(fp32_modules="LayerNorm", precision="fp32")
    # TF32 is one switch for the process: those modules would run in TF32 too
    with pytest.raises(ValueError, match="precision = 'tf32'.*one switch for the whole process"):
        TrainConfig(fp32_modules="LayerNorm", precision="tf32")
    TrainConfig(fp32_modules="LayerNorm", precision="bf16")
    TrainConfig(fp32_modules="LayerNorm", precision="auto")
