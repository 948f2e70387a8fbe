"""``TrainConfig``: every knob of ``zeroshard train``, checked for type and range before any work.

Each field is a CLI flag (``--batch-size``) and a config-file key (``batch_size``); its docstring
is the flag's ``--help`` text (``field_docs``). A wrong value raises ``ValueError`` with one line
naming the field, the value and what is allowed, e.g.
``lr = '3e-3' is a string; lr must be a number, e.g. lr = 0.003 (no quotes in TOML)``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from zeroshard.models.gpt import PRESETS
from zeroshard.schedule import SCHEDULES

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "auto")
LOGS = ("jsonl", "tensorboard")
TIERS = ("cpu", "nvme")
_PATHS = ("hf", "data", "out_dir", "data_dir", "resume", "offload_folder")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # pkg.mod:attr


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every knob of a ``zeroshard train`` run; CLI flags and config-file keys map one-to-one."""

    preset: str = "tiny"
    """Built-in GPT preset (zeroshard.models.gpt.PRESETS); ignored with --model or --hf."""
    model: str | None = None
    """Your own model: "pkg.module:factory", a callable taking no arguments that returns an
    nn.Module mapping token ids (B, T) int64 to logits (B, T, V) (or an output with .logits)."""
    hf: str | None = None
    """A transformers causal LM built (randomly initialized) from this config.json; units are its
    _no_split_modules blocks."""
    wrap: str | None = None
    """Module class name(s), comma-separated, that become units (gathered and freed together);
    default: the model's _no_split_modules, the GPT's Block, else the whole model is one unit."""
    meta_init: bool = False
    """Build the model on the meta device and initialize it one unit at a time while it is
    sharded, so no rank ever holds all of it (for models whose FP32 weights do not fit once per
    local rank); the built-in presets and --model (its factory runs under torch.device("meta"),
    units initialized by reset_parameters()). Initial values differ from an eager build."""
    data: str | None = None
    """Training text: a text file, a folder of text files, or a .npy of token ids; the last tenth
    of the tokens is validation (default: the standard library's Python source, bytes)."""
    tokenizer: str | None = None
    """A transformers tokenizer installed locally (a name in the Hugging Face cache, or a folder)
    for --data text; default byte-level (vocab 256)."""
    stage: int = 3
    """ZeRO stage: 0 data parallel, 1 + optimizer states sharded, 2 + gradients, 3 + parameters."""
    precision: str = "fp32"
    """Compute precision; auto is BF16 where the device supports it, else FP32."""
    fp32_modules: str | None = None
    """Module class name(s), comma-separated, kept in FP32 under bf16/fp16 (norms, a MoE router):
    each becomes a unit computing in FP32, its output cast back (FSDP2's per-module policy)."""
    checkpoint_every: int = 0
    """Activation checkpointing: spans of this many units keep only their input (0: off)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each block's attention and MLP (the GPT's plan,
    a Hugging Face config's base_model_tp_plan, or a --model's tp_plan attribute); the ranks
    launched must be a multiple of it. ZeRO shards over ranks / tp."""
    shard_group_size: int = 0
    """Hybrid sharding (HSDP, ZeRO++'s hpZ): stages 1-3 shard inside groups of this many
    consecutive data-parallel ranks (a node) and replicate across groups, so parameter gathers
    stay inside a group; 0 shards over every data-parallel rank. Must divide ranks / tp."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (built-in GPT, --tp 2 or more): layer norms and residual
    adds run on 1/tp of each sequence per tensor-parallel rank, and activation checkpoints are
    kept 1/tp per rank without Pa's all-gather; seq_len must divide by tp."""
    partition_activations: bool = False
    """ZeRO-R's Pa: each activation checkpoint kept 1/tp per tensor-parallel rank, all-gathered
    before its recomputation (needs --tp 2 or more and --checkpoint-every)."""
    offload_activations: str | None = None
    """Pa+cpu: activation checkpoints (their pieces with --partition-activations true) on cpu
    or nvme (swap files in offload_folder), read back ahead of their recomputation; needs
    --checkpoint-every."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 16
    """Global batch in sequences per optimizer step, summed over ranks and micro-batches; must
    divide by ranks x grad_accum."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation): the same batch in grad_accum
    forward/backward passes of batch_size / (ranks x grad_accum) sequences per rank."""
    accumulate_unreduced: bool = False
    """Stages 2-3 with grad_accum > 1: keep each unit's local gradient whole over the
    micro-batches and reduce-scatter once per step (less communication, and a whole gradient of
    the model in memory: zeroshard plan --accumulate-unreduced counts it); by default every
    micro-batch's gradient is reduce-scattered into the shards, as ZeRO-2/3 have it."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's block size."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warm-up."""
    lr_schedule: str = "cosine"
    """After the warm-up: cosine or linear decay to lr / 10 at the last step, or constant."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up from lr / warmup_steps to lr (0: none)."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norms)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    optimizer_step: str = "after_backward"
    """When each unit's optimizer update runs: after_backward (one step per batch), or
    in_backward (stages 2-3: each unit steps as soon as its gradient shard is reduced, so the
    shards never pile up; no gradient clipping, no fp16). In_backward, a step whose gradients
    hold inf/NaN keeps the updates of the units that stepped before any rank saw it: it counts
    as skipped (the schedule holds) but is only partly so."""
    max_skipped_steps: int = 10
    """Consecutive steps with non-finite gradients after which training stops as diverged (fp32,
    tf32, bf16); fp16 uses the loss scaler's rule (inf/NaN at the minimum loss scale)."""
    timeout: float = 300.0
    """Seconds a collective waits for every rank before failing with one line naming the
    collective, the unit and the rank that did not arrive (flag: 60, 60s, 5m or 1h)."""
    seed: int = 0
    """Seed of the initialization and of the batches."""
    eval_every: int = 50
    """Steps between validation evaluations (and one at the end)."""
    eval_batches: int = 8
    """Global validation batches per evaluation."""
    log_every: int = 10
    """Steps between lines of metrics.jsonl."""
    log: str = "jsonl"
    """Metrics sinks: jsonl (out_dir/metrics.jsonl), or tensorboard (also event files in
    out_dir/tensorboard; needs the tensorboard package)."""
    progress_every: float = 30.0
    """Seconds between progress lines when the progress stream (stderr) is not a terminal (a
    terminal gets a live bar)."""
    out_dir: str = "runs/train"
    """Output folder (created if missing)."""
    data_dir: str | None = None
    """Cache folder of the standard-library corpus (default ~/.cache/zeroshard)."""
    save_every: int = 0
    """Steps between checkpoints in out_dir/ckpt (and one at the end); 0: no checkpoints."""
    keep: int = 3
    """Checkpoints kept in out_dir/ckpt (the oldest are removed)."""
    resume: str | None = None
    """A checkpoint folder to continue from, or "auto": the newest complete one in out_dir/ckpt."""
    offload_optimizer: str | None = None
    """ZeRO-Offload: the optimizer states (AdamW: 8 bytes per parameter over the ranks) on cpu
    or nvme (swap files in offload_folder, streamed one unit at a time at the step)."""
    offload_gradients: str | None = None
    """The reduced gradient shards on cpu or nvme (nvme needs offload_optimizer nvme); needs
    stage 2 or 3."""
    offload_params: str | None = None
    """ZeRO-Infinity: the FP32 master parameter shards on cpu or nvme (read back ahead of each
    unit's gather, written after the step); needs stage 3."""
    offload_folder: str | None = None
    """Folder for the nvme placements' swap files (one sub-folder per rank), on the fast disk;
    created if missing, must be writable."""

    CHOICES: ClassVar[dict[str, tuple]] = {
        "preset": tuple(PRESETS),
        "stage": (0, 1, 2, 3),
        "precision": PRECISIONS,
        "lr_schedule": SCHEDULES,
        "log": LOGS,
        "offload_optimizer": TIERS,
        "offload_gradients": TIERS,
        "offload_params": TIERS,
        "offload_activations": TIERS,
        "optimizer_step": ("after_backward", "in_backward"),
    }
    """The allowed values of the fields that have a fixed set."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(f.name, getattr(self, f.name), str(f.type), f.default)
        for name in _PATHS:  # "~/runs" in a config file, as a shell would expand it on a flag
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))
        for name in ("hf", "data"):  # inputs: the run's config.json must find them from any cwd
            value = getattr(self, name)
            if isinstance(value, str) and os.path.exists(value):
                object.__setattr__(self, name, os.path.abspath(value))
        if self.model and self.hf:
            raise ValueError(
                f"model = {self.model!r} and hf = {self.hf!r}: pass one of --model and --hf"
            )
        if self.meta_init and self.hf:
            raise ValueError(
                f"meta_init = true with hf = {self.hf!r}: transformers models compute buffers "
                "(e.g. rotary frequencies) when built, which the meta device would lose; drop "
                "--meta-init, or pass --model with a factory that initializes them"
            )
        if self.meta_init and self.tp > 1:
            raise ValueError(
                f"meta_init = true with tp = {self.tp}: tensor parallelism splits materialized "
                "weights; drop --meta-init or pass --tp 1"
            )
        block = PRESETS[self.preset].block_size
        if not (self.model or self.hf) and self.seq_len > block:
            raise ValueError(
                f"seq_len = {self.seq_len} exceeds the block size {block} of preset "
                f"{self.preset!r}; pass --seq-len {block} or less, or a larger --preset"
            )
        if self.tokenizer and not self.data:
            raise ValueError(
                f"tokenizer = {self.tokenizer!r} without data: the built-in corpus is bytes; "
                "pass --data with your text, or drop --tokenizer"
            )
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size = {self.batch_size} does not split into grad_accum = "
                f"{self.grad_accum} micro-batches; pass a multiple of {self.grad_accum}"
            )
        if self.shard_group_size and self.stage == 0:
            raise ValueError(
                f"shard_group_size = {self.shard_group_size} at stage 0: plain data parallel "
                "shards nothing; pass --stage 1, 2 or 3, or drop --shard-group-size"
            )
        if self.accumulate_unreduced and (self.stage < 2 or self.grad_accum < 2):
            raise ValueError(  # (taken without a word, the summary saying it was on)
                f"accumulate_unreduced = true needs stage 2 or 3 and grad_accum >= 2, got stage "
                f"{self.stage}, grad_accum = {self.grad_accum}: stages 0-1 reduce once per step "
                "anyway, and one micro-batch has nothing to accumulate; drop it, or pass "
                "--grad-accum 2 or more at --stage 2 or 3"
            )
        if self.fp32_modules and self.precision in ("fp32", "tf32"):
            # fp32: taken without a word (everything computes in FP32 anyway); tf32: one switch
            # for the process, those modules' matmuls would run in TF32 too
            raise ValueError(
                f"fp32_modules = {self.fp32_modules!r} with precision = {self.precision!r}: it "
                "keeps those modules in FP32 under bf16 or fp16"
                + (
                    ", and TF32 is one switch for the whole process"
                    if self.precision == "tf32"
                    else ""
                )
                + "; pass --precision bf16 (or auto), or drop --fp32-modules"
            )
        self._check_offload()
        self._check_activations()
        if self.optimizer_step == "in_backward":
            self._check_step_in_backward()

    @property
    def step_in_backward(self) -> bool:
        return self.optimizer_step == "in_backward"

    def _check_step_in_backward(self) -> None:
        """What stepping inside backward cannot have (``zeroshard.model_states.backward_step``)."""
        problem = None
        if self.stage < 2:
            problem = f"needs partitioned gradients (stage 2 or 3), got stage {self.stage}"
        elif self.grad_clip > 0:
            problem = (
                f"cannot clip gradients (grad_clip = {self.grad_clip}): each unit updates before "
                "the global norm is known; pass --grad-clip 0"
            )
        elif self.precision == "fp16":
            problem = "cannot skip whole steps, which fp16 loss scaling needs; pass bf16 or fp32"
        elif "nvme" in (self.offload_optimizer, self.offload_gradients, self.offload_params):
            problem = "cannot stream nvme placements in step order; keep them in memory"
        if problem:
            raise ValueError(
                f"optimizer_step = 'in_backward' {problem}, or use --optimizer-step after_backward"
            )

    def _check_activations(self) -> None:
        """Tensor parallelism and where activation checkpoints go."""
        if self.sequence_parallel:
            problem = None
            if self.tp < 2:
                problem = "it splits sequences over tensor-parallel ranks: pass --tp 2 or more"
            elif self.model or self.hf:
                problem = "it has a plan for the built-in GPT only: use --preset"
            elif self.seq_len % self.tp:
                problem = f"seq_len = {self.seq_len} must split evenly: use a multiple of {self.tp}"
            elif self.partition_activations:
                problem = (
                    "it keeps activation checkpoints 1/tp per rank already: drop "
                    "--partition-activations"
                )
            if problem:
                raise ValueError(
                    f"sequence_parallel = true: {problem}, or drop --sequence-parallel"
                )
        if self.partition_activations and self.tp < 2:
            raise ValueError(
                "partition_activations splits checkpoints across tensor-parallel ranks: pass "
                "--tp 2 or more, or drop --partition-activations"
            )
        for name in ("partition_activations", "offload_activations"):
            if getattr(self, name) and not self.checkpoint_every:
                raise ValueError(
                    f"{name} places activation checkpoints, and there are none: pass "
                    "--checkpoint-every 1 (or more) too"
                )

    def _check_offload(self) -> None:
        """The placements this stage can have, a folder exactly when something is on nvme."""
        places = {
            "offload_optimizer": self.offload_optimizer,
            "offload_gradients": self.offload_gradients,
            "offload_params": self.offload_params,
            "offload_activations": self.offload_activations,
        }
        on_disk = [name for name, where in places.items() if where == "nvme"]
        if on_disk and self.offload_folder is None:
            raise ValueError(
                f"{on_disk[0]} = 'nvme' needs offload_folder, a folder on the fast disk for the "
                f"swap files; pass --offload-folder DIR"
            )
        if self.offload_folder is not None and not on_disk:
            raise ValueError(
                f"offload_folder = {self.offload_folder!r} is only used by nvme placements; "
                "drop --offload-folder or pass e.g. --offload-optimizer nvme"
            )
        if self.offload_params and self.stage < 3:
            raise ValueError(
                f"offload_params = {self.offload_params!r} at stage {self.stage} is not possible: "
                "parameters are partitioned only at stage 3; pass --stage 3 or drop "
                "--offload-params"
            )
        if self.offload_gradients and self.stage < 2:
            raise ValueError(
                f"offload_gradients = {self.offload_gradients!r} at stage {self.stage} is not "
                "possible: gradients are partitioned from stage 2; pass --stage 2 or 3 or drop "
                "--offload-gradients"
            )
        if self.offload_gradients == "nvme" and self.offload_optimizer != "nvme":
            raise ValueError(
                "offload_gradients = 'nvme' needs offload_optimizer = 'nvme' (the step reads "
                "them back with the states); pass --offload-optimizer nvme too"
            )
        if self.offload_gradients == "nvme" and self.tp > 1 and self.grad_clip > 0:
            raise ValueError(
                f"grad_clip = {self.grad_clip} with tp = {self.tp} and offload_gradients = "
                "'nvme': tensor-parallel clipping needs the gradients in memory; pass "
                "--offload-gradients cpu, or --grad-clip 0"
            )

    def offload(self) -> Any:
        """The ``zeroshard.Offload`` of these fields, or None when nothing is offloaded."""
        if not (
            self.offload_optimizer
            or self.offload_gradients
            or self.offload_params
            or self.offload_activations
        ):
            return None
        from zeroshard.offload import Offload

        return Offload(
            optimizer=self.offload_optimizer,
            gradients=self.offload_gradients,
            parameters=self.offload_params,
            activations=self.offload_activations,
            folder=self.offload_folder,
        )


# Lower bounds of numeric fields: (bound, inclusive). Fields absent here only need their type.
_AT_LEAST_1 = ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_batches", "tp")
_MINIMUM: dict[str, tuple[float, bool]] = {
    **{name: (1, True) for name in (*_AT_LEAST_1, "log_every", "keep", "max_skipped_steps")},
    **{
        name: (0, True)
        for name in ("checkpoint_every", "warmup_steps", "save_every", "seed", "shard_group_size")
    },
    "weight_decay": (0, True),
    "grad_clip": (0, True),
    "lr": (0, False),
    "progress_every": (0, False),
    "timeout": (0, False),
}
_KIND_WORDS = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
    "list": "a list", "dict": "a table",
}  # fmt: skip


def _check_field(name: str, value: Any, annotation: str, default: Any) -> None:
    """One field's type, then its range or choices; a ValueError says which value is allowed."""
    optional = annotation.endswith("| None")
    kind = annotation.split("|")[0].strip()
    if value is None and optional:
        return
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        got_word = "a decimal number" if isinstance(value, float) else None
        got = "is " + (
            got_word or _KIND_WORDS.get(type(value).__name__, "a " + type(value).__name__)
        )
        hint = " (no quotes in TOML)" if isinstance(value, str) else ""
        if default is None:  # TOML has no None: an example of the kind, or leave it out
            example = {"int": "1", "float": "0.1", "str": '"..."', "bool": "true"}[kind]
            hint = " (or leave it out)"
        else:
            example = json.dumps(default)  # TOML's form: true, 0.1, "text"
        raise ValueError(
            f"{name} = {value!r} {got}; {name} must be {_KIND_WORDS[kind]}, "
            f"e.g. {name} = {example}{hint}"
        )
    if kind == "float" and not math.isfinite(value):
        raise ValueError(f"{name} = {value!r}: {name} must be a finite number")
    choices = TrainConfig.CHOICES.get(name)
    if choices is not None and value not in choices:
        names = ", ".join(map(str, choices))
        raise ValueError(f"{name} = {value!r} is not allowed; choose one of: {names}")
    if name in _MINIMUM:
        bound, inclusive = _MINIMUM[name]
        if value < bound or (value == bound and not inclusive):
            relation = ">=" if inclusive else ">"
            raise ValueError(f"{name} = {value!r}: {name} must be {relation} {bound:g}")
    if name == "seed" and value >= 2**64:
        raise ValueError(f"seed = {value}: torch takes seeds below 2**64; pick a smaller one")
    module_name, _, attr = value.partition(":") if name == "model" else ("", "", "")
    if module_name.endswith(".py"):  # (the import ran the file, then said "No module named
        # 'mymods.py'" with advice to put its folder on PYTHONPATH)
        file = Path(module_name)
        folder = file.parent if str(file.parent) != "." else "its folder"
        raise ValueError(
            f"model = {value!r}: name the module, not its file: --model {file.stem}:{attr} "
            f"({folder} on PYTHONPATH)"
        )
    if name == "model" and not _FACTORY.match(value):
        raise ValueError(
            f"model = {value!r}: expected 'package.module:factory' (a callable returning an "
            "nn.Module), e.g. --model mypkg.models:build"
        )
    names = ("wrap", "hf", "data", "tokenizer", "out_dir", "resume", "offload_folder")
    names += ("fp32_modules",)
    if name in names and not value.strip():
        raise ValueError(f"{name} = {value!r}: must not be empty")


@cache
def field_docs() -> dict[str, str]:
    """Each ``TrainConfig`` field's docstring (the string right below it), whitespace folded."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    docs = {}
    for node, after in zip(body, body[1:]):
        named = isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in names
        if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs
