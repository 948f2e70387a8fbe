"""zeroshard.export: a stage-3 checkpoint of a real transformers GPT-2 exported to safetensors
loads with ``from_pretrained`` and gives the trained model's logits; shards and index, tied
weights, dtype casts, one-line errors and the ``zeroshard export`` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, build, loss_of, param_groups

import zeroshard
from zeroshard import checkpoint
from zeroshard.cli import main as cli_main
from zeroshard.export import INDEX_FILE, SINGLE_FILE, ExportError, export_safetensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

TIED = {"lm_head.weight": "transformer.wte.weight"}
CONFIGS = ["config.json", "generation_config.json"]


def _train_and_save(path: str) -> dict:
    """Stage 3 on every rank, 2 AdamW steps, saved; rank 0 returns the full weights."""
    torch.manual_seed(0)
    model, policy = build("hf_gpt2")
    model = zeroshard.shard(model, stage=3, wrap=policy)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, param_groups(model, 0.1), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 4 // world
    for step in range(2):
        x, y = batch("hf_gpt2", step, 4)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.backward(loss_of("hf_gpt2", model, x[mine], y[mine]))
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt, {"step": 2})
    return zeroshard.full_state_dict(model)


@pytest.fixture(scope="module")
def trained(workers2, tmp_path_factory):
    """(checkpoint folder, the trained model's full state dict)."""
    path = tmp_path_factory.mktemp("export") / "step-000002"
    full = workers2.run(_train_and_save, str(path))[0]
    return path, full


def _config():
    config = build("hf_gpt2")[0].config
    config.architectures = ["GPT2LMHeadModel"]
    return config


def _reference_logits(full: dict) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel(_config())
    model.load_state_dict(full)
    return _logits(model)


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch("hf_gpt2", 7, 3)[0]).logits


def _stored(out, files) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor in the safetensors files: {name: (file, tensor)}; checks their metadata."""
    found = {}
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, file
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert name not in found, name
                found[name] = (file, f.get_tensor(name))
    return found


def test_single_file_loads_with_from_pretrained(trained, tmp_path):
    path, full = trained
    out = tmp_path / "hf"
    result = export_safetensors(path, out, config=_config())
    assert result.files == [SINGLE_FILE] and result.index is None
    assert sorted(p.name for p in out.iterdir()) == [*CONFIGS, SINGLE_FILE]
    assert result.tied == TIED
    stored = _stored(out, [SINGLE_FILE])
    assert set(stored) == set(full) - {"lm_head.weight"}  # tied: stored once
    for name, (_, t) in stored.items():
        assert t.dtype == torch.float32 and torch.equal(t, full[name]), name
    assert result.total_size == sum(t.numel() * 4 for _, t in stored.values())
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert torch.equal(hf.lm_head.weight, full["lm_head.weight"])  # re-tied on load
    assert (_logits(hf) - _reference_logits(full)).abs().max().item() <= 1e-6


def test_small_shards_write_an_index(trained, tmp_path):
    path, full = trained
    out = tmp_path / "hf"
    result = export_safetensors(path, out, config=_config(), max_shard_bytes=20_000)
    n = len(result.files)
    assert n > 2 and result.index == INDEX_FILE
    assert result.files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / SINGLE_FILE).exists()
    index = json.loads((out / INDEX_FILE).read_text())
    stored = _stored(out, result.files)
    assert index["weight_map"] == {name: file for name, (file, _) in stored.items()}
    assert set(index["weight_map"]) == set(full) - {"lm_head.weight"}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for _, t in stored.values())
    for file in result.files:  # no file over the limit unless it holds one bigger tensor
        tensors = [t for f, t in stored.values() if f == file]
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors) <= 20_000, file
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert (_logits(hf) - _reference_logits(full)).abs().max().item() <= 1e-6
    # exporting again as one file removes the shards and the index of the earlier export
    export_safetensors(path, out, config=_config())
    assert sorted(p.name for p in out.iterdir()) == [*CONFIGS, SINGLE_FILE]


def test_bf16_cast(trained, tmp_path):
    path, full = trained
    out = tmp_path / "hf"
    result = export_safetensors(path, out, dtype="bf16", config=_config())
    assert result.dtype == "bfloat16"
    stored = _stored(out, result.files)
    for name, (_, t) in stored.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].bfloat16()), name
    assert result.total_size == sum(t.numel() * 2 for _, t in stored.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # (named none)
    # A config that names its dtype (as a plain save_pretrained writes it) gets the files' one:
    # it said float32, and from_pretrained upcast the BF16 files
    config = _config()
    config.dtype = torch.float32
    export_safetensors(path, out, dtype="bf16", config=config)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.GPT2LMHeadModel.from_pretrained(out).dtype == torch.bfloat16
    config.dtype = torch.bfloat16  # and BF16's config over FP32 files: they loaded rounded
    export_safetensors(path, out, config=config)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_a_config_without_architectures_still_ties_and_files_are_readable(trained, tmp_path):
    path, full = trained
    config = _config()
    config.architectures = None  # as GPT2Config(...).save_pretrained writes it
    result = export_safetensors(path, tmp_path / "hf", config=config)
    assert result.tied == TIED  # both stored before: the ties were read from architectures only
    mode = (tmp_path / "hf" / SINGLE_FILE).stat().st_mode & 0o777
    probe = tmp_path / "probe"
    probe.touch()  # a file as open() makes it: 0666 less the umask
    assert mode == probe.stat().st_mode & 0o777, oct(mode)  # safetensors alone writes 0600


def test_a_tied_checkpoint_exported_with_an_untied_config_stores_the_head(trained, tmp_path):
    """The checkpoint's recorded tie dropped lm_head.weight even though the config's model
    keeps its own head (tie_word_embeddings false): from_pretrained made one at random (logits
    0.68 off). The config's ties decide."""
    path, full = trained
    config = _config()
    config.tie_word_embeddings = False
    result = export_safetensors(path, tmp_path / "hf", config=config)
    assert result.tied == {} and set(result.weight_map) == set(full)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.lm_head.weight, full["lm_head.weight"])


