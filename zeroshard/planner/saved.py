"""What autograd saves, measured on the model itself: one forward and loss run on the meta device
(no memory, no data) under ``torch.autograd.graph.saved_tensors_hooks``, at the batch and
sequence length being planned.

Every tensor autograd saves from a forward to its backward is recorded once per storage (a tensor
saved twice, or views of one storage, count once, at the storage's full size); parameters and
their views are model states, not activations, and are left out. Each storage is charged to the
unit whose forward was running when it was first saved (the units the engine makes,
``zeroshard.wrap.units``); what the root saves is split by when: before each unit (embeddings,
an encoder's final norm between an encoder's and a decoder's units) and after the last (the head,
the loss). Backward frees them in the reverse order, which ``zeroshard.planner.timeline`` follows.

On meta, ``scaled_dot_product_attention`` would always take the math path (saving the attention
probabilities); the measurement asks the CPU's kernel choice for the same shapes and, where the
CPU takes its fused kernel, runs that kernel's meta version (saving one log-sum-exp per head).

The model runs in the activation dtype planned (fp32 for 4 bytes, bf16 for 2, fp64 for 8), so the
model's own upcasts (a loss on ``logits.float()``, fp32 norm statistics) are measured as they are.
All sizes are bytes.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
from dataclasses import dataclass, field

from zeroshard.planner import backward_peak, hf

DTYPES = {1: "bfloat16", 2: "bfloat16", 4: "float32", 8: "float64"}
"""The dtype the model runs in per ``activation_bytes`` (no float8 compute on meta: 1 runs in
bf16, an over-estimate)."""


@dataclass(frozen=True)
class CheckpointedForward:
    """The most bytes alive at once in a forward and loss whose units save nothing (as under
    activation checkpointing, where a span's checkpoint keeps only its input), parameters and
    buffers apart, per phase of the root's forward. The checkpoints themselves are not held: a
    unit's input counts only while the model's own code holds it (the span's first unit, as it
    runs). What a unit returns beside its output and the model's code keeps until the next unit
    returns (BLOOM's blocks return their attention probabilities, alive through the next block's
    forward, 25% of the peak at 2 x 512 tokens and 16 heads) counts, as the unit transients do."""

    before: int
    """In the root before its first unit call (embeddings)."""
    in_unit: tuple[int, ...]
    """Per unit in forward order, while it runs called from the root (any of its calls);
    0: never so called."""
    after_unit: tuple[int, ...]
    """Per unit in forward order, in the root after it returns and before the next unit call
    (after the last: the head and the loss); 0: never so called."""
    in_unit_kept: tuple[frozenset[int], ...]
    """Per unit in forward order: the units whose input (what a checkpoint keeps) was among
    ``in_unit``'s bytes, held by the model's own code (a list of every layer's output, as
    ``output_hidden_states`` keeps): a checkpoint of one of them adds no storage there."""
    after_unit_kept: tuple[frozenset[int], ...]
    """The same for ``after_unit``."""


@dataclass(frozen=True)
class Recomputation:
    """A unit's forward run again inside backward (activation checkpointing recomputes a span's
    units when backward reaches its last one), per unit in forward order, in bytes: what each
    unit's forward makes and holds beside the activations saved before it, and what the backward
    holds as it starts. Followed on meta in the measured forward (saves kept, as a
    recomputation keeps them) and backward, operator by operator (``backward_peak._Made``). A
    recomputation's own temporaries (a norm's FP32 copies in BF16, attention scores a model's
    code holds, an MLP's input to its activation) can top the unit's backward working set
    (unfollowed, BLOOM at ``--ci 2``, 4 x 64 tokens, FP32, was planned 5.7% under)."""

    made: tuple[int, ...]
    """The most bytes alive at once that the unit's forward made (its saves so far, its
    temporaries, its outputs; its input apart), any call of it."""
    made_saving: tuple[int, ...]
    """The same up to its last save: a recomputation stops there (torch's early stop), the
    span's last unit's."""
    passed: tuple[int, ...]
    """What the unit called before it from the root made and no one saved, alive as this one is
    called (its input, unless the previous unit saved it; outputs it returned beside it, T5's
    position bias): alive through its recomputation after that unit's."""
    gradients: tuple[int, ...]
    """What the backward made and holds (the gradients flowing into the unit) as its first node
    unpacks a saved tensor: the moment its span's recomputation runs."""


@dataclass(frozen=True)
class ExtraInput:
    """A tensor a unit is given beside its first input (a mask, a position bias, an encoder's
    output): under activation checkpointing the engine keeps it for the recomputation, so it
    lives until the backward of the span of the first unit given it (one storage, however many
    units it is given to)."""

    nbytes: int
    """Its storage's bytes."""
    given: tuple[tuple[int, bool], ...]
    """(unit in forward order, positional) for each unit called from the root with it: a span's
    first call saves its positional arguments as the span's inputs (copies, on the CPU, with
    ``offload_activations``); keyword ones, and the later calls' of a span, stay as they are."""
    saved_by: int | None = None
    """The unit (forward order) whose ``unit_bytes`` count its storage: the first to save it (a
    mask the attention saves for its backward); ``None``: no unit saves it. Under activation
    checkpointing that unit's recomputation saves the very storage the engine keeps: no second
    one (counted twice, Falcon with ALiBi was planned 27.6% over at 2 x 256 tokens)."""


@dataclass(frozen=True, kw_only=True)
class SavedActivations:
    """What one forward and loss of a micro-batch leave for backward, per unit, in bytes."""

    micro_batch_size: int
    """Samples in the measured forward."""
    seq_len: int
    """Tokens per sample in the measured forward (encoder and decoder alike)."""
    unit_bytes: tuple[int, ...]
    """Saved inside each unit other than the root, in forward order."""
    before_unit_bytes: tuple[int, ...]
    """Saved by the root after the previous unit and before each unit (the first: embeddings and
    token ids), in forward order; freed once backward has passed that unit."""
    tail_bytes: int
    """Saved by the root after the last unit: final norm, head, the loss's log-probabilities."""
    unit_input_bytes: tuple[int, ...]
    """Each unit's first tensor input: what a checkpoint keeps at a span's start, and the size of
    the residual stream's gradient flowing through the unit in backward."""
    largest_unit_tensor_bytes: tuple[int, ...]
    """Each unit's largest saved storage: the size of the largest intermediate gradient its
    backward holds beside the residual stream's."""
    largest_tail_tensor_bytes: int
    """The root's largest storage saved after the last unit (the loss's log-probabilities in a
    language model): the loss's backward holds two gradients of that size."""
    loss_input_bytes: int | None = None
    """FP32 bytes of the output the loss stand-in of a model fed ``Inputs`` is taken over
    (``_output_loss``): its two gradients, where the largest storage after the last unit may be
    another (a UNet's last convolution's input). ``None``: that largest storage."""
    unit_backward_bytes: tuple[int, ...] = ()
    """Per unit, in forward order: at the peak of its backward, the bytes alive beyond the
    activations saved up to it and by it (the gradients flowing through it and those its
    operators make, while their inputs are still saved), followed on meta
    (``zeroshard.planner.backward_peak``); a unit the backward does not cross counts its input's
    and its largest saved storage's sizes. With tensor parallelism, followed on a copy of the
    model holding one rank's pieces (``_split_unit_backward_bytes``). Empty: not followed (a
    backward that fails on meta)."""
    unit_backward_copied_bytes: tuple[int, ...] = ()
    """The same, with each parameter's gradient alive while the operator making it runs, as
    where the engine copies it into a persistent gradient bucket as soon as autograd has it
    (stages 0-1, and stage 2's buckets shared by units): a weight's gradient made beside the
    gradients flowing through may be the unit's peak (the other units' are in the buckets,
    counted as model states). Empty: not followed."""
    unit_backward_held_bytes: tuple[int, ...] = ()
    """The same, with each of the unit's own parameters' gradients alive from the operator making
    it on, as autograd holds them where the engine collects a unit's gradient at its
    post-backward (a bucket per unit: stage 3, and stage 2 once the model fills more than one
    bucket): those made up to each moment, not the largest one beside every moment (a mixture
    of experts' stacked weights' gradients, made after its peak, put OLMoE 5.5% over its peak
    with a checkpoint per block). Empty: not followed."""
    chained: tuple[bool, ...] = ()
    """Per unit, in forward order: whether its first positional input is the previous unit's
    first output, unchanged (a span of activation checkpointing goes on across it; T5's
    decoder, fed other tensors, starts one). Empty: every unit chained."""
    ran: tuple[bool, ...] = ()
    """Per unit, in forward order: whether its forward ran (one that did not is never gathered
    and makes no gradient). Empty: all."""
    calls: tuple[int, ...] = ()
    """Per unit, in forward order: how many times the root called it (ALBERT's one layer shared
    by every position: its ``unit_bytes`` are every call's, its ``unit_input_bytes`` one
    call's). Empty: once each."""
    called: tuple[int, ...] = ()
    """The units called from the root, in the order of their first calls (the forward order
    the engine records; ``describe.from_module`` orders the units by it)."""
    tail_param_numel: int
    """Elements of the root's parameters that autograd saves after the last unit (the final norm,
    the output projection, a tied embedding): their gradients exist from the head's backward
    and are held until the root unit's reduction at the end of backward."""
    tied_param_numel: int = 0
    """Of ``tail_param_numel``, the elements of parameters the graph uses more than once (a head
    tied to the input embedding): autograd holds the head's gradient until the embedding's
    backward adds its own, into a third tensor of that size (``timeline``'s root backward)."""
    forward_peak_bytes: int | None = None
    """The most bytes alive at once in the forward and loss, parameters and buffers apart:
    what is saved so far and what is not (the logits, an output kept by the model's own code,
    transformers' key cache), measured by torch's MemTracker on meta; ``None`` with tensor
    parallelism (whose pieces it does not follow)."""
    extra_inputs: tuple[ExtraInput, ...] = ()
    """What the units called from the root are given beside their first input (``ExtraInput``),
    model states, span inputs and what the root saves apart (counted as those)."""
    checkpointed_forward: CheckpointedForward | None = None
    """The forward and loss as they run under activation checkpointing (every unit's saves
    dropped): the most bytes alive at once per phase; ``None`` when not measured (no
    checkpointing planned, or tensor parallelism)."""
    recomputation: Recomputation | None = None
    """What each unit's recomputation inside backward holds beside its saves (``Recomputation``);
    ``None``: not followed (a backward that fails on meta)."""
    input_saved: tuple[bool, ...] = ()
    """Per unit, in forward order: whether its first input's storage (what a checkpoint of a
    span it opens keeps) is among what it saves, or what the root saves. Not where a norm in
    BF16 saves its FP32 copy alone (Llama's): the checkpoint is then a storage of its own in
    the span's backward (BF16 Llama at ``--ci 2``, 4 x 64 tokens, was planned 0.9% under).
    Empty: all are."""
    reached_params: frozenset[str] | None
    """Names (``named_parameters``') of the parameters the loss's graph reaches: only these get a
    gradient, so only these get optimizer states (``zeroshard.planner.stepped``). Fewer than the
    trainable ones in a decoder built without its encoder's input (BART's cross-attention in
    ``BartForCausalLM``) or with a head the loss skips. ``None``: not known (a custom
    ``autograd.Function`` in the graph), every trainable one counts."""

    @property
    def inner(self) -> tuple[bool, ...]:
        """Per unit, in forward order: whether it ran only inside another unit's forward (an
        attention unit in a block unit), or not at all (BART's cross-attention in a decoder
        built alone): not ``called``. Such a unit is recomputed with the unit around it and
        opens no span of its own."""
        return _not_called(self.called, len(self.unit_bytes))

    @property
    def loss_gradient_bytes(self) -> int:
        """The loss's backward: two gradients of the log-probabilities, or of the output a
        model fed ``Inputs`` takes its loss over."""
        if self.loss_input_bytes is not None:
            return 2 * self.loss_input_bytes
        return 2 * self.largest_tail_tensor_bytes

    @property
    def total_bytes(self) -> int:
        """Everything saved: the units', the root's before them and after them."""
        return sum(self.unit_bytes) + sum(self.before_unit_bytes) + self.tail_bytes


INTEGER_INPUTS = ("_ids", "labels", "_positions")
"""Endings of the keyword inputs made as integers (transformers' names: an encoder-decoder's
``decoder_input_ids`` beside its ``input_features``, labels, a question-answering head's
``start_positions``); the others are floating. (Masks are left out: transformers reads their
values, which meta tensors have not.)"""


@dataclass(frozen=True)
class Inputs:
    """The inputs of a model that takes no token ids alone (an image classifier's pixels, an
    audio model's features, with the decoder's ids of an encoder-decoder): each one sample's
    shape, the micro-batch's size put in front. Made on meta: in the activation dtype planned,
    keyword inputs named as integers by transformers (``INTEGER_INPUTS``) as int64."""

    shapes: tuple[tuple[int, ...], ...] = ()
    """Per positional argument, one sample's shape (``(3, 224, 224)`` for an image)."""
    keywords: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Keyword arguments, by name (a transformers model's ``pixel_values``)."""

    def __post_init__(self) -> None:
        shapes = tuple(self.shapes)
        if shapes and all(isinstance(d, int) for d in shapes):  # one input: Inputs((3, 224, 224))
            shapes = (shapes,)
        given = self.keywords
        keywords = tuple(given.items() if isinstance(given, dict) else given)
        names = [k[0] if isinstance(k, tuple) and len(k) == 2 else None for k in keywords]
        named = all(isinstance(n, str) and n.isidentifier() for n in names)
        if not named or len(set(names)) < len(names):
            raise ValueError(
                "Inputs' keywords are (name, shape) pairs with distinct names, e.g. "
                f"(('pixel_values', (3, 224, 224)),), got {self.keywords!r}"
            )
        object.__setattr__(self, "shapes", tuple(map(_shape, shapes)))
        object.__setattr__(self, "keywords", tuple((k, _shape(v)) for k, v in keywords))
        if not self.shapes and not self.keywords:
            raise ValueError("Inputs needs at least one input's shape")

    def make(self, micro_batch_size: int, dtype) -> tuple[tuple, dict]:
        """Positional and keyword arguments of ``micro_batch_size`` samples, on meta."""
        import torch

        def one(shape, kind=dtype):
            return torch.empty((micro_batch_size, *shape), dtype=kind, device="meta")

        def named(name, shape):
            return one(shape, torch.int64 if name.endswith(INTEGER_INPUTS) else dtype)

        return tuple(map(one, self.shapes)), {k: named(k, shape) for k, shape in self.keywords}

    def __str__(self) -> str:
        def size(shape):
            return "x".join(map(str, shape))

        return ", ".join([*map(size, self.shapes), *(f"{k}={size(v)}" for k, v in self.keywords)])


def _shape(value) -> tuple[int, ...]:
    """One sample's shape: positive whole sizes (a single size for a 1-D input)."""
    shape = (value,) if isinstance(value, int) else value
    if (
        not isinstance(shape, (tuple, list))
        or not shape
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)
    ):
        raise ValueError(
            f"an input's shape must be positive whole sizes, e.g. (3, 224, 224), got {value!r}"
        )
    return tuple(shape)


def hf_inputs(module) -> Inputs | None:
    """A transformers vision model's pixels (its ``main_input_name`` is ``pixel_values``), shaped
    by its config's (or its ``vision_config``'s) ``num_channels`` and ``image_size`` (3 and 224
    where it gives none: ResNet's); ``None`` for any other model."""
    config = getattr(module, "config", None)
    if getattr(module, "main_input_name", None) != "pixel_values" or config is None:
        return None
    config = getattr(config, "vision_config", None) or config
    size = getattr(config, "image_size", None)
    if size is None:  # (ResNet's config gives none)
        import warnings

        size = 224
        warnings.warn(
            f"{type(module).__name__}'s config gives no image_size: planned for 224 x 224 "
            "images; give the size trained at, e.g. --input-shape pixel_values=3x384x384 "
            "(inputs=Inputs(keywords={'pixel_values': (3, 384, 384)}))",
            stacklevel=3,
        )
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    channels = getattr(config, "num_channels", 3)
    return Inputs(keywords=(("pixel_values", (channels, height, width)),))


@dataclass(frozen=True, eq=False, kw_only=True)
class ActivationProfile:
    """Measures a built model's saved activations on demand (``at``), once per batch, sequence
    length and activation width; the model stays on the meta device and is never changed."""

    module: object
    """The model, on the meta device (an ``nn.Module``)."""
    unit_names: tuple[str, ...]
    """Submodule names of the units other than the root, as ``zeroshard.wrap.units`` finds
    them, in forward order."""
    vocab_size: int
    """Token ids are drawn below this."""
    call: str
    """How a batch goes in: ``"inputs"`` (``model(*args, **kwargs)`` on what ``inputs`` makes,
    the loss ``_output_loss``'s: a model that takes no token ids), ``"hf"``
    (``model(input_ids=x, labels=y).loss``), ``"hf_logits"``
    (``model(input_ids=x).logits``, the loss a cross-entropy over them: a head that does not
    take token labels, a sequence classifier's; a question-answering head's start and end
    logits; a multiple-choice head's, each row one choice; a backbone's hidden states without
    a head, ``_output_loss``'s), ``"xy"`` (``model(x, y)`` returns the loss) or
    ``"logits"`` (``model(x)`` returns the logits, as ``zeroshard train --model`` asks; the
    loss is ``zeroshard.train.next_token_loss``'s)."""
    largest_param_numel: int
    """Elements of the largest parameter a unit owns: its gradient is the largest one backward
    holds before it joins the unit's flat gradient."""
    inputs: Inputs | None = None
    """With ``call="inputs"``: makes a micro-batch (``Inputs``)."""
    _cache: dict = field(default_factory=dict, repr=False)

    def at(
        self,
        *,
        micro_batch_size: int,
        seq_len: int,
        activation_bytes: int = 4,
        num_mp_ranks: int = 1,
        checkpointing: bool = False,
    ) -> SavedActivations:
        """The saved activations of one forward and loss at ``micro_batch_size x seq_len`` tokens
        with ``activation_bytes`` per float element, per rank of ``num_mp_ranks`` tensor-parallel
        ranks (measured once, then remembered); with ``checkpointing``, as the engine runs it
        under activation checkpointing (Hugging Face models without their key/value cache)."""
        key = (micro_batch_size, seq_len, activation_bytes, num_mp_ranks, checkpointing)
        batch = (
            f"{micro_batch_size} samples of {self.inputs}"
            if self.inputs is not None
            else f"{micro_batch_size} x {seq_len} tokens"
        )
        return self._remembered(
            key,
            lambda: measure(
                self.module,
                self.unit_names,
                vocab_size=self.vocab_size,
                call=self.call,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                activation_bytes=activation_bytes,
                num_mp_ranks=num_mp_ranks,
                checkpointing=checkpointing,
                example=self.inputs,
            ),
            f"the forward at {batch} failed on meta",
        )

    def flops(self, *, micro_batch_size: int, seq_len: int, checkpointing: bool = False):
        """The ``flops.Flops`` of one micro-batch of ``micro_batch_size`` samples (of ``seq_len``
        tokens), counted once, then remembered; raises ``ValueError`` where the forward or
        backward fails on meta."""
        from zeroshard.planner import flops

        return self._remembered(
            ("flops", micro_batch_size, seq_len, checkpointing),
            lambda: flops.count(
                self,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                checkpointing=checkpointing,
            ),
            "counting FLOPs failed on meta",
        )

    def _remembered(self, key: tuple, compute, failed: str):
        """``compute()`` once per ``key``, then its result again; what it raised (the model's
        own error: a sequence it does not take) is remembered as a ``ValueError`` that begins
        with ``failed``, and raised each time."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as exc:
                first = (str(exc).splitlines() or [""])[0][:200]
                self._cache[key] = ValueError(f"{failed} ({type(exc).__name__}: {first})")
        found = self._cache[key]
        if isinstance(found, Exception):
            raise found
        return found

    def reached(self) -> frozenset[int] | None:
        """``id`` of each parameter of ``module`` the loss reaches, in the 1 x 8 token forward
        ``profile`` checked the model with (which ones does not depend on the batch); ``None``
        when that is not known."""
        names = self.at(micro_batch_size=1, seq_len=8).reached_params
        if names is None:
            return None
        return frozenset(id(p) for name, p in self.module.named_parameters() if name in names)

    def largest_param(self, num_mp_ranks: int = 1) -> int:
        """Elements of the largest parameter piece a unit holds on one of ``num_mp_ranks``
        tensor-parallel ranks (``largest_param_numel`` cut by the model's plan)."""
        if num_mp_ranks == 1:
            return self.largest_param_numel
        from zeroshard.tensor_parallel_plans import split_params

        cut = split_params(self.module)
        largest = 0
        for name in self.unit_names:
            for p in self.module.get_submodule(name).parameters():
                largest = max(largest, -(-p.numel() // num_mp_ranks) if id(p) in cut else p.numel())
        return largest


def at_config(model, config) -> SavedActivations | None:
    """``model.activations`` measured at ``config``'s micro-batch, sequence length and activation
    width (a ``ModelDescription`` and a ``MemoryConfig``); ``None`` without a profile or when the
    model's forward fails there (``problem`` says why)."""
    if model.activations is None:
        return None
    try:
        return model.activations.at(
            micro_batch_size=config.micro_batch_size,
            seq_len=config.seq_len,
            activation_bytes=config.activation_bytes,
            num_mp_ranks=config.num_mp_ranks,
            checkpointing=config.activation_checkpointing,
        )
    except ValueError:
        return None


def problem(model, config) -> str | None:
    """Why ``at_config`` gave ``None`` although the model has a profile (else ``None``)."""
    if model.activations is None:
        return None
    try:
        model.activations.at(
            micro_batch_size=config.micro_batch_size,
            seq_len=config.seq_len,
            activation_bytes=config.activation_bytes,
            num_mp_ranks=config.num_mp_ranks,
            checkpointing=config.activation_checkpointing,
        )
    except ValueError as exc:  # remembered by the profile: the forward does not run again
        return str(exc)
    return None


def profile(
    module, unit_names: tuple[str, ...], inputs: Inputs | None = None
) -> ActivationProfile | None:
    """An ``ActivationProfile`` for ``module`` fed ``inputs`` (``describe.from_module`` finds a
    transformers vision model's, ``hf_inputs``), else when a batch of token ids can be fed to it (a
    transformers model, ``model(x, y)`` returning a loss, or ``model(x)`` returning logits, as
    ``zeroshard train --model`` wants), checked by a forward of 1 sample (of 8 tokens) on meta;
    ``None`` when the model takes no token ids (no ``nn.Embedding``) and no inputs are known.
    Raises what the forward raised (``ValueError``) when no way of calling it works."""
    from torch import nn

    vocab_size = 0
    if inputs is None:
        embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if not embeddings:
            return None
        vocab_size = embeddings[0].num_embeddings
    units = [module.get_submodule(n) for n in unit_names]
    largest = max((p.numel() for u in units for p in u.parameters()), default=0)
    hf = ("hf", "hf_logits")
    calls = (*hf, "xy", "logits") if hasattr(module, "config") else ("xy", "logits", *hf)
    problems = []
    for call in ("inputs",) if inputs is not None else calls:
        found = ActivationProfile(
            module=module,
            unit_names=unit_names,
            vocab_size=vocab_size,
            call=call,
            largest_param_numel=largest,
            inputs=inputs,
        )
        try:
            found.at(micro_batch_size=1, seq_len=8)
        except ValueError as exc:  # ``at`` gives whatever the model raised as a ValueError
            problems.append(f"{call}: {exc}")
            continue
        return found
    if inputs is not None:
        raise ValueError(problems[0].removeprefix("inputs: "))
    raise ValueError("no way of calling the model with token ids worked: " + "; ".join(problems))


def _not_called(called, num_units: int) -> tuple[bool, ...]:
    """Per unit, whether it is not among ``called`` (the units called from the root)."""
    return tuple(i not in called for i in range(num_units))


def measure(
    module,
    unit_names: tuple[str, ...],
    *,
    vocab_size: int,
    call: str,
    micro_batch_size: int,
    seq_len: int,
    activation_bytes: int = 4,
    num_mp_ranks: int = 1,
    track: bool = True,
    checkpointing: bool = False,
    example: Inputs | None = None,
) -> SavedActivations:
    """Run one forward and loss of ``module`` (a copy, on meta, in the dtype of
    ``activation_bytes``) on ``micro_batch_size x seq_len`` random token ids (with
    ``call="inputs"``: ``micro_batch_size`` samples ``example`` makes), and sort what
    autograd saves by unit (module docstring); with ``num_mp_ranks`` > 1, what tensor
    parallelism splits counts 1/Nm (``_TensorParallelSplit``). ``track``: the forward's own
    peak measured by torch's MemTracker (``forward_peak_bytes``), where it can be.
    ``checkpointing``: as the engine runs under activation checkpointing, Hugging Face models
    without their key/value cache (``train_without_caches``: GPT-NeoX's value then stays a
    view of its fused projection, which the attention saves whole)."""
    import torch

    from zeroshard.residual_states.activations import train_without_caches
    from zeroshard.trees import tensors_in

    again = dict(  # (the measurement's arguments, for another run of it)
        vocab_size=vocab_size,
        call=call,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        activation_bytes=activation_bytes,
        checkpointing=checkpointing,
        example=example,
    )

    dtype = getattr(torch, DTYPES[activation_bytes])
    model = copy.deepcopy(module).to(device="meta", dtype=dtype)
    model.train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    # Buffers are counted as such, not where a unit saves them (or a view of them: GPT-Neo's
    # causal mask, sliced in every layer, was counted whole once per layer).
    buffers = {b.untyped_storage()._cdata for b in model.buffers()} - params
    units = [model.get_submodule(n) for n in unit_names]
    num_units = len(units)
    # The unit running, or -1 - k for the root after k units (a unit nested in another unit
    # returns the charge to its parent).
    where, stack = [-1], []
    inputs = [0] * num_units
    # storage -> (where, bytes, the tensor kept alive, the root's calls before it)
    saved: dict[int, tuple[int, int, object, int]] = {}
    root_params: dict[int, tuple[int, int]] = {}  # parameter storage -> (calls before, elements)

    split = _TensorParallelSplit(model, num_mp_ranks, params)

    chained = [False] * num_units
    # Storages of the units' first inputs, and of what they are given beside: (bytes, {unit:
    # positional}); by ``ident`` (not kept alive: that would change the forward's peak).
    firsts: set[tuple[int, int]] = set()
    first_inputs: dict[int, tuple[int, int]] = {}  # unit -> its first call's first input
    extras: dict[tuple[int, int], tuple[int, dict[int, bool]]] = {}
    ident = _StorageIdents()
    sequence: list[int] = []  # the units the root calls, call by call
    ran = [False] * num_units
    last_output: list = [None, 0]  # the previous unit's first output, and its version
    # (tensor parallelism's pieces: followed in backward on a model split as a rank holds it,
    # ``_split_unit_backward_bytes``, not here)
    follow = num_mp_ranks == 1
    owners, saves = backward_peak.Owners(), backward_peak.SaveCounts()
    # Each unit's forward as its recomputation runs it (``Recomputation``), followed per unit
    # called from the root: the most bytes made since its call alive at once (``made``), the
    # same up to each save (``upto``, read at its last), the previous call's serials.
    fwd_made, fwd_upto, fwd_passed = [0] * num_units, [0] * num_units, [0] * num_units
    running_unit: list = [None, 0]  # the unit called from the root running, its most so far
    last_call = [0, 0]  # the serials the previous call from the root made: [start, end)

    def forward_moment(_new) -> None:
        i = running_unit[0]
        if i is not None:
            running_unit[1] = max(running_unit[1], followed.since)
            fwd_made[i] = max(fwd_made[i], running_unit[1])

    followed = backward_peak._Made(forward_moment)
    followed.nodes_running = 1  # (every operator's end is a moment)

    def enter(i: int, args, kwargs):
        stack.append(where[0])
        if where[0] < 0 and args:  # (as the engine joins a span: ``activations.enter``)
            out, version = last_output
            chained[i] = args[0] is out and out is not None and out._version == version
        if where[0] < 0:
            sequence.append(i)
        ran[i] = True
        where[0] = i
        if follow:
            owners.now(i)
        first = _first_input(args, kwargs)
        if first is not None and not inputs[i]:
            inputs[i] = split.nbytes(first, first.numel() * first.element_size())
        if where[0] == i and stack[-1] < 0:  # called from the root
            if followed.following:  # (what the previous call left unsaved)
                start, end = last_call
                left = followed.made_between(start, end)
                passed = sum(st.nbytes() for st in left if st._cdata not in saved)
                fwd_passed[i] = max(fwd_passed[i], passed)
                last_call[0] = followed.next_serial
                followed.mark()
                running_unit[:] = [i, 0]
            if first is not None:
                key = ident(first)
                firsts.add(key)
                first_inputs.setdefault(i, key)
            rest = [(t, True) for t in tensors_in(args)] + [(t, False) for t in tensors_in(kwargs)]
            for t, positional in rest:
                if t is not first:
                    size = split.nbytes(t, t.untyped_storage().nbytes())
                    extras.setdefault(ident(t), (size, {}))[1].setdefault(i, positional)
        return _hooked_as_the_engine(args, kwargs) if own_params[i] else None

    def leave(i: int, output) -> None:
        where[0] = stack.pop()
        if where[0] < 0 and running_unit[0] == i:
            last_call[1] = followed.next_serial if followed.following else 0
            running_unit[:] = [None, 0]
        if where[0] < 0:
            where[0] = -2 - i  # the root, after unit i
            first = tensors_in(output)
            last_output[:] = [first[0], first[0]._version] if first else [None, 0]
        if follow:
            owners.now(where[0])

    # Whether each unit has parameters of its own (beside those of units inside it): the
    # engine passes such a unit's inputs through its backward hook (``_hooked_as_the_engine``).
    inside = [{id(p) for v in units if v is not u and _contains(u, v) for p in v.parameters()}
              for u in units]  # fmt: skip
    own_params = [any(id(p) not in n for p in u.parameters()) for u, n in zip(units, inside)]
    handles = train_without_caches(model) if checkpointing else []
    for i, unit in enumerate(units):
        handles.append(
            unit.register_forward_pre_hook(lambda m, a, kw, i=i: enter(i, a, kw), with_kwargs=True)
        )
        handles.append(unit.register_forward_hook(lambda m, a, o, i=i: leave(i, o)))

    def pack(t):
        storage = t.untyped_storage()
        key = storage._cdata  # the StorageImpl: distinct per storage, on meta too
        if key in params:
            if where[0] < 0:  # (those saved after the last unit are the head's: ``_tail``)
                root_params.setdefault(key, (len(sequence), storage.nbytes() // t.element_size()))
        elif key not in buffers:
            if key not in saved:
                saved[key] = (where[0], split.nbytes(t, storage.nbytes()), t, len(sequence))
            saves.saved(key, storage.nbytes())
        if running_unit[0] is not None:  # (every save counts toward torch's early stop)
            now = max(running_unit[1], followed.since)
            fwd_upto[running_unit[0]] = max(fwd_upto[running_unit[0]], now)
        return t

    def unpack(t):
        saves.unpacked(_key(t))
        return t

    x, y = batch(call, example, vocab_size, micro_batch_size, seq_len, dtype)
    seen: list[int] = []  # the loss stand-in's input, elements (``_output_loss``)
    tracked = track and num_mp_ranks == 1
    tracking = _forward_tracker(model) if tracked else contextlib.nullcontext()
    if follow:
        owners.now(-1)
    failed = None
    try:
        with (
            on_meta(),
            split,
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
            tracking as tracker,
            followed.mode() if follow else contextlib.nullcontext(),
        ):
            loss = loss_of(model, call, x, y, vocab_size, seen)
    except Exception as exc:
        failed = exc
    finally:
        for h in handles + split.handles:
            h.remove()
    if failed is not None:
        own = _own_error(model, call, x, y, vocab_size)
        if own is None and tracked:  # MemTracker's own failure (a model nothing of which
            # trains: its hooks on outputs that need no gradient raise); measured without it
            return measure(module, unit_names, num_mp_ranks=num_mp_ranks, track=False, **again)
        raise (own or failed) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"the forward returned {type(loss).__name__}, not a scalar loss")
    uses = _uses(loss)  # id(parameter) -> the graph's edges into its AccumulateGrad
    edges = uses if uses is not None else _uses(loss, partial=True)
    reused = {p.untyped_storage()._cdata for p in model.parameters() if edges.get(id(p), 0) > 1}
    counted = params | buffers | {key for key, (w, *_) in saved.items() if w < 0}  # (alive)

    def saver(key: int, generation: int) -> int | None:
        """The unit whose saves count the storage (``key``, ``generation``), if one does (a
        saved storage is kept alive by ``saved``: the one at ``key`` now)."""
        if key in saved and saved[key][0] >= 0 and ident.alive(key, generation):
            return saved[key][0]
        return None

    extra_inputs = tuple(
        ExtraInput(size, tuple(given.items()), saver(key, generation))
        for (key, generation), (size, given) in extras.items()
        if (key, generation) not in firsts
        and not (key in counted and ident.alive(key, generation))
        and size
    )
    forward = (
        _checkpointed_forward(model, units, call, x, y, vocab_size)
        if checkpointing and tracked
        else None
    )
    unit_bytes, largest = [0] * num_units, [0] * num_units
    before, tail, tail_largest = [0] * num_units, 0, 0

    def next_call(k: int) -> int | None:
        """The unit the root calls after its first ``k`` calls; ``None`` after its last (the
        head, wherever its unit is registered: a forward may end on its first unit)."""
        return sequence[k] if k < len(sequence) else None

    for w, num_bytes, _, k in saved.values():
        if w >= 0:
            unit_bytes[w] += num_bytes
            largest[w] = max(largest[w], num_bytes)
        elif next_call(k) is not None:  # the root before the first unit, or between two
            before[next_call(k)] += num_bytes
        else:
            tail += num_bytes
            tail_largest = max(tail_largest, num_bytes)
    tail_params = {key: n for key, (k, n) in root_params.items() if next_call(k) is None}
    counted = collections.Counter(sequence)  # (a count per unit was units x calls)
    calls = [counted[i] for i in range(num_units)]
    # Each unit's own parameters (not those of a unit inside it): whose gradients it holds.
    param_owners = {
        id(p): i for i, u in enumerate(units) for p in u.parameters() if id(p) not in inside[i]
    }
    first_unpacked: dict[int, int] = {}
    working, copied, held = _unit_backward_bytes(
        loss if follow else None, saves, owners, unit_bytes, before, inputs, largest, calls,
        param_owners, first_unpacked,
    )  # fmt: skip
    recomputation = None
    if working:
        recomputation = Recomputation(
            made=tuple(fwd_made),
            made_saving=tuple(fwd_upto),
            passed=tuple(fwd_passed),
            gradients=tuple(first_unpacked.get(i, 0) for i in range(num_units)),
        )
    if not follow:  # (the pieces one rank holds, followed on a model split as the ranks hold it)
        working, copied, held, recomputation = _split_unit_backward_bytes(
            module, unit_names, num_mp_ranks=num_mp_ranks, **again
        )

    def input_saved(i: int) -> bool:
        """Whether unit ``i``'s first input is among its own saves (a unit inside it's too:
        BertAttention's q/k/v Linears save BertLayer's input) or the root's."""
        if i not in first_inputs:
            return True  # (no tensor input, or never called from the root: nothing kept)
        key, generation = first_inputs[i]
        if key not in saved or not ident.alive(key, generation):
            return False
        saver = saved[key][0]
        return saver < 0 or saver == i or _contains(units[i], units[saver])

    return SavedActivations(
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        unit_bytes=tuple(unit_bytes),
        before_unit_bytes=tuple(before),
        tail_bytes=tail,
        unit_input_bytes=tuple(inputs),
        largest_unit_tensor_bytes=tuple(largest),
        largest_tail_tensor_bytes=tail_largest,
        loss_input_bytes=4 * seen[0] if seen else None,
        unit_backward_bytes=working,
        unit_backward_copied_bytes=copied,
        unit_backward_held_bytes=held,
        chained=tuple(chained),
        calls=tuple(calls),
        ran=tuple(ran),
        called=tuple(dict.fromkeys(sequence)),
        tail_param_numel=sum(tail_params.values()),
        tied_param_numel=sum(n for key, n in tail_params.items() if key in reused),
        forward_peak_bytes=None if tracker is None else _peak_besides_model(tracker),
        checkpointed_forward=forward,
        recomputation=recomputation,
        input_saved=tuple(input_saved(i) for i in range(num_units)),
        extra_inputs=extra_inputs,
        reached_params=(
            None
            if uses is None
            else frozenset(name for name, p in model.named_parameters() if id(p) in uses)
        ),  # fmt: skip
    )


def _split_unit_backward_bytes(
    module, unit_names: tuple[str, ...], *, num_mp_ranks: int, **kwargs
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], Recomputation | None]:
    """``SavedActivations.unit_backward_bytes`` (``unit_backward_copied_bytes``,
    ``unit_backward_held_bytes``) with tensor parallelism: each unit's backward followed on meta
    (``measure`` of one rank) on a copy of ``module`` whose planned Linears hold one rank's
    piece (``_split_locally``), so that its operators make and hold what one rank's do: the
    gradients of the split tensors 1/Nm, those of the whole ones (the residual stream, the
    norms' inputs and outputs, a gathered output) whole. Empty where that copy's
    forward or backward fails on meta (each unit's input's and largest saved tensor's sizes
    then stand in). (Before: always that stand-in, which missed the whole gradients a unit's
    backward holds beside its input's: Gemma3's sandwich norms, OLMo2's gathered q and k;
    Gemma3 at tp 2, 4 x 64 tokens, checkpoint_every=1 was planned 3.8% under its peak.)"""
    import warnings

    import torch

    dtype = getattr(torch, DTYPES[kwargs.get("activation_bytes", 4)])
    try:
        local = copy.deepcopy(module).to(device="meta", dtype=dtype)
        _split_locally(local, num_mp_ranks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = measure(local, unit_names, num_mp_ranks=1, track=False, **kwargs)
    except Exception:
        return (), (), (), None
    if len(found.unit_backward_bytes) != len(unit_names):
        return (), (), (), None
    return (
        found.unit_backward_bytes,
        found.unit_backward_copied_bytes,
        found.unit_backward_held_bytes,
        found.recomputation,
    )


def _split_locally(model, num_mp_ranks: int) -> None:
    """Make ``model`` (on meta) hold one of ``num_mp_ranks`` tensor-parallel ranks' pieces, as
    ``zeroshard.tensor_parallel.parallelize`` leaves each rank's: every Linear its plan splits
    (``tensor_parallel_plans.styles``) keeps 1/Nm of its output features (colwise, and its
    bias) or of its input features (rowwise); a ``colwise_gather_output`` one's output is made
    whole again (an all-gather: a new tensor), a ``rowwise_split_input`` one takes a copy of its
    rank's slice of its whole input. The model's own code then runs on the local widths
    (heads by ``view(B, T, -1, head_dim)``), as on each rank."""
    import torch
    from torch import nn

    from zeroshard.tensor_parallel_plans import GRAD_SUM, styles

    def piece(t, dim: int):
        shape = list(t.shape)
        shape[dim] //= num_mp_ranks
        return nn.Parameter(
            torch.empty(shape, dtype=t.dtype, device=t.device), requires_grad=t.requires_grad
        )

    def gather(module, args, output):
        return torch.cat([output] * num_mp_ranks, dim=-1)

    def slice_input(module, args):
        x = args[0]
        return (x.narrow(-1, 0, x.shape[-1] // num_mp_ranks).contiguous(), *args[1:])

    for name, style in styles(model).items():
        if style == GRAD_SUM:
            continue
        module = model.get_submodule(name)
        if style.startswith("colwise"):
            module.weight = piece(module.weight, 0)
            if getattr(module, "bias", None) is not None:
                module.bias = piece(module.bias, 0)
            if hasattr(module, "out_features"):
                module.out_features //= num_mp_ranks
            if style == "colwise_gather_output":
                module.register_forward_hook(gather)
        else:
            module.weight = piece(module.weight, 1)
            if hasattr(module, "in_features"):
                module.in_features //= num_mp_ranks
            if style == "rowwise_split_input":
                module.register_forward_pre_hook(slice_input)


def _checkpointed_forward(
    model, units, call: str, x, y, vocab_size: int
) -> CheckpointedForward | None:
    """Run ``model``'s forward and loss again (on meta, ``x``, ``y``) with every save made inside
    ``units`` dropped, as their checkpoints drop them, and follow the bytes alive operator by
    operator (``backward_peak._Made``: each new storage until it is freed); see
    ``CheckpointedForward``. ``None``, with a warning, where that forward fails."""
    import torch

    from zeroshard.residual_states.activations import train_without_caches

    num_units = len(units)
    phase, depth = ["before"], [0]
    most: dict[object, int] = {}
    inputs: dict[int, int] = {}  # unit -> its first tensor input's storage (its last root call's)
    kept: dict[object, frozenset[int]] = {}

    def enter(i: int, args: tuple, kwargs: dict) -> None:
        if depth[0] == 0:
            phase[0] = ("in", i)
            first = _first_input(args, kwargs)
            serial = made.serial(first) if first is not None else None
            if serial is not None:
                inputs[i] = serial
        depth[0] += 1

    def leave(i: int) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            phase[0] = ("after", i)

    def moment(_new) -> None:
        if made.total > most.get(phase[0], -1):
            most[phase[0]] = made.total
            kept[phase[0]] = frozenset(i for i, s in inputs.items() if s in made.alive)

    made = backward_peak._Made(moment)
    made.nodes_running = 1  # (every operator's end is a moment)
    handles = train_without_caches(model)
    for i, unit in enumerate(units):
        handles.append(
            unit.register_forward_pre_hook(lambda m, a, kw, i=i: enter(i, a, kw), with_kwargs=True)
        )
        handles.append(unit.register_forward_hook(lambda m, a, o, i=i: leave(i)))

    def pack(t):
        return t if depth[0] == 0 else None  # (no backward runs: nothing is unpacked)

    try:
        with (
            on_meta(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            made.mode(),
        ):
            loss_of(model, call, x, y, vocab_size)
    except Exception as exc:  # (the same forward ran once already: not expected)
        import warnings

        first = (str(exc).splitlines() or [""])[0][:160]
        warnings.warn(
            f"the forward under checkpoints could not be followed on meta ({type(exc).__name__}: "
            f"{first}): its peak is taken as the checkpoints' and the loss's",
            stacklevel=2,
        )
        return None
    finally:
        for h in handles:
            h.remove()
    return CheckpointedForward(
        before=most.get("before", 0),
        in_unit=tuple(most.get(("in", i), 0) for i in range(num_units)),
        after_unit=tuple(most.get(("after", i), 0) for i in range(num_units)),
        in_unit_kept=tuple(kept.get(("in", i), frozenset()) for i in range(num_units)),
        after_unit_kept=tuple(kept.get(("after", i), frozenset()) for i in range(num_units)),
    )


def _own_error(model, call: str, x, y, vocab_size: int) -> Exception | None:
    """What the forward raises without the measurement's hooks and tracker (``None``: nothing):
    the model's own error. (A hook of torch's MemTracker, run as a failed forward unwinds, put
    "cannot register a hook on a tensor that doesn't require gradient" in place of Whisper's own
    error, fed token ids instead of audio features.)"""
    try:
        with _on_meta():
            loss_of(model, call, x, y, vocab_size)
    except Exception as exc:
        return exc
    return None


def _unit_backward_bytes(
    loss,
    saves,
    owners,
    unit_bytes: list,
    before: list,
    inputs: list,
    largest: list,
    calls: list,
    param_owners: dict[int, int] | None = None,
    first_unpacked: dict[int, int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``SavedActivations.unit_backward_bytes``, ``unit_backward_copied_bytes`` and
    ``unit_backward_held_bytes`` (``param_owners``: ``id`` of each unit's own parameter -> the
    unit): ``loss``'s backward followed on meta (``None`` or a backward that fails there:
    empty). A unit called more than once counts at most what its backward made alone: units
    whose calls take turns (ALBERT's two layers) have other units' saves alive at their peak,
    which the plan's order does not count up to them (their working set was 5 calls of the
    other layer, 3x the measured peak under checkpointing)."""
    if loss is None:
        return (), (), ()
    try:
        with _on_meta():
            found, made, with_grads, holding = backward_peak.peaks(
                loss, saves, owners, param_owners, first_unpacked
            )
    except Exception as exc:  # an operator without a meta backward: the sizes' estimate stands
        import warnings

        first = (str(exc).splitlines() or [""])[0][:160]
        warnings.warn(
            f"the backward could not be followed on meta ({type(exc).__name__}: {first}): each "
            "unit's backward working set is taken as its input's gradient and one of its "
            "largest saved tensor's size",
            stacklevel=2,
        )
        return (), (), ()
    working, copied, held, through = [], [], [], 0
    for i, (own, root) in enumerate(zip(unit_bytes, before)):
        through += own + root  # saved up to and by unit i, alive as its backward starts
        if i not in found:
            working.append(inputs[i] + largest[i])
            copied.append(working[-1])
            held.append(working[-1])
            continue
        beyond = found[i] - through
        if calls[i] > 1:  # (its calls may take turns with other units')
            beyond = min(beyond, made[i])
        working.append(max(0, beyond))
        copied.append(working[-1] + with_grads[i] - found[i])
        held.append(working[-1] + holding[i] - found[i])
    return tuple(working), tuple(copied), tuple(held)


def batch(
    call: str, example: Inputs | None, vocab_size: int, micro_batch_size: int, seq_len: int, dtype
):
    """What ``loss_of`` feeds a model called the ``call`` way: ``micro_batch_size`` samples
    ``example`` makes (``"inputs"``; no targets), else token ids and targets below
    ``vocab_size``, ``micro_batch_size x seq_len``; on meta."""
    import torch

    if call == "inputs":
        return example.make(micro_batch_size, dtype), None
    shape = (micro_batch_size, seq_len)
    x = torch.randint(0, vocab_size, shape, device="meta")
    return x, torch.randint(0, vocab_size, shape, device="meta")


@contextlib.contextmanager
def on_meta():
    """A forward and backward of the planner's batches on meta (``_on_meta``, and no packed
    sequences looked for)."""
    with _on_meta(), _unpacked_sequences():
        yield


@contextlib.contextmanager
def _on_meta():
    """What any run of the model on meta needs: transformers quiet, the CPU's attention kernel,
    grouped matmuls of any dtype (``measure`` adds its hooks and the packed-sequence check)."""
    with hf.quiet_transformers(), _cpu_attention_choice(), _meta_grouped_mm():
        yield


@contextlib.contextmanager
def _forward_tracker(model):
    """torch's MemTracker over ``model`` (on meta: it counts storages, not memory). Its module
    tracker warns that "the module hierarchy tracking maybe be messed up" beside the planner's
    own hooks: the peak, counted per storage, does not depend on it."""
    import warnings

    tracker = _global_peak_tracker()
    tracker.track_external(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        # (a forward that raises: its own error is the one said, ``_own_error``)
        warnings.filterwarnings("ignore", message="global module forward hook with")
        with tracker:
            yield tracker


def _global_peak_tracker():
    """torch's MemTracker keeping the peak of the whole process only, which is all the planner
    reads: its own updates every module's peak seen so far at every operator (ops x modules:
    planning 1,000 small blocks took 148 s of CPU, 96 Llama layers 57 s, explorer)."""
    from torch.distributed._tools import mem_tracker

    class GlobalPeak(mem_tracker.MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return GlobalPeak()


def _peak_besides_model(tracker) -> int:
    """The tracker's peak bytes on meta, the model's parameters and buffers apart."""
    import torch
    from torch.distributed._tools.mem_tracker import _MemRefType

    peak = tracker.get_tracker_snapshot("peak").get(torch.device("meta"), {})
    return peak.get("Total", 0) - peak.get(_MemRefType.PARAM, 0) - peak.get(_MemRefType.BUFFER, 0)


def _engine_hook(node) -> bool:
    """Whether ``node`` is the engine's identity on a unit's inputs (``_hooked_as_the_engine``):
    its backward passes its gradients on, to the edges it has."""
    from zeroshard.autograd_hooks import BackwardHook

    return getattr(node, "_forward_cls", None) is BackwardHook


def _uses(loss, partial: bool = False) -> dict[int, int] | None:
    """``id`` of each leaf requiring grad (parameter) that ``loss``'s autograd graph ends in (the
    variables of its ``AccumulateGrad`` nodes) -> how many edges lead to it (its uses); ``None``
    when the graph holds a custom ``autograd.Function``, whose backward may reach parameters
    with no edge to them (a reentrant checkpoint recomputes its block's forward). ``partial``:
    the edges there are all the same (fewer than the uses, never more: BLOOM's GeLU
    ``Function`` hid its head's use of the tied embedding, whose gradient autograd holds until
    the embedding's backward adds to it)."""
    import torch

    seen, edges, found, todo = set(), {}, {}, [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        edges[node] = edges.get(node, 0) + 1
        if node in seen:
            continue
        custom = isinstance(node, torch.autograd.function.BackwardCFunction)
        if custom and not partial and not _engine_hook(node):
            return None
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            found[node] = id(variable)
        todo.extend(n for n, _ in node.next_functions)
    return {found[node]: edges[node] for node in found}


class _TensorParallelSplit:
    """Which tensors of a forward tensor parallelism splits across ``num_mp_ranks`` ranks, so
    that each rank holds 1/Nm of them: a colwise Linear's output (``tensor_parallel_plans.styles``),
    everything computed from a split tensor (a dispatch mode follows every operator: the heads,
    the attention, the activation function), up to a rowwise Linear's output, which is whole.
    Tracked per storage; the split tensors are kept alive, so that a storage freed and made again
    at the same address is not taken for one. Nothing is split with one rank, or without a
    plan."""

    def __init__(self, model, num_mp_ranks: int, params: set[int]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from zeroshard.tensor_parallel_plans import GRAD_SUM, styles

        self.num_mp_ranks, self.params, self.handles = num_mp_ranks, params, []
        self.split: dict[int, object] = {}  # storage -> a tensor on it, kept alive
        self.mode = contextlib.nullcontext()
        if num_mp_ranks == 1:
            return
        for name, style in styles(model).items():
            if style == GRAD_SUM:
                continue  # (splits nothing: a per-head norm's output is as split as its input)
            module = model.get_submodule(name)
            hook = self._mark if style == "colwise" else self._unmark
            self.handles.append(module.register_forward_hook(hook))
            if style == "rowwise_split_input":
                self.handles.append(module.register_forward_pre_hook(self._slice))
        tracker = self

        class Spread(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if any(tracker.is_split(t) for t in _tensors((args, kwargs))):
                    for t in _tensors(out):
                        tracker.split[_key(t)] = t
                return out

        self.mode = Spread()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def is_split(self, t) -> bool:
        key = _key(t)
        return key in self.split and key not in self.params

    def nbytes(self, t, num_bytes: int) -> int:
        """``num_bytes`` of ``t``'s storage as one rank holds it."""
        return -(-num_bytes // self.num_mp_ranks) if self.is_split(t) else num_bytes

    def _mark(self, module, args, output) -> None:
        for t in _tensors(output):
            self.split[_key(t)] = t

    def _unmark(self, module, args, output) -> None:
        for t in _tensors(output):
            self.split.pop(_key(t), None)

    def _slice(self, module, args):
        """A ``rowwise_split_input`` Linear takes its rank's slice of a whole input as a copy
        of its own (DTensor's contiguous shard), which is what it saves: the copy made here,
        1/Nm; the whole input stays counted only where something else keeps it."""
        if not args or not hasattr(args[0], "clone"):
            return None
        piece = args[0].clone()
        self.split[_key(piece)] = piece
        return (piece, *args[1:])


class _StorageIdents:
    """Names for storages that a later one at the same address does not take: (the
    ``StorageImpl``'s address, how many storages there were freed before it)."""

    def __init__(self) -> None:
        self._freed: dict[int, int] = {}
        self._watched: set[int] = set()

    def __call__(self, t) -> tuple[int, int]:
        import weakref

        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(storage, self._free, key)
        return key, self._freed.get(key, 0)

    def _free(self, key: int) -> None:
        self._freed[key] = self._freed.get(key, 0) + 1
        self._watched.discard(key)

    def alive(self, key: int, generation: int) -> bool:
        """Whether the storage named (``key``, ``generation``) is the one at ``key`` now."""
        return self._freed.get(key, 0) == generation


def _contains(module, other) -> bool:
    """Whether ``other`` is a submodule of ``module`` (itself apart)."""
    return any(m is other for m in module.modules() if m is not module)


def _hooked_as_the_engine(args: tuple, kwargs: dict):
    """A unit call's arguments as the engine passes them on (``Engine._pre_forward``): its
    positional tensors that need a gradient through one identity node whose backward reports
    the unit's backward done (``autograd_hooks.on_backward``), else, if none does, its keyword
    ones; ``None`` when no tensor needs one. That node runs once every gradient of its inputs
    is in, so it holds those that come early: a tensor given to every unit beside its input
    (a learned gate the root makes, T5's position bias) gets its gradient at the unit's first
    use of it in backward, held there beside the sum of the later units' until the unit's
    backward is done (without the node, 4 blocks at --ci 1 were planned 3.5% low)."""
    from zeroshard.autograd_hooks import on_backward

    def nothing() -> None:
        return None

    hooked_args, hooked = on_backward(nothing, args)
    if hooked:
        return hooked_args, kwargs
    (hooked_args, hooked_kwargs), hooked = on_backward(nothing, (args, kwargs))
    return (hooked_args, hooked_kwargs) if hooked else None


def _first_input(args: tuple, kwargs: dict):
    """A unit call's first tensor argument (positional, else keyword): the one a checkpoint of
    its span keeps; None without one."""
    import torch

    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _key(t) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def loss_of(model, call: str, x, y, vocab_size: int, seen: list | None = None):
    """The loss of ``model`` on token ids ``x`` against ``y``, called the ``call`` way (with
    ``"inputs"``, ``x`` is the positional and keyword arguments, ``y`` unused; ``seen`` gets
    the elements of the output the loss is taken over)."""
    if call == "inputs":
        args, kwargs = x
        return _output_loss(model(*args, **kwargs), seen)
    if call == "hf":
        return model(input_ids=x, labels=y).loss
    if call == "hf_logits":
        # A multiple-choice head takes (batch, choices, seq) ids: each row one choice, so the
        # micro-batch counts sequences (questions x choices).
        choices = type(model).__name__.endswith("ForMultipleChoice")
        out = model(input_ids=x[:, None] if choices else x)
        if getattr(out, "logits", None) is None and hasattr(out, "start_logits"):
            return _logits_loss(out.start_logits, x, y) + _logits_loss(out.end_logits, x, y)
        if getattr(out, "logits", None) is None:  # a backbone (BertModel, T5EncoderModel)
            return _output_loss(out, seen)
        return _logits_loss(out.logits, x, y)
    if call == "logits":
        from zeroshard.train import next_token_loss

        return next_token_loss(model, x, y, vocab_size)
    return model(x, y)


def _output_loss(out, seen: list | None = None):
    """A loss over the output of a model fed ``Inputs`` (or of a transformers backbone, without
    a head): a cross-entropy over the last dimension of its logits (a transformers output's
    ``logits``, or a 2-D output: a classifier's), else the mean square of its first floating
    tensor (an image's, a backbone's hidden states). Either saves one FP32 tensor of the
    output's size, as a user's loss or head would."""
    import torch
    import torch.nn.functional as F

    logits = getattr(out, "logits", None)
    square = logits is None  # (an output other than logits, unless it is 2-D)
    if logits is None:
        found = [t for t in _tensors(out) if t.is_floating_point()]
        if not found:
            raise ValueError(f"the model returned {type(out).__name__}, with no floating tensor")
        logits = found[0]
    if seen is not None:
        seen.append(logits.numel())
    if square and logits.dim() != 2:
        return logits.float().square().mean()
    flat = logits.float().reshape(-1, logits.size(-1))
    target = torch.zeros(flat.size(0), dtype=torch.long, device=flat.device)
    return F.cross_entropy(flat, target)


def _logits_loss(logits, x, y):
    """A cross-entropy over a head's ``logits`` against targets drawn from ``y``: per token for
    (batch, seq, classes) logits, per sequence for (batch, classes) ones (a classifier's)."""
    import torch.nn.functional as F

    if logits.dim() == 3 and logits.shape[:2] == x.shape:
        return F.cross_entropy(logits.flatten(0, 1).float(), (y % logits.size(-1)).flatten())
    if logits.dim() == 2 and logits.size(0) == x.size(0):
        return F.cross_entropy(logits.float(), y[:, 0] % logits.size(-1))
    raise ValueError(f"logits of shape {tuple(logits.shape)} for token ids {tuple(x.shape)}")


@contextlib.contextmanager
def _unpacked_sequences():
    """transformers looks for packed sequences in the position ids (``.item()`` of a comparison:
    impossible on meta) when a model runs without a cache, as configs with ``use_cache: false``
    do: the planner's batches hold one sequence per row, for which it finds none (None), and no
    padding."""
    masking = sys.modules.get("transformers.masking_utils")
    modeling = sys.modules.get("transformers.modeling_utils")
    # A padding mask of ones (BART's decoder makes one when given none) is checked with
    # ``.item()`` before sdpa may skip it: the planner's rows hold no padding, so it is all ones.
    # A config with a pad_token_id (GPT-2's, BERT's) has its ids looked through for padding to
    # warn about (``in``: ``.item()``); the planner's hold none. (Each where it exists:
    # transformers 4.56 has no fast_all.)
    every = getattr(masking, "fast_all", None)
    pretrained = getattr(modeling, "PreTrainedModel", None)
    patches = [
        (masking, "find_packed_sequence_indices", lambda position_ids: None),
        (masking, "fast_all", lambda tensor: True if tensor.is_meta else every(tensor)),
        (pretrained, "warn_if_padding_and_no_attention_mask", lambda *args, **kwargs: None),
    ]
    found = [
        (owner, name, getattr(owner, name), patch)
        for owner, name, patch in patches
        if owner is not None and hasattr(owner, name)
    ]
    for owner, name, _, patch in found:
        setattr(owner, name, patch)
    try:
        yield
    finally:
        for owner, name, original, _ in found:
            setattr(owner, name, original)


@contextlib.contextmanager
def _meta_grouped_mm():
    """``torch._grouped_mm`` (Hugging Face's mixture-of-experts layers: Qwen2-MoE, Mixtral) on
    meta: its meta kernel takes BF16 only, where the CPU's takes FP32 too. Below autograd, so
    that autograd still saves the input and weights, another dtype's call returns an empty
    output of the shape the BF16 kernel gives (a 2-D input by 3-D expert weights in forward;
    2-D by 2-D, grouped over the inner dimension, for the weights' gradient in backward)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    grouped = torch.ops.aten._grouped_mm.default

    def bf16(a):
        return a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            a = args[0]
            if func is grouped and a.is_meta and a.dtype != torch.bfloat16:
                others = {k: v for k, v in kwargs.items() if k != "out_dtype"}
                shape = func(*map(bf16, args), **others).shape
                dtype = kwargs.get("out_dtype") or a.dtype
                return torch.empty(shape, dtype=dtype, device="meta")
            return func(*args, **kwargs)

    with Mode():
        yield


@contextlib.contextmanager
def _cpu_attention_choice():
    """On meta, ``scaled_dot_product_attention`` runs the CPU's fused kernel wherever the CPU
    would choose it for the same shapes and arguments (asked with zero-stride stand-ins, no
    memory), instead of the math path meta always takes. Also where another torch function
    calls it (``nn.MultiheadAttention``'s ``multi_head_attention_forward``, in which the mode
    is off: its probabilities were counted, +32% on a wrapped ``nn.Transformer``): the
    module's own name is replaced meanwhile."""
    import torch
    from torch.overrides import TorchFunctionMode

    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def fused_or_math(*args, **kwargs):
        out = _fused(*args, **kwargs)
        return sdpa(*args, **kwargs) if out is None else out

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:
                return fused_or_math(*args, **kwargs)
            return func(*args, **kwargs)

    functional.scaled_dot_product_attention = fused_or_math
    try:
        with Mode():
            yield
    finally:
        functional.scaled_dot_product_attention = sdpa


def _fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The CPU fused kernel's output on meta, or ``None`` where the CPU would not use it."""
    import torch
    from torch.nn.attention import SDPBackend

    if q.device.type != "meta":
        return None

    def stand_in(t):
        if t is None:
            return None
        if t.dim() == 0:
            return torch.empty((), dtype=t.dtype)
        strides = (0,) * (t.dim() - 1) + (1,)
        out = torch.empty(t.shape[-1], dtype=t.dtype).as_strided(t.shape, strides)
        # (the choice looks at requires_grad: the CPU takes the math path for a mask that
        # needs a gradient, T5's position bias, where the fused kernel has no backward for it)
        return out.requires_grad_(t.requires_grad and t.is_floating_point())

    cpu = [stand_in(t) for t in (q, k, v, attn_mask)]
    choice = torch._fused_sdp_choice(*cpu, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != int(SDPBackend.FLASH_ATTENTION):
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device="meta")
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
