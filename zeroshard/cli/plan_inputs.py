"""``zeroshard plan``'s flags read into the planner's inputs: the model description (a count,
a shape, a GPT preset, a Hugging Face config or a module factory, built on meta), the training
configuration (``memory.MemoryConfig``), and the checks against what the model allows (sequence
length, tensor-parallel heads and plan) that ``zeroshard train`` makes too."""

from __future__ import annotations

from zeroshard import planner
from zeroshard.cli import plan_flags as flags
from zeroshard.models.loading import import_factory
from zeroshard.planner import memory, units

# ---- reading the arguments -----------------------------------------------------------------


def describe_model(args) -> planner.ModelDescription:
    shape_flags = (args.layers, args.hidden, args.heads)
    sources = [s for s in ("preset", "hf", "module") if getattr(args, s)]
    if any(v is not None for v in shape_flags):
        sources.append("shape")
    if len(sources) > 1:
        raise ValueError(f"describe the model once; got {' and '.join(sources)}")
    for given, what in (
        (args.wrap is not None, "--wrap names the units"),
        (args.input_shape, "--input-shape gives the inputs"),
    ):
        if given and sources not in (["hf"], ["module"]):
            raise ValueError(f"{what} of a --module or --hf model; drop it")
    num_params = flags.opt(units.parse_count, args, "params") if args.params else None
    if not sources:
        if num_params is None:
            raise ValueError(
                "no model given; pass --params 7.5B, --preset NAME, --hf PATH, --module "
                "PKG.MOD:FACTORY, or a shape --layers/--hidden/--heads"
            )
        return planner.from_params(num_params)
    if num_params is not None and sources != ["shape"]:
        raise ValueError(f"--params overrides a shape's count only; drop it or --{sources[0]}")
    if sources == ["shape"]:
        missing = [f for f, v in zip(("--layers", "--hidden", "--heads"), shape_flags) if v is None]
        if missing:
            raise ValueError(f"a transformer shape needs {', '.join(missing)} too")
        for flag, v in zip(
            ("--layers", "--hidden", "--heads", "--vocab"), (*shape_flags, args.vocab)
        ):
            flags.check_positive(flag, v)
        return planner.from_transformer(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            vocab_size=args.vocab,
            max_seq_len=args.seq,
            num_params=num_params,
        )
    if args.preset:
        return planner.from_gpt(args.preset)
    wrap = None if args.wrap is None else [c.strip() for c in args.wrap.split(",") if c.strip()]
    if wrap == []:  # ("--wrap ," planned by _no_split_modules without a word)
        raise ValueError(
            f"--wrap {args.wrap!r} names no class; pass class names, e.g. --wrap Block"
        )
    inputs = _inputs(args.input_shape)
    if args.hf:
        return planner.from_hf_config(args.hf, wrap=wrap, inputs=inputs)
    model = planner.from_module(_import_factory(args.module), wrap=wrap, inputs=inputs)
    if model.num_trainable_params == 0:  # (planned with exit 0; zeroshard train refuses it)
        raise ValueError(
            f"--module {args.module}: no parameter is trainable (every one has "
            "requires_grad=False, or it has none): there is nothing to train; leave some "
            "parameters trainable"
        )
    return model


def _inputs(specs: list[str] | None) -> planner.Inputs | None:
    """``--input-shape`` values (``3x224x224``, or ``NAME=3x224x224`` for a keyword argument),
    as ``Inputs``."""
    if not specs:
        return None
    shapes, keywords = [], []
    for spec in specs:
        name, _, size = spec.rpartition("=")
        try:
            shape = tuple(int(d) for d in size.lower().split("x"))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1 or (name and not name.isidentifier()):
            raise ValueError(
                f"--input-shape {spec!r}: give one sample's shape as sizes joined by x, e.g. "
                "3x224x224, or NAME=3x224x224 for a keyword argument (pixel_values=3x224x224)"
            )
        if name in dict(keywords):
            raise ValueError(f"--input-shape gives {name} twice; give each input once")
        if name:
            keywords.append((name, shape))
        else:
            shapes.append(shape)
    return planner.Inputs(tuple(shapes), tuple(keywords))


def _import_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--module takes PKG.MOD:FACTORY, got {spec!r}")
    return import_factory(spec, named=f"--module {spec!r}")


# ---- the plan ------------------------------------------------------------------------------


def _shard_group_size(args, num_dp: int) -> int | None:
    """--shard-group-size checked against the data-parallel ranks (None: no hybrid sharding)."""
    k = args.shard_group_size
    if k is None or k == num_dp or k == 0:  # (0: every rank, as train's --shard-group-size 0)
        if args.inter_node_bandwidth is not None:
            raise ValueError(
                "--inter-node-bandwidth prices the all-reduce across shard groups; add "
                f"--shard-group-size K with K < {num_dp} dividing {num_dp}, or drop it"
            )
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(
            f"--shard-group-size must be 0 (every rank) or a divisor of the {num_dp} "
            f"data-parallel ranks, got {k!r}"
        )
    if k > num_dp or num_dp % k:
        why = "is larger than" if k > num_dp else "does not divide"
        divisors = ", ".join(str(d) for d in range(1, num_dp + 1) if num_dp % d == 0)
        raise ValueError(
            f"--shard-group-size {k} {why} the {num_dp} data-parallel ranks; use a divisor of "
            f"{num_dp} ({divisors})"
        )
    return k