def test_without_config_the_ties_the_checkpoint_recorded_are_used(trained, tmp_path):
    """The checkpoint records which names were one parameter (``zeroshard.json``'s "tied"): an
    export without a config stores them once too (it stored the head twice); ``tied={}``
    stores every name."""
    path, full = trained
    assert checkpoint.read_meta(path)["tied"] == TIED
    result = export_safetensors(path, tmp_path / "hf", dtype=torch.float16)
    stored = _stored(tmp_path / "hf", result.files)
    assert set(stored) == set(full) - {"lm_head.weight"} and result.tied == TIED
    assert all(t.dtype == torch.float16 for _, t in stored.values())
    every = export_safetensors(path, tmp_path / "every", tied={})
    assert set(every.weight_map) == set(full) and every.tied == {}


def test_the_generation_config_and_the_class_go_with_the_export(trained, tmp_path):
    """A chat model's generation config (its stop tokens) beside the config given was left
    behind: the export generated 20 tokens past eos [2, 7, 9]; a config object naming no class
    gave a config.json without ``architectures``, which serving stacks read."""
    path, full = trained
    folder = tmp_path / "pretrained"
    _config().save_pretrained(folder)
    chat = transformers.GenerationConfig(eos_token_id=[2, 7, 9], max_new_tokens=5)
    chat.save_pretrained(folder)
    for given in (folder, folder / "config.json"):
        export_safetensors(path, tmp_path / "hf", config=given)
        hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
        assert hf.generation_config.eos_token_id == [2, 7, 9], given
        assert hf.generation_config.max_new_tokens == 5, given
    config = _config()
    config.architectures = None
    export_safetensors(path, tmp_path / "bare", config=config)
    assert config.architectures is None  # (the caller's object is left alone)
    written = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert written["architectures"] == ["GPT2LMHeadModel"]
    defaults = transformers.GenerationConfig.from_model_config(_config()).to_dict()
    saved = transformers.GenerationConfig.from_pretrained(tmp_path / "bare").to_dict()
    assert {k: saved[k] for k in ("bos_token_id", "eos_token_id")} == {
        k: defaults[k] for k in ("bos_token_id", "eos_token_id")
    }


def test_declared_ties_are_checked(trained, tmp_path):
    path, _ = trained
    with pytest.raises(ExportError, match="shapes differ"):
        export_safetensors(path, tmp_path / "a", tied={"transformer.wpe.weight": "lm_head.weight"})
    h0, h1 = "transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"
    with pytest.raises(ExportError, match="values differ"):
        export_safetensors(path, tmp_path / "b", tied={h1: h0})
    with pytest.raises(ExportError, match="lm_head.wieght is not in .*fix or drop that --tie"):
        export_safetensors(path, tmp_path / "c", tied={"lm_head.wieght": "transformer.wte.weight"})
    assert not any((tmp_path / d).exists() for d in "abc")  # nothing written


def test_mistakes_are_one_line(trained, tmp_path, capsys):
    path, _ = trained
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        export_safetensors(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="is not a zeroshard checkpoint"):
        export_safetensors(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(checkpoint.CheckpointError, match=f"is not one: .* {path}$"):
        export_safetensors(path.parent, tmp_path / "out")  # a folder of checkpoints: the newest
    with pytest.raises(ExportError, match="dtype"):
        export_safetensors(path, tmp_path / "out", dtype="int3")
    with pytest.raises(ExportError, match="positive"):
        export_safetensors(path, tmp_path / "out", max_shard_bytes=0)
    assert cli_main.main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard export: error: no checkpoint at") and err.count("\n") == 1


def test_damaged_checkpoints_and_a_file_as_out_are_refused(trained, tmp_path):
    path, _ = trained
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match="is a file, not a folder"):
        export_safetensors(path, tmp_path / "afile")
    # Into the checkpoint or a folder inside it (a later save there failed on it, and pruning
    # the checkpoint deleted the export without a word).
    for out in (Path(path), Path(path) / "hf"):
        with pytest.raises(ExportError, match="would write into the checkpoint"):
            export_safetensors(path, out)
    assert not (Path(path) / "hf").exists()
    damaged = tmp_path / "step-000002"
    shutil.copytree(path, damaged)
    data = sorted(damaged.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the checksum recorded at save differs
    data.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match=f"damaged .*{data.name} is corrupted"):
        export_safetensors(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_config_of_another_model_is_refused(trained, tmp_path):
    import transformers

    path, _ = trained
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    with pytest.raises(ExportError, match="describes another model than the checkpoint's"):
        export_safetensors(path, tmp_path / "out", config=llama)
    # The same body with a classifier's head: it was exported, and from_pretrained dropped the
    # trained head (unexpected lm_head.weight) and made a random one (missing score.weight).
    classifier = _config()
    classifier.architectures = ["GPT2ForSequenceClassification"]
    said = r"as GPT2ForSequenceClassification, 1 of the checkpoint's tensors are not in it "
    said += r"\(lm_head.weight\); it has 1 parameters the checkpoint lacks \(score.weight\)"
    with pytest.raises(ExportError, match=said):
        export_safetensors(path, tmp_path / "out", config=classifier)
    assert not (tmp_path / "out").exists()


def test_a_config_without_architectures_finds_the_exact_model_kind():
    """A T5 encoder's tensors and a T5 config naming no class: the search stopped at the first
    kind holding every tensor (T5ForConditionalGeneration, with a decoder the checkpoint lacks),
    which the check of parameters made at random then refused."""
    import transformers

    from zeroshard.export import _check_config

    config = transformers.T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2
    )  # fmt: skip
    with torch.device("meta"):
        encoder = transformers.T5EncoderModel(config)
    entries = {k: (v.shape, v.dtype) for k, v in encoder.state_dict().items()}
    assert _check_config(config, entries) is transformers.T5EncoderModel


def test_cli_subprocess(trained, tmp_path):
    path, full = trained
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "export", str(path), str(out)]
    more = [*cmd[:-1], str(tmp_path / "sharded"), "--format", "safetensors", "--dtype", "bf16"]
    more += ["--max-shard-size", "20kB", "--tie", "lm_head.weight=transformer.wte.weight"]
    # Two independent exports of the same checkpoint, at the same time (mostly start-up).
    procs = [subprocess.Popen(c, stdout=PIPE, stderr=PIPE, text=True) for c in (cmd, more)]
    try:
        (first, first_err), (second, second_err) = (p.communicate(timeout=120) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0, first_err
    assert sorted(p.name for p in out.iterdir()) == [SINGLE_FILE]
    assert f"{len(full) - 1} tensors" in first  # the head, tied (recorded), stored once
    assert procs[1].returncode == 0, second_err
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(full) - {"lm_head.weight"}
    assert "lm_head.weight: tied to transformer.wte.weight" in second


def _save_large(path: str) -> None:
    torch.manual_seed(0)
    model = zeroshard.shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), stage=0)
    with torch.no_grad(), zeroshard.summon_full_params(model):
        model[0].weight[0, 0] = 1e6  # beyond fp16's 65504
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    checkpoint.save(path, model, opt)


def test_a_value_beyond_the_export_dtype_is_an_error(workers1, tmp_path):
    """fp16 ends at 65504: a cast that makes inf of a finite weight is refused, not written."""
    path = tmp_path / "ckpt"
    workers1.run(_save_large, str(path))
    with pytest.raises(
        ExportError, match="0.weight does not fit in torch.float16: values up to 1e"
    ):
        export_safetensors(path, tmp_path / "out", dtype="fp16")
    assert not list((tmp_path / "out").glob("*.safetensors"))
    assert export_safetensors(path, tmp_path / "bf16", dtype="bf16").files


