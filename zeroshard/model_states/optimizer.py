"""The sharded optimizer: any element-wise ``torch.optim`` class over this rank's FP32 master shard.

Each rank builds the user's optimizer class once per *sub-group*: the trainable ``FlatParam`` of a
unit (or of a bucket of units at stages 0-2). A sub-group's optimizer sees *pieces*: views into
that FlatParam's ``master``, one per run of consecutive parameters that share a param group.
Optimizer states are created lazily by torch for those pieces only, so they are partitioned
exactly as the master is (stage >= 1) or replicated (stage 0), and ``step`` runs sub-group by
sub-group: the seam through which a lower memory tier can stream them (ZeRO-Offload).

``ShardedOptimizer`` is itself a ``torch.optim.Optimizer``: its ``param_groups`` hold the model's
original parameters and the hyperparameters, which LR schedulers change and ``step`` hands on to
every sub-group. After the step, the engine refreshes replicated parameters (its own schedule).

Loss scaling lives here too (``zeroshard.loss_scaling``): ``backward`` multiplies the loss by the
scaler's scale; each gradient reduction removes it and looks for inf/NaN in the pass that
averages the reduced values (``GradScaling``); ``step`` agrees on the outcome with one small
all-reduce ("found_inf") and either steps or skips (master weights, optimizer states and step
counters untouched).

With ``zeroshard.shard(..., offload=zeroshard.Offload(optimizer="nvme", ...))`` the sub-groups'
states live in swap files and are streamed around the step (``state_swap``: sub-group i + 1 read
while i steps and i - 1 is written), and with ``gradients="nvme"`` the reduced gradient shards too
(``grad_swap``). ``states_in_memory()`` brings every state in, e.g. around a checkpoint. With
``parameters="nvme"`` (stage 3) each sub-group's FP32 master is read with its states and written
back after its step (``param_swap``, owned by the engine); read masters outside the step through
``master_pieces()``.

Element-wise optimizers (``optimizer_args.ELEMENTWISE``: SGD, Adam, AdamW, Adagrad, RMSprop, ...)
give the same result as unsharded training; others (LBFGS, Adafactor, LAMB, Muon) are refused.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import model_checks
from zeroshard.engine import Engine, engine_of, live_engines
from zeroshard.loss_scaling import DynamicLossScaler, LossScaler, default_scaler
from zeroshard.model_states import backward_step, bucket_owners, clipping, streamed_step
from zeroshard.model_states.agreement import agree, agreed, settings_apart, settings_digests
from zeroshard.model_states.backward_step import BackwardStep, check_step_in_backward
from zeroshard.model_states.grad_swap import GradSwapper
from zeroshard.model_states.init import check_same_model
from zeroshard.model_states.optimizer_args import (
    check_elementwise,
    param_groups,
    probe,
    rank_neutral,
    step_inner,
    user_stacklevel,
    with_default_impl,
)
from zeroshard.model_states.param_checks import check_requires_grad
from zeroshard.model_states.state_swap import (
    StateSwapper,
)
from zeroshard.model_states.subgroups import States, SubGroup, build_subgroups
from zeroshard.watchdog import collective_failed, diagnosed

_NOT_A_COPY = (
    "a zeroshard optimizer: its states are this rank's shards, stepped with its model's "
    "engine (a copy would hold neither); save optimizer.state_dict(), or the whole run with "
    "zeroshard.checkpoint.save(path, model, optimizer)"
)


def _unwrapped(factory: Any, settings: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """An optimizer class given as ``functools.partial(cls, **fixed)`` (Hydra's ``_partial_``,
    Lightning's configs): the class, with the settings the partial fixed under those given here
    (keywords of the call override a partial's, as calling it would)."""
    while isinstance(factory, functools.partial):
        if factory.args or "params" in factory.keywords:
            name = getattr(factory.func, "__qualname__", type(factory.func).__name__)
            raise TypeError(
                f"functools.partial({name}, ...) fixes the parameters: an optimizer factory "
                "may fix keyword settings only (zeroshard passes each rank's pieces); pass "
                f"functools.partial({name}, lr=..., ...) and param groups to "
                "zeroshard.optimizer(model, factory, params)"
            )
        settings = {**factory.keywords, **settings}
        factory = factory.func
    return factory, settings


class ShardedOptimizer(backward_step.StepsInBackward, torch.optim.Optimizer):
    """Steps only this rank's shard of the master weights with ``optimizer_cls``.

    Call ``backward(loss)``, optionally ``clip_grad_norm(max_norm)``, then ``step()`` and
    ``zero_grad()``. LR schedulers take this object itself. ``loss_scaler`` defaults to a
    ``DynamicLossScaler`` when gradients are computed in FP16 and to no scaling (steps with
    inf/NaN gradients skipped) otherwise. With ``step_in_backward`` (stages 2-3) each sub-group
    steps during backward, as soon as its gradient shard is reduced, and the shard is freed at
    once (``zeroshard.model_states.backward_step``: lower peak, different rules).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        *,
        loss_scaler: LossScaler | None = None,
        elementwise: bool = False,
        step_in_backward: bool = False,
        **defaults: Any,
    ) -> None:
        self.engine: Engine = engine_of(model)
        model_checks.not_wrapped(self.engine.model)  # (fully_shard's DTensors: no param found)
        optimizer_cls, defaults = _unwrapped(optimizer_cls, defaults)
        check_elementwise(optimizer_cls, known=elementwise)
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(
                "loss_scaler must be a zeroshard LossScaler or DynamicLossScaler, got "
                f"{type(loss_scaler).__name__}"
            )
        buckets = list(self.engine.buckets)
        self.loss_scaler = default_scaler({b.flat.param_dtype for b in buckets}, loss_scaler)
        self.steps_taken = 0
        """Steps applied (not skipped) since construction, or the step of the checkpoint loaded:
        the step a save records when the states keep no count (SGD)."""
        self.engine.scaling.warn_unscaled = isinstance(self.loss_scaler, DynamicLossScaler)
        check_requires_grad(self.engine.flat_params)  # else a parameter would not be found
        user_groups = param_groups(model, params)
        self._param_ids = {id(p) for g in user_groups for p in g["params"]}
        self._frozen = [p for g in user_groups for p in g["params"] if not p.requires_grad]
        """Its parameters that do not train (requires_grad=False at ``shard()``): no sub-group
        steps them, so a ``.grad`` set on one by hand is refused (``_refuse_frozen_grads``)."""
        self._whole_units = [  # units whose every trainable parameter it holds: Unit.updates
            u for u in self.engine.units if u.param_ids and u.param_ids <= self._param_ids
        ]
        given = defaults
        defaults = with_default_impl(optimizer_cls, given, self.engine.mesh.device, user_groups)

        # A rank stepping in backward, or with other groups, would wait in other collectives.
        def settings(d: dict) -> list:  # the same text on every rank for the same program
            return sorted((k, rank_neutral(v)) for k, v in d.items() if k != "params")

        check_same_model(model, self.engine.mesh, {
            "optimizer class": f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}",
            "step_in_backward": str(step_in_backward),
            "loss_scaler": type(self.loss_scaler).__name__,
            "param groups": repr([(len(g["params"]), settings(g)) for g in user_groups]),
            "optimizer settings": repr(settings(defaults)),
        }, call="optimizer")  # fmt: skip
        class_defaults = probe(
            optimizer_cls, defaults, given, user_groups, self.engine.mesh.device, known=elementwise
        )  # after check_same_model: a rank refused alone would leave the others waiting in it
        self._subgroups = build_subgroups(
            buckets, user_groups, optimizer_cls, defaults, self.engine.param_swap
        )
        super().__init__(user_groups, class_defaults)
        self.optimizer_cls = optimizer_cls
        self.state = States(self._subgroups)
        self._groups_fixed = True
        self._built_groups = self._group_ids()
        """Each group's parameters (ids, in order) as the sub-groups were built from them."""
        self._norm_checked = False
        """Whether a ``clip_grad_norm`` found every rank calling it (its first: ``clipping``)."""
        self._swap: StateSwapper | None = None
        """With ``Offload(optimizer="nvme")``: the sub-groups' states in swap files, streamed
        around each step (``zeroshard.model_states.state_swap``)."""
        self._grad_swap: GradSwapper | None = None
        """With ``Offload(gradients="nvme")``: reduced gradient shards written as each
        reduction finishes and read back at the step (``zeroshard.model_states.grad_swap``)."""
        self._swap, self._grad_swap = streamed_step.swappers(self, optimizer_cls, defaults)
        if step_in_backward and self.engine.param_swap is not None:
            raise ValueError(
                "step_in_backward with Offload(parameters='nvme') is not implemented: the masters "
                "are read back at the step; drop step_in_backward or use parameters=None"
            )
        self._backward_step: BackwardStep | None = None
        self._stepped_now = 0  # sub-groups the running step has updated
        self._applied: int | None = None  # how many, where the last step raised (else all)
        if step_in_backward:
            check_step_in_backward(self)
        self._buckets = bucket_owners.claim(self, step_in_backward)  # the same on every rank
        self._slots = {
            id(b): [i for i, s in enumerate(b.flat.slots) if id(s.param) in self._param_ids]
            for b in self._buckets
        }
        """Per bucket of this optimizer's, the slots of its parameters."""
        if step_in_backward:
            self._backward_step = BackwardStep(self, self._buckets)
        # Last, once nothing can fail (a refused call must leave the scaler free); an optimizer
        # this one replaced in every bucket (a rebuild) hands its scaler on.
        self.loss_scaler.claim(self, bucket_owners.owns_any)
        self.engine.optimizers.add(self)  # model.zero_grad() reaches this one's gradients too

    @property
    def optimizer(self) -> ShardedOptimizer:
        """This object (kept for code written when the inner optimizer was separate)."""
        return self

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers, one per sub-group (trainable FlatParam), in step order."""
        return [sg.optimizer for sg in self._subgroups]

    def master_pieces(self) -> Iterator[list[torch.Tensor]]:
        """Per sub-group, the 1D views of this rank's FP32 master that it steps, in memory while
        the caller holds them (offloaded masters are read in one sub-group at a time and dropped
        after: never read the pieces of ``sub_optimizers`` directly then)."""
        swap = self.engine.param_swap
        for sg in self._subgroups:
            flat = sg.bucket.flat
            with swap.resident(flat) if swap is not None else contextlib.nullcontext():
                yield [p for o in (sg.optimizer,) for g in o.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_groups_fixed", False):
            raise ValueError(
                "a sharded optimizer's parameters are fixed at construction; pass every group "
                "to zeroshard.optimizer(model, cls, groups)"
            )
        super().add_param_group(param_group)

    def _group_ids(self) -> list[tuple[int, ...]]:
        return [tuple(map(id, g["params"])) for g in self.param_groups]

    def check_groups(self) -> None:
        """The param groups hold the parameters they were built with (settings may change, as
        a scheduler changes them): each sub-group's torch optimizer steps its pieces with the
        settings of the group at the index it was built from. Checked by ``backward``,
        ``step()``, ``state_dict`` and a step in backward."""
        if self._group_ids() != self._built_groups:
            raise ValueError(
                "opt.param_groups were changed by hand (a group's 'params' edited, or groups "
                "removed or reordered): a sharded optimizer's groups are fixed at construction, "
                "each rank's pieces stepped with the settings of the group they were built in. "
                "Change settings in place (g['lr'] = ...); to move a parameter, freeze it or "
                "give it lr 0 in its group, or build a new zeroshard.optimizer with the groups"
            )

    # ----------------------------------------------------------------- the step
    def _adopt_grad_edits(self) -> None:
        """What was done through ``.grad`` of this optimizer's parameters since the reduction:
        stage 0's in-place edits and reassignments are what the step takes
        (``GradBucket.adopt_edits``, ``adopt_rebinds``); a gradient set by hand where the step
        cannot read it is an error."""
        for b in self._buckets:
            b.adopt_writes_over_zeros()
            b.adopt_edits()
            b.adopt_rebinds(self._slots[id(b)])

    def _frozen_grad(self) -> str | None:
        """The name of a frozen parameter of this optimizer whose ``.grad`` was set (by hand,
        or left from before ``shard()``), or None: torch's optimizer steps it, this one keeps
        no shard of it to step (it was ignored). Refused in the step's agreement, on every
        rank (a rank refusing alone left the others waiting in it)."""
        held = next((p for p in self._frozen if p.grad is not None), None)
        if held is None:
            return None
        return next((n for n, q in self.engine.model.named_parameters() if q is held), "?")

    def _frozen_grad_error(self, mine: str | None, group: Any) -> str:
        """The error for a frozen parameter's ``.grad`` that some rank holds (``mine``: this
        rank's ``_frozen_grad``): its name and rank, gathered (every rank calls it)."""
        names = [mine]
        if self.engine.mesh.world_size * self.engine.mesh.tp_size > 1:
            names = [None] * dist.get_world_size(group)
            with diagnosed("all_gather_object", "the names of frozen parameters", group):
                dist.all_gather_object(names, mine, group=group)
        rank, name = next((r, n) for r, n in enumerate(names) if n is not None)
        return (
            f"{name} does not train (requires_grad=False at zeroshard.shard()), yet its .grad "
            f"was set (on rank {rank}): a torch optimizer would step it, but the sharded "
            "optimizer steps only the parameters that train, from the gradients their backward "
            "reduced over the ranks. To train it, set requires_grad=True before shard(); else "
            "set its .grad back to None (opt.zero_grad() does). Nothing was stepped"
        )

    def _shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced FP32 gradients of this optimizer's parameters (1D: the whole
        range of a buffer it owns alone, else one view per parameter piece), edits adopted.
        Another optimizer's gradients are not its own: torch's clip takes only the parameters
        it is given."""
        self._adopt_grad_edits()
        grads = []
        for b in self._buckets:
            if b.shard_grad is None:
                continue
            if len(self._slots[id(b)]) == len(b.flat.slots):
                grads.append(b.shard_grad)
            else:
                pieces = b.flat.pieces()
                spans = [pieces[i][1] for i in self._slots[id(b)]]
                grads += [b.shard_grad[s] for s in spans if s.stop > s.start]
        return grads

    def backward(self, loss: torch.Tensor, *, sync: bool = True, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` (times the loss scale; ``retain_graph``, ``create_graph``
        and ``inputs`` as torch's); with ``sync=False`` gradients only accumulate locally (a
        gradient-accumulation micro-step), communicated by the next synchronized backward."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"backward() takes the loss tensor, got {type(loss).__name__}: pass the loss "
                "itself, not loss.item() or a list (sum several losses first)"
            )
        if not loss.requires_grad:  # (torch's error was "element 0 of tensors does not
            # require grad and does not have a grad_fn", from every rank)
            raise ValueError(
                "the loss does not require grad: no parameter that trains reached it (its "
                "forward ran under torch.no_grad() or inference_mode(), or every parameter it "
                "used has requires_grad=False); compute it with gradients on, from parameters "
                "that train"
            )
        self.check_groups()  # (before gradients are made for groups that would step wrong)
        scale = self.loss_scaler.scale_for(loss)
        if scale != 1.0:
            loss = loss.float() * scale  # in FP32: an FP16 loss times 2**16 would overflow
        # Every sharded model the loss may reach, not only this optimizer's (a decoder sharded
        # apart from its encoder, a GAN's discriminator in the generator's loss): each removes
        # this loss's scale in its reductions (GradScaling.begin_backward), accumulates in a
        # micro-step, and, with step_in_backward, leaves its own optimizers' steps alone.
        others = (e for e in live_engines() if e is not self.engine and e.buckets)  # (trained)
        engines = [self.engine, *others]
        outer = [(e.scaling.next_scale, e.scaling.next_scaler, e.backward_by) for e in engines]
        for engine in engines:  # (outer: a nested backward's)
            engine.scaling.next_scale, engine.backward_by = scale, self
            engine.scaling.next_scaler = self.loss_scaler
        try:
            with contextlib.ExitStack() as micro_step:
                for engine in engines if not sync else ():
                    micro_step.enter_context(engine.no_sync())
                loss.backward(**kwargs)
            for o in (o for engine in engines for o in engine.optimizers):
                if o._grad_swap is not None:  # (any model's the loss reached)
                    o._grad_swap.raise_deferred()
        except BaseException as exc:
            if not collective_failed(exc):  # (freeing would wait for the gathers in flight)
                for engine in engines:  # over now: a backward of a retained graph next is a
                    engine._after_raised_backward()  # new one, whose end is the step's
            raise
        finally:
            for engine, (next_scale, scaler, by) in zip(engines, outer):  # (a loss that
                engine.scaling.next_scale, engine.backward_by = next_scale, by  # reached no
                engine.scaling.next_scaler = scaler  # unit began no backward)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this optimizer's gradients so that their global ``norm_type``-norm (any
        p > 0, or ``inf``) is at most ``max_norm``; returns the norm before clipping, as
        ``torch.nn.utils.clip_grad_norm_`` over its parameters
        (``zeroshard.model_states.clipping``)."""
        return clipping.clip_grad_norm(self, max_norm, norm_type)

    @torch.no_grad()
    def clip_grad_value(self, clip_value: float) -> None:
        """Clamp this optimizer's gradients to ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_`` over its parameters (element-wise: each rank its
        shard, no communication). At stages 1-3 torch's own sees no ``.grad``."""
        if not clip_value >= 0:
            raise ValueError(f"clip_value must be a number >= 0, got {clip_value!r}")
        self._check_synchronized("clip_grad_value", "it would clip none of them")
        if self._backward_step is not None or self._grad_swap is not None:
            raise ValueError(
                "clip_grad_value needs the gradients in memory before the step: drop "
                "step_in_backward and keep gradients off NVMe (Offload(gradients='cpu'))"
            )
        for g in self._shard_grads():
            g.clamp_(-clip_value, clip_value)
        self._show_shard_grads()

    def _check_synchronized(self, call: str, consequence: str) -> None:
        """A ValueError for ``call`` after a backward with ``sync=False`` (the engine still
        accumulating): the gradients wait unreduced, and ``consequence``."""
        if self.engine.scaling.accumulating:  # else nothing is applied, without a word
            raise ValueError(
                f"{call} after a backward with sync=False (or inside no_sync()): its gradients "
                f"wait unreduced and {consequence}. Run the last micro-batch's backward "
                "synchronized (opt.backward(loss), outside no_sync()), then call it; the "
                "accumulated gradients are kept"
            )

    def _show_shard_grads(self) -> None:
        """Stage 0 after the engine changed the shard gradients (a clip): ``.grad`` shows them
        (``GradBucket.show_shard``)."""
        for b in self._buckets:
            b.show_shard()

    def _agree(self) -> tuple[bool, set[int]]:
        """Whether any rank's shard gradients of this optimizer's buckets hold inf/NaN (another
        optimizer's overflow is its own: ``bucket_owners``), and which parameters no rank's
        backward reached since ``zero_grad``: one small all-reduce (MAX) of both, so every rank
        skips or steps together (a shard's overflow is seen only by its owner) and leaves the
        same parameters without a gradient (as unsharded training and DDP do: an optimizer
        skips them instead of decaying them). The same all-reduce refuses, on every rank,
        param-group settings that differ between ranks and a ``.grad`` on a frozen parameter
        (``_frozen_grad``)."""
        # 1D FP32, this rank: found_inf, then one flag per trainable parameter, then the
        # settings' digests and the frozen-gradient flag; made at the step, after backward's
        # peak, and dropped with it.
        engine = self.engine
        found_inf = (
            torch.stack([b.found_inf for b in self._buckets]).amax(0)
            if self._buckets
            else torch.zeros(1, dtype=torch.float32, device=engine.mesh.device)
        )
        applied = self._applied_one_hot()
        digests = settings_digests(self.param_groups, engine.mesh.device)
        frozen = self._frozen_grad()
        checks = torch.cat([digests, digests.new_tensor([float(frozen is not None)])])
        flags = agree(
            found_inf,
            torch.cat([applied, engine.slots_touched(), checks]),
            engine.mesh,
            engine.ledger,
            async_op=False,
        ).wait()
        seen, reached = agreed(flags, engine.forget_order)  # (a host sync)
        self._applied = None
        width = len(self._buckets) + 1
        touched_end = len(reached) - checks.numel()
        copies, touched = reached[: applied.numel()], reached[applied.numel() : touched_end]
        *reduced, frozen_anywhere = flags[flags.numel() - checks.numel() :].tolist()
        mesh = engine.mesh
        group = None if mesh.tp_size > 1 else mesh.group  # (as ``agree``'s)
        apart = settings_apart(self.param_groups, reduced, group)
        if apart is not None:
            raise ValueError(apart)
        if frozen_anywhere:
            raise ValueError(self._frozen_grad_error(frozen, group))
        if any(sum(copies[i : i + width]) > 1 for i in range(0, len(copies), width)):
            self._refuse_replicas_apart()
        return self.loss_scaler.checks and seen, {i for i, used in enumerate(touched) if not used}

    def _applied_one_hot(self) -> torch.Tensor:
        """How many sub-groups this rank's last step applied (all, unless it raised), one-hot
        in its slot of a vector of one slot per set of copies: the ranks of a slot each hold a
        copy of the same masters and optimizer states (stage 0: every data-parallel rank; hybrid
        sharding: a shard's replicas; tensor-parallel ranks apart). Two counts in one slot after
        the agreement's MAX: the copies differ. Empty where no rank holds another's copy."""
        mesh, width = self.engine.mesh, len(self._buckets) + 1  # (>= any rank's sub-groups)
        if not self.engine.partition.optimizer_states and mesh.world_size > 1:
            per, mine = 1, 0
        elif mesh.hybrid is not None:
            per, mine = mesh.shard_size, mesh.shard_rank
        else:
            return torch.zeros(0, device=mesh.device)
        out = torch.zeros(per * mesh.tp_size * width, device=mesh.device)
        count = len(self._subgroups) if self._applied is None else self._applied
        out[(mesh.tp_rank * per + mine) * width + count] = 1
        return out

    def _refuse_replicas_apart(self) -> None:
        """On every rank alike: the last step raised on some rank after another copy of the same
        masters and optimizer states had applied more of it, so the copies differ; nothing more
        is trained or saved on them until a whole state is loaded (``Engine.check_trusted``)."""
        engine = self.engine
        engine.untrusted = (
            "the last optimizer.step() raised partway on some rank (an out-of-memory, a Ctrl-C) "
            "while another rank holding a copy of the same shard applied more of it: at stage "
            "0, or in hybrid sharding's replica groups, each rank keeps its own copy of the "
            "masters and optimizer states, and the copies now differ (they would train apart "
            "without a word). Nothing was stepped; "
            "load a checkpoint (zeroshard.checkpoint.load, or model.load_state_dict and each "
            "optimizer's load_state_dict) to train on"
        )
        engine.to_reload |= {id(engine.model), *(id(o) for o in engine.optimizers)}
        raise RuntimeError(engine.untrusted)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step on this rank's shard, sub-group by sub-group; the engine then
        refreshes replicated parameters.

        Returns False when the step was skipped because some rank's gradients hold inf/NaN
        (the loss scaler then lowers its scale); master weights and optimizer states are left
        untouched. ``zero_grad`` as usual either way.

        ``closure`` (as torch's, and PyTorch Lightning's, optimizers take it): called once,
        with gradients enabled, before the step (it runs the forward and backward); the step
        then returns its loss, as torch's does. Called once only: the element-wise optimizers
        that a sharded one accepts never re-evaluate it (LBFGS is refused)."""
        if self.steps_taken == 0 and _torch_initializes_states():  # (only a fresh one's)
            for g in self.param_groups:  # (state_dict() makes the states a template needs)
                for p in g["params"]:
                    p.grad = None
            return None
        self.check_groups()
        if closure is None:
            return self._step()
        with torch.enable_grad():
            loss = closure()
        self._step()
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by ``torch.amp.GradScaler.step``: True where ``.grad`` holds no gradient
        (stages 1-3), so that it calls ``step`` (which then names the fix) instead of failing
        in its own "No inf checks were recorded for this optimizer"; and with tensor
        parallelism, where each rank's split gradients differ and GradScaler's skip, decided
        by each rank alone, would split the ranks (one skipped, one stepped into a collective
        the other never joined); and at stage 0 where ``.grad`` holds FP16 copies, which
        GradScaler refuses to unscale ("Attempting to unscale FP16 gradients")."""
        engine = self.engine
        fp16 = any(b.flat.param_dtype == torch.float16 for b in self._buckets)
        return engine.partition.optimizer_states or engine.mesh.tp_size > 1 or fp16

    @torch.no_grad()
    def _step(self) -> bool:
        self.engine.check_trusted()
        if "found_inf" in self.__dict__:  # set by torch.amp.GradScaler.step (see above)
            del self.found_inf  # (it deletes them after a step that returns)
            self.__dict__.pop("grad_scale", None)
            why = (
                "each rank holds only its reduced shard, and .grad is None"
                if self.engine.partition.optimizer_states
                else "with tensor parallelism each rank decides its skip from its own pieces "
                "of the split gradients, and the ranks would part"
                if self.engine.mesh.tp_size > 1
                else ".grad holds FP16 copies of the gradients, which it refuses to unscale"
            )
            raise ValueError(
                "torch.amp.GradScaler cannot unscale a sharded optimizer's gradients at stage "
                f"{self.engine.stage}: {why}. Scale the loss with zeroshard instead: shard(..., "
                "mixed_precision='fp16') gives the optimizer a DynamicLossScaler (or pass "
                "loss_scaler=zeroshard.DynamicLossScaler() to zeroshard.optimizer), then "
                "opt.backward(loss) scales, and step() unscales and skips overflowed steps"
            )
        if self.engine.discarding:
            raise ValueError(
                "optimizer.step() inside summon_full_params(model, writeback=False), which "
                "undoes writes to the parameters on exit: whether the step should be undone "
                "too is ambiguous; step outside it, or inside summon_full_params(model)"
            )
        partial = self.engine.partial_gradients()
        if partial is not None:  # (the ranks' backwards got as far as each one's error)
            n = len(self._backward_step.stepped) if self._backward_step is not None else 0
            kept = f" (step_in_backward had updated {n} unit(s) in it: they stay)" if n else ""
            raise RuntimeError(
                f"optimizer.step(): {partial}{kept}. Nothing was stepped; call opt.zero_grad() "
                "to drop them, then run the forward and backward again"
            )
        self._check_synchronized("optimizer.step()", "the step would apply none of them")
        bucket_owners.reclaim(self)  # replaced by a newer optimizer, then used: its own again
        if (elsewhere := backward_step.applied_elsewhere(self)) is not None:
            raise RuntimeError(elsewhere)
        if self._backward_step is None:
            self.engine.adopt_writes()  # (stepping in backward, the forward adopted them)
        try:
            self._adopt_grad_edits()  # before the agreement: a .grad set to None is no gradient
            found_inf, unused = self._agree()  # (ValueError: the ranks' settings differ)
        except ValueError:
            bs = self._backward_step
            if bs is not None:  # units stepped in backward: their updates stay
                self._end_backward_step(bs, changed=bool(bs.stepped))
            raise
        # The scale in these gradients: another optimizer's when its backward took the loss
        # through this model too (one loss through two models sharded apart); that scaler
        # lowers its scale for the overflow, this one keeps its own.
        used = self.engine.scaling.scaler
        here = used is None or used is self.loss_scaler
        if here:  # (a scaler of the user's own may take found_inf alone)
            self.loss_scaler.update(found_inf)
        else:
            self.loss_scaler.update(found_inf, scaled_here=False)
        if found_inf and not here:
            used.overflowed_elsewhere()
        if self._backward_step is not None:
            taken = self._finish_backward_step(self._backward_step, found_inf, unused)
        elif found_inf:
            self.engine.end_step()
            taken = False
        else:
            self._stepped_now = 0
            try:
                if self._swap is None:
                    streamed_step.step_in_memory(self, unused)
                else:
                    streamed_step.step_swapped(self, self._swap, unused)
            except BaseException as exc:
                # Raised partway (an out-of-memory, a Ctrl-C in one sub-group): the sub-groups
                # stepped keep their update, as a torch optimizer's parameters do, and every
                # rank's replicas follow them (at stages 1-2 a rank's own slice is its master:
                # the ranks' parameters differed, and the next step moved them to the masters).
                # Where masters are replicated the next step's agreement refuses the run.
                if collective_failed(exc):
                    raise
                self._applied = self._stepped_now
                self._finish_step()
                raise
            self._finish_step()
            taken = True
        self.steps_taken += taken
        said = self.loss_scaler.skip_warning()  # once the step is complete (warnings may raise)
        if said:
            warnings.warn(said, stacklevel=user_stacklevel())
        return taken

    def _finish_step(self) -> None:
        """Refresh the parameters the step changed and close the ledger's step, also when the
        refresh is interrupted: a rank whose step raised closes it as the others do, or its
        digest of the units' order differed from theirs at the next step (a false
        ``OrderMismatch`` on every rank)."""
        try:
            self._changed()
        finally:
            self.engine.end_step()

    def _changed(self) -> None:
        """A step changed this optimizer's parameters: refresh them; the units whose trainable
        parameters it holds all count it (``Unit.updates``)."""
        self.engine.params_changed({b.flat for b in self._buckets})  # (the same on every rank)
        for unit in self._whole_units:
            unit.updates += 1

    @contextlib.contextmanager
    def states_in_memory(self) -> Iterator[None]:
        """Every sub-group's optimizer states resident in memory inside (a no-op unless they are
        offloaded to NVMe), e.g. around ``zeroshard.checkpoint.save`` / ``load``; streamed back
        out on exit, one slot at a time. Reading states outside it swaps the read sub-groups
        in too, but they then stay in memory until the next ``step``."""
        swap = self._swap
        if swap is not None:
            for i in range(len(self._subgroups)):
                swap.touch(i)
        try:
            yield
        finally:
            if swap is not None:
                swap.store_all()

    def offload_stats(self) -> dict[str, float]:
        """I/O of offloaded states, masters, gradients and activation checkpoints since the last
        call (bytes read and written, seconds any swap was in flight and seconds the caller
        blocked on one); empty without NVMe offload. ``1 - wait_s / io_s`` is the fraction of
        I/O hidden behind compute."""
        out: dict[str, float] = {}
        spans = self.engine.checkpointing  # (activation checkpoints: their keeper's swaps)
        keeper = spans.keeper if spans else None
        for swapper in (self._swap, self.engine.param_swap, self._grad_swap, keeper):
            if swapper is not None:
                out |= swapper.stats()
                swapper.reset_stats()
        return out

    def __deepcopy__(self, memo: dict) -> None:
        raise TypeError(f"copy.deepcopy of {_NOT_A_COPY}")

    def __copy__(self) -> None:
        raise TypeError(f"copy.copy of {_NOT_A_COPY}")

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(f"pickling (torch.save, pickle.dumps) of {_NOT_A_COPY}")

    def close(self) -> None:
        """Delete the swap files of offloaded optimizer states (also done when this optimizer
        is garbage-collected and at exit); the optimizer cannot step afterwards."""
        if self._swap is not None:
            self._swap.close()

    def _step_subgroup(self, sg: SubGroup, unused: set[int]) -> None:
        g = sg.bucket.shard_grad  # 1D range numel, FP32, or None (no gradient this step)
        for torch_group, user_index, pieces in zip(sg.optimizer.param_groups, sg.groups, sg.pieces):
            for key, value in self.param_groups[user_index].items():
                if key != "params":
                    torch_group[key] = value  # what an LR scheduler changed
            for piece in pieces:
                if piece.slot in unused:
                    piece.tensor.grad = None  # as torch leaves a parameter without a gradient
                elif g is None:  # a zero gradient kept by zero_grad(set_to_none=False)
                    piece.tensor.grad = torch.zeros_like(piece.tensor)
                else:
                    piece.tensor.grad = g[piece.span]
        step_inner(sg.optimizer)
        self._stepped_now += 1
        sg.bucket.flat.masters_ahead = True  # until the engine's refresh
        for pieces in sg.pieces:
            for piece in pieces:
                piece.tensor.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients. ``set_to_none=False`` as in torch: parameters that had a gradient
        keep a zero one, so the next step updates them (momentum, weight decay) even if no
        backward reaches them; with True (the default) such parameters are left alone. Also
        what a backward that raised left (``Engine.partial_gradients``)."""
        self.engine.gradients_discarded(by=self)
        bs = self._backward_step
        if not self.end_applied_step() and bs is not None:
            bs.reset()
        if self._grad_swap is not None:
            self._grad_swap.zero()
        bucket_owners.reclaim(self)
        bucket_owners.zero_grad(self, set_to_none)
        for p in self._frozen:  # (no step reads them: a zero one would still be refused)
            p.grad = None

    # ----------------------------------------------------------------- state
    @property  # type: ignore[override]
    def state(self) -> States:
        """The sub-optimizers' states as one mapping (``States``) keyed by this rank's pieces:
        read, deleted from or cleared as torch's, never assigned to."""
        return self._states

    @state.setter
    def state(self, value: Any) -> None:
        """``opt.state = defaultdict(dict)`` resets every state, as on torch's optimizer (the
        view alone would be replaced, and the step go on with the old moments)."""
        if not hasattr(self, "_states"):  # (torch's __init__ assigns an empty dict first)
            if isinstance(value, States):
                self._states = value
            return
        if value is self._states:
            return  # (an in-place operator's assignment: nothing to change)
        if not isinstance(value, Mapping) or len(value):
            raise ValueError(
                "opt.state can only be reset (opt.state = defaultdict(dict), or opt.state.clear()):"
                " its keys are this rank's pieces of the sharded parameters; load states with "
                "opt.load_state_dict(zeroshard.optimizer_state_dict(...)'s format)"
            )
        self._states.clear()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (``zeroshard.optim_state_dict``); the
        hooks of ``register_state_dict_pre_hook`` / ``_post_hook`` run as torch runs them."""
        from zeroshard.optim_state_dict import (
            called_by_torch,
            keyed_by_position,
            optimizer_state_dict,
        )
        from zeroshard.state_dict_layout import COLLECTIVE

        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self.check_groups()
        with diagnosed("all_gather", COLLECTIVE, None):  # (as load_state_dict's)
            state_dict = optimizer_state_dict(self)
        if called_by_torch("_get_optim_state_dict", depth=1):  # it keys them by name again
            state_dict = keyed_by_position(self, state_dict)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict`` returns (at any world size or stage, e.g. through DCP); the
        hooks of ``register_load_state_dict_pre_hook`` / ``_post_hook`` run as torch runs them."""
        from zeroshard.optim_state_dict import load_optimizer_state_dict
        from zeroshard.state_dict_layout import COLLECTIVE

        state_dict = state_dict.copy()  # hooks edit this copy, not the caller's (as torch)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        # (Under inference_mode the states would be inference tensors: the step's in-place
        # updates of them fail. torch's optimizer loads them as normal tensors there too.)
        with diagnosed("all_gather", COLLECTIVE, None), torch.inference_mode(False):
            load_optimizer_state_dict(self, state_dict)
        self._applied = None  # (the same states on every copy again)
        self.engine.loaded(self)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _torch_initializes_states() -> bool:
    """Whether this ``step`` is the zero-gradient one (gradients set by hand, learning rate 0)
    of torch's ``get_state_dict`` / ``set_state_dict`` on an optimizer with no state yet."""
    from zeroshard.optim_state_dict import called_by_torch

    return called_by_torch("_init_optim_state", depth=5)