def memory_config(
    args,
    *,
    micro_batch_size: int = 1,
    num_layers_per_checkpoint: int = 1,
    num_dp: int | None = None,
):
    """The training configuration the flags describe, at stage 0 (3 with --step-in-backward;
    each row replaces it), over ``num_dp`` data-parallel ranks (default --dp).
    ``num_layers_per_checkpoint`` 0: no activation checkpointing, counted as the engine runs
    (``calibrate.engine_config``'s buffers: in-flight reductions, the fused attention); so are
    checkpointed runs with ``--timeline``."""
    num_dp = num_dp or args.dp
    per_param, per_activation = flags.state_bytes(args)
    engine = {}
    if num_layers_per_checkpoint == 0 or getattr(args, "timeline", False):
        from zeroshard.engine import ShardConfig

        engine = dict(
            activation_checkpointing=num_layers_per_checkpoint > 0,
            engine_timeline=True,
            num_buckets=ShardConfig().max_inflight_reductions,
            flash_attention=True,
            reduce_stages_input=False,
            gradients_in_gather_buffers=args.device_type == "cpu",
            point_to_point_reductions=args.device_type == "cpu",
        )
        num_layers_per_checkpoint = max(1, num_layers_per_checkpoint)
    return memory.MemoryConfig(
        **engine,
        stage=3 if args.step_in_backward else 0,
        num_dp_ranks=num_dp,
        shard_group_size=_shard_group_size(args, num_dp),
        num_mp_ranks=args.mp,
        bytes_per_param=per_param,
        micro_batch_size=micro_batch_size,
        seq_len=args.seq,
        num_layers_per_checkpoint=num_layers_per_checkpoint,
        partition_activations=args.partition_activations,
        sequence_parallel=args.sequence_parallel,
        offload_activations=args.offload_activations,
        activation_bytes=per_activation,
        num_units_prefetch=args.prefetch,
        param_prefetch=args.param_prefetch,
        bucket_bytes=flags.opt(units.parse_bytes, args, "bucket"),
        step_in_backward=args.step_in_backward,
        grad_accum=args.grad_accum,
        accumulate_unreduced=args.accumulate_unreduced,
        fragmentation_fraction=flags.fraction("--fragmentation", args.fragmentation),
    )


def fit_to_model(args) -> None:
    """``--seq`` and ``--mp`` against what the model allows, as ``zeroshard train`` checks them: a
    preset's block size or a config's position table bounds the sequence (an unset ``--seq``
    becomes 1024 or that bound, the smaller), and a config's key/value heads must split in
    ``--mp`` as its query heads do."""
    limit, kv_heads, what = None, None, ""
    if args.preset:
        from zeroshard.models.gpt import preset

        limit, what = preset(args.preset).block_size, f"preset {args.preset!r}"
    elif args.hf:
        from zeroshard.models.loading import hf_context_len
        from zeroshard.planner import hf

        values = hf.config_values(hf.load_config(str(args.hf)))
        limit = hf_context_len(values)
        kv_heads, what = values.get("num_key_value_heads"), f"{args.hf}"
    if args.seq is None:
        args.seq = min(1024, limit) if limit else 1024
    elif limit is not None and args.seq > limit:
        raise ValueError(
            f"--seq {args.seq} exceeds the {limit} positions of {what}; pass --seq {limit} or less"
        )
    if isinstance(kv_heads, int) and args.mp > 1 and kv_heads % args.mp:
        raise ValueError(
            f"tensor parallelism splits attention by heads: {kv_heads} key/value heads of {what} "
            f"do not split in Nm = {args.mp}; use an --mp that divides {kv_heads}"
        )
    if args.mp > 1 or args.sequence_parallel:
        _check_tp_plan(args)


def _check_tp_plan(args) -> None:
    """A model built from ``--preset``/``--hf``/``--module`` must have the tensor-parallel plan
    ``zeroshard train --tp`` would split it by (built on meta: no memory)."""
    import torch

    from zeroshard.tensor_parallel import plan_for

    if args.preset:
        from zeroshard.models.gpt import GPT, preset

        with torch.device("meta"):
            module = GPT(preset(args.preset))
    elif args.hf:
        from zeroshard.planner import hf

        module = hf.build(hf.load_config(str(args.hf)))
    elif args.module:
        with torch.device("meta"):
            module = _import_factory(args.module)()
    else:
        return  # a count or a shape: the papers' Psi / Nm
    try:
        plan_for(module, max(args.mp, 2), sequence_parallel=args.sequence_parallel)
    except ValueError as exc:
        raise ValueError(f"--mp {args.mp}: {exc}") from None


def check_counts(args) -> None:
    """The training flags that count something are at least 1 (--seq when given)."""
    for flag in ("dp", "mp", "seq", "devices_per_node", "grad_accum"):
        flags.check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