def _hf_configs() -> dict:
    """Tiny configs without ``architectures`` (as ``XConfig(...)`` makes them), of models that
    are not causal LMs: a seq2seq LM whose causal-LM class rewrites its config, and an image
    classifier."""
    bart = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32,
    )  # fmt: skip
    vit = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_labels=3,
    )  # fmt: skip
    return {
        "bart": (bart, transformers.BartForConditionalGeneration),
        "vit": (vit, transformers.ViTForImageClassification),
    }


def _save_hf(path: str, kind: str) -> None:
    torch.manual_seed(0)
    config, cls = _hf_configs()[kind.removesuffix("_bf16")]
    model = cls(config).to(torch.bfloat16) if kind.endswith("_bf16") else cls(config)
    model = zeroshard.shard(model, stage=0)
    checkpoint.save(path, model, zeroshard.optimizer(model, torch.optim.SGD, lr=0.1))


@pytest.mark.parametrize("kind", ["bart", "vit"])
def test_a_config_without_architectures_of_another_kind_of_model(workers1, tmp_path, kind):
    # BART's config came back a decoder's (BartForCausalLM, built to check it, rewrote it), in
    # the caller's object and in config.json; a ViT classifier's own config was refused
    path = tmp_path / "ckpt"
    workers1.run(_save_hf, str(path), kind)
    config, cls = _hf_configs()[kind]
    before = config.to_dict()
    export_safetensors(path, tmp_path / "out", config=config)
    assert config.to_dict() == before
    written = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    for key in ("is_decoder", "is_encoder_decoder"):
        assert getattr(written, key, None) == getattr(config, key, None), key
    torch.manual_seed(0)
    expected = cls(config).state_dict()
    loaded = cls.from_pretrained(tmp_path / "out").state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_bf16_model_s_export_names_its_masters_dtype(workers1, tmp_path):
    """A BF16 BART: FP32 masters beside its BF16 ``final_logits_bias`` buffer. With two dtypes
    in the files config.json named none, and from_pretrained loaded the FP32 masters in BF16
    (7.2e-4 off the files after a step)."""
    path = tmp_path / "ckpt"
    workers1.run(_save_hf, str(path), "bart_bf16")
    config, cls = _hf_configs()["bart"]
    export_safetensors(path, tmp_path / "out", config=config)
    stored = _stored(tmp_path / "out", [SINGLE_FILE])
    assert {t.dtype for _, t in stored.values()} == {torch.float32, torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    assert cls.from_pretrained(tmp_path / "out").dtype == torch.float32


class _Shared(torch.nn.Module):
    """One block registered at two indices (ALBERT-style sharing) and a head tied to the
    embedding."""

    def __init__(self) -> None:
        super().__init__()
        block = torch.nn.Linear(8, 8)
        block.register_buffer("scale", torch.full((8,), 0.5))  # persistent: in the state dict
        block.register_buffer("rot", torch.ones(8), persistent=False)  # not: no key, no tie
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([block, torch.nn.Linear(8, 8), block])
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h)) * getattr(layer, "scale", 1.0)
        return self.head(h)


def test_a_module_registered_twice_is_stored_once(lone_process, tmp_path):
    # The checkpoint recorded tied parameters only, not a whole module at two places: its
    # second name was exported as a copy.
    model = zeroshard.shard(_Shared(), stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    opt.backward(model(torch.randint(0, 16, (2, 4))).square().mean())
    opt.step()
    checkpoint.save(tmp_path / "ck", model, opt, {"step": 1})
    full = zeroshard.full_state_dict(model)
    result = export_safetensors(tmp_path / "ck", tmp_path / "hf")
    ties = {"layers.2.weight": "layers.0.weight", "layers.2.bias": "layers.0.bias"}
    ties["layers.2.scale"] = "layers.0.scale"  # (its buffers too: they were stored twice)
    assert checkpoint.read_meta(tmp_path / "ck")["tied"] == {**ties, "head.weight": "emb.weight"}
    assert result.tied == {**ties, "head.weight": "emb.weight"}, result.tied
    stored = _stored(tmp_path / "hf", result.files)
    assert set(stored) == set(full) - set(result.tied)
    assert all(torch.equal(stored[k][1], full[k]) for k in stored)


def test_paths_under_the_home_folder(trained, tmp_path, monkeypatch):
    """``~`` as checkpoint.save takes it: export wrote into a literal "~" folder under the
    working directory, and refused a checkpoint path that save had accepted."""
    path, _ = trained
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(path, tmp_path / "ck")
    result = export_safetensors("~/ck", "~/hf", config=_config())
    assert result.out_dir == str(tmp_path / "hf") and (tmp_path / "hf" / SINGLE_FILE).is_file()
    assert not (tmp_path / "~").exists()
