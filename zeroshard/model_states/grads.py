"""Gradient buckets: how a FlatParam's gradient reaches its owner, and this rank's reduced shard.

One ``GradBucket`` per trainable ``FlatParam``. The stage decides the collective once, at
construction (``Reduction``): an all-reduce (replicated optimizer states, stage 0), a reduce-scatter
in place into this rank's slice (replicated gradients, stage 1), or a reduce-scatter into a new
shard so that the full gradient can be freed at once (partitioned gradients, stages 2-3).

Tensors and who holds them (N ranks, ``range`` = the FlatParam's optimizer range):

    full_grad   # 1D padded_numel, this rank's local (unreduced) gradient. With ``as_views``
                #   (see there) in param_dtype, bound at the unit's pre-backward and persistent
                #   when gradients are replicated; otherwise in reduce_dtype, made at the
                #   reduction from autograd's own per-parameter tensors (its memory from
                #   ``pool`` on the CPU, ``zeroshard.residual_states.buffers.TensorPool``).
    shard_grad  # 1D range numel, FP32, this rank's reduced (mean, unscaled) gradient, read by
                #   the optimizer; accumulates over reductions until ``zero``. With hybrid
                #   sharding, identical on the ranks of a replicate group.
    _acc        # 1D padded_numel in reduce_dtype, this rank: the local gradients of the earlier
                #   micro-steps of an accumulation (backwards that do not reduce), when
                #   reduce_dtype is wider than param_dtype; added to the last one's at reduction.

Hybrid sharding (``zeroshard.mesh``, shard groups of k ranks): the reduce-scatter runs inside the
shard group, then ``finish`` all-reduces the 1/k shard across groups (``REPLICATE`` scope in the
ledger), so every replica holds the mean over all ranks. That all-reduce starts once the
reduce-scatter is done (at ``finish``, deferred by ``ShardConfig.max_inflight_reductions``).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable

import torch

from zeroshard import collectives as C
from zeroshard.autograd_hooks import weakly
from zeroshard.loss_scaling import GradScaling
from zeroshard.model_states.flat_param import FlatParam, Slot
from zeroshard.model_states.grads_shown import ShownGradients
from zeroshard.model_states.partition import shard_range
from zeroshard.residual_states.buffers import TensorPool
from zeroshard.stages import Partition
from zeroshard.streams import on_side_stream


class Reduction(enum.Enum):
    ALL_REDUCE = "all_reduce"  # every rank keeps every gradient (optimizer states replicated)
    SCATTER_IN_PLACE = "scatter_in_place"  # into this rank's slice of the full gradient, kept
    SCATTER_AND_FREE = "scatter_and_free"  # into a new shard; the full gradient freed right after

    @classmethod
    def of(cls, partition: Partition) -> Reduction:
        if not partition.optimizer_states:
            return cls.ALL_REDUCE
        return cls.SCATTER_AND_FREE if partition.gradients else cls.SCATTER_IN_PLACE


def _check_dense(slot: Slot) -> None:
    """A sparse gradient (``F.embedding(..., sparse=True)`` in a module's own forward, which
    ``shard`` cannot see) is a clear error: the buckets hold dense elements (it raised torch's
    "Cannot access data pointer" or "reshape is not implemented for sparse tensors")."""
    grad = slot.param.grad
    if grad is not None and grad.layout is not torch.strided:
        raise ValueError(
            f"{slot.names[0]}'s gradient is sparse ({grad.layout}; F.embedding(..., "
            "sparse=True) or torch.sparse.mm in forward): zeroshard's gradient buckets hold "
            "dense gradients; compute it with sparse=False (dense gradients)"
        )


def pools(buckets: list[GradBucket]) -> list[TensorPool]:
    """The distinct pools that the buckets' collected full gradients borrow memory from (stages
    2-3 on the CPU with ``ShardConfig.constant_buffers``)."""
    return list({id(b.pool): b.pool for b in buckets if b.pool is not None}.values())


class GradBucket(ShownGradients):
    """The gradient of one trainable ``FlatParam`` (module docstring)."""

    def __init__(
        self,
        flat: FlatParam,
        *,
        partition: Partition,
        reduce_dtype: torch.dtype | None,
        scaling: GradScaling,
        num_units: int = 1,
        pool: TensorPool | None = None,
    ) -> None:
        assert flat.requires_grad
        self.flat, self.scaling = flat, scaling
        self.reduction = Reduction.of(partition)
        self.reduce_dtype = reduce_dtype or flat.param_dtype
        self.num_units = num_units
        """Units whose parameters share ``flat`` (consecutive units of replicated parameters)."""
        self.as_views = self.reduction is not Reduction.SCATTER_AND_FREE or num_units > 1
        """Whether ``.grad`` are views into ``full_grad`` during backward (autograd accumulates in
        place) or autograd's own tensors, copied into a fresh ``full_grad`` at reduction.

        Views suit a buffer that outlives one unit's backward: replicated gradients, or a bucket
        shared by several units. A single unit's partitioned gradient (stage 3) is copied at
        reduction instead, as FSDP2 does: nothing is allocated (or zero-filled) before the unit's
        first gradient exists, which keeps the start of backward, the step's peak, lower."""
        self.pool = pool
        """Where a collected ``full_grad`` gets its memory when it is reduced into a separate
        shard (``TensorPool``; None: allocated at each collection)."""
        self.full_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        self._acc: torch.Tensor | None = None  # (module docstring)
        self._pooled = False  # full_grad came from the pool
        self._reduce: tuple[C.Handle, torch.Tensor] | None = None
        self._bound = [False] * len(flat.slots)  # per slot: .grad is its region, holding data
        self.touched = [False] * len(flat.slots)
        """Per slot: a gradient reached it on this rank since ``zero`` (else the optimizer may
        leave the parameter alone, as torch does with a ``None`` gradient)."""
        self.reached = False  # a gradient came since ``zero`` (not one it kept: set_to_none=False)
        self.arrivals = 0  # autograd's gradients taken in, ever (a backward that raised made any?)
        self._arrived: set[int] = set()  # slots a gradient reached since a backward ended
        self.zeroings = 0  # calls of ``zero`` and ``zero_slots``: the step in backward reads it
        self.applied_by: tuple[weakref.ref, int] | None = None
        """(weakref to the optimizer, ``zeroings`` then) of the last step in backward that
        applied this bucket's gradient and freed it: until a zero_grad, no other optimizer has
        a gradient of it to step on."""
        self._reduced = False  # reduced since zero, and the buffer kept (not yet bound again)
        self._zeroed_version: int | None = None
        """Stage 0 after ``zero(keep_touched=True)``: ``full_grad``'s version once zeroed, until
        a backward binds it again (``adopt_writes_over_zeros``)."""
        self.issued = False
        """Reduced (or reducing) in the current backward: a gradient that comes after that (its
        parameter also read outside its unit, earlier in the forward, so that autograd finishes
        it last) is reduced again at the end of the backward (``came_late``), as DDP's buckets
        wait for every parameter's gradient."""
        self.late = False  # such a gradient reached a post-accumulate hook (``as_views``)
        self._watching: list = []
        """Handles of the tensor hooks (``_before_grad``) on the parameters of slots bound as
        this backward's reduction started, removed as the backward ends."""
        self._parked: dict[int, torch.Tensor | None] = {}
        """Slots whose ``.grad`` is a tensor of its own from this backward's reduction to its end
        (``_park``), and the value it started from, already reduced (None: zeros)."""
        self._unshown = False  # a slot was left unbound at this backward's reduction
        self._shown_version: int | None = None
        """Stage 0, ``shard_grad`` apart from ``full_grad``: the buffer's version counter when it
        was given the averaged gradient (``.grad`` shows it), to notice in-place edits."""
        self._found_version: int | None = None
        """Stage 0: the buffer's version counter when ``found_inf`` was last decided from what
        ``.grad`` shows (in FP32 ``.grad`` is the step's own memory: an edit changes it there)."""
        self._shown_norm: torch.Tensor | None = None
        """And the L1 norm of what it showed (FP32, 1 element): kernels that write in place
        without a version bump (GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``)."""
        self.handoff: Callable[[GradBucket], None] | None = None
        """Called after each reduction of a partitioned gradient, ``shard_grad`` then holding the
        reduced shard: the hand-off to a lower memory tier (``zeroshard.model_states.grad_swap``),
        which may take ``shard_grad`` away until the step, or the step itself
        (``zeroshard.model_states.backward_step``)."""
        self.on_reduce: Callable[[GradBucket], None] | None = None
        """Called right after a reduction is issued (``touched`` final for it): the step in
        backward starts its small agreement collective there, to overlap the reduction."""
        self.on_zero: Callable[[GradBucket, list[int] | None], None] | None = None
        """Called as all gradients (None) or some slots' are dropped, for a shard handed off."""
        self.consumed_at_handoff = False
        """Set by a hand-off that drops ``shard_grad`` before it returns (the step in backward):
        the reduce-scatter then writes into this rank's slice of ``full_grad`` in place, which
        the shard keeps alive until then, instead of into a separate output buffer."""
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=flat.mesh.device)
        """(1,) FP32, this rank: > 0 once its reduced shard held inf/NaN, until the gradients are
        dropped (``zero``, or ``bucket_owners.zero_grad`` once every owner zeroed its part)."""
        self.owners: list[weakref.ref] = []
        """The optimizers whose parameters it holds, weakly (``bucket_owners``)."""
        self.zeroed: set[int] = set()
        """Slots of a shared bucket its owners zeroed since ``found_inf`` was reset."""
        self._dropped: set[int] = set()
        """Slots ``zero_slots`` dropped since the last reduction: once they are all of them (a
        submodule's ``zero_grad`` each), nothing that raised ``found_inf`` is left."""
        if self.as_views:
            for i, s in enumerate(flat.slots):
                s.param.register_post_accumulate_grad_hook(weakly(self._on_grad, i))

    @property
    def all_reduced(self) -> bool:
        """Whether the gradient is all-reduced whole (stage 0: replicated optimizer states)."""
        return self.reduction is Reduction.ALL_REDUCE

    def bind(self) -> None:
        """Make ``full_grad`` ready for this backward's gradients (``as_views`` buckets only; a
        no-op otherwise).

        The buffer is never zero-filled: a slot's first gradient since the last reduction or
        ``zero`` is copied into its region by a post-accumulate hook, which then points the
        parameter's ``.grad`` at that region, where autograd adds later ones in place (DDP's
        trick: one copy instead of a memset and an add). Regions no gradient reached are
        zeroed at reduction."""
        if not self.as_views:
            return
        if self._reduce is not None:
            self.finish()  # reduced earlier in this backward; new gradients come after it
        flat = self.flat
        if self.full_grad is None:
            self.full_grad = torch.empty(
                flat.padded_numel, dtype=flat.param_dtype, device=flat.mesh.device
            )
            self._unbind()
        elif self._reduced:
            # A second reduction before zero_grad: what was reduced stays apart, the local
            # gradient starts afresh. At stage 0, .grad dropped or replaced since (p.grad =
            # None, a torch optimizer's zero_grad) is taken first, as under DDP (it was kept).
            if self.reduction is Reduction.ALL_REDUCE and not self.issued:
                self.adopt_rebinds(range(len(flat.slots)))
            self.adopt_edits()
            if self.shard_grad is not None and self._in(self.shard_grad):
                self.shard_grad = self.shard_grad.clone()
            self._unbind()
        # padding: part of every reduction (a kept buffer's may hold a NaN clip's 0 x NaN)
        self._zero_padding()
        self._reduced = False
        self._shown_version = self._zeroed_version = self._found_version = None
        for i, s in enumerate(flat.slots):
            if not self._bound[i] and s.param.grad is not None:
                self._take(i)  # accumulated before the buffer existed (e.g. outside the hooks)

    def _unbind(self) -> None:
        """Every region free for a first gradient; ``.grad`` that are not views of it (fresh
        gradients, to be taken) stay."""
        for i, s in enumerate(self.flat.slots):
            if self._bound[i] or self.full_grad is None:
                s.param.grad = None
        self._bound = [False] * len(self.flat.slots)

    def _view(self, i: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Slot ``i``'s region of ``buffer`` (default ``full_grad``), in its shape."""
        buffer, s = self.full_grad if buffer is None else buffer, self.flat.slots[i]
        assert buffer is not None
        return buffer[s.offset : s.offset + s.numel].view(s.shape)

    def _is_region(self, i: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is slot ``i``'s region of ``full_grad`` (no view built: this runs
        once per parameter per backward)."""
        assert self.full_grad is not None
        offset = self.flat.slots[i].offset * self.full_grad.element_size()
        return grad.data_ptr() == self.full_grad.data_ptr() + offset

    def _take(self, i: int) -> None:
        """Move slot ``i``'s gradient into its region of ``full_grad`` and bind it there."""
        param, view = self.flat.slots[i].param, self._view(i)
        grad = param.grad
        if grad is None:
            if not self._bound[i]:
                view.zero_()
        elif not self._is_region(i, grad):
            # A first gradient, or .grad replaced out of place (create_graph accumulation,
            # p.grad = f(p.grad)): either way the current .grad is the whole gradient.
            view.copy_(grad)
            self.touched[i] = self.reached = True
            base = self._parked.pop(i, None)
            if base is not None:
                view.sub_(base)  # (the value it started from was reduced already)
        param.grad = view
        self._bound[i] = True

    def _unbind_if_replaced(self, i: int) -> None:
        """Slot ``i`` bound, but its ``.grad`` replaced since by a hook of the user's that runs
        after ours (``p.grad = p.grad * 3``, ``= None`` in a post-accumulate hook registered
        after ``shard()``): unbound, so that what ``.grad`` holds now is what is taken (the
        region's value was reduced, the edit dropped, and at stage 0 the edited local gradient
        was stepped on later as one set by hand)."""
        if self._bound[i]:
            grad = self.flat.slots[i].param.grad
            if grad is None or not self._is_region(i, grad):
                self._bound[i] = False

    def _before_grad(self, i: int, grad: torch.Tensor) -> None:
        """Tensor hook of slot ``i``'s parameter from its bucket's reduction to the backward's
        end (``_watching``), before autograd adds ``grad`` to ``.grad``: a second gradient in
        one backward for a slot bound to the region being reduced (its unit's own one came
        through an inner backward, a reentrant checkpoint's, and this one after it) lands in a
        zero tensor of its own (``_park``), not in place in that region. A parked slot's
        ``.grad`` is its starting value itself until then: it gets a copy to add into."""
        if i in self._parked:
            base, param = self._parked[i], self.flat.slots[i].param
            if base is not None and param.grad is base:
                param.grad = base.clone()  # (``base`` stays what ``_take`` subtracts)
        elif self.issued and self._bound[i]:
            self._park(i, keep=False)

    def _unwatch(self) -> None:
        watching, self._watching = self._watching, []
        for handle in watching:
            handle.remove()

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate hook of slot ``i``: a fresh gradient goes into the bucket."""
        _check_dense(self.flat.slots[i])
        if param.grad is not None:
            self.touched[i] = self.reached = True
            self.arrivals += 1
            self._arrived.add(i)
        if self.issued:  # a fresh tensor (reduce() left .grad unbound): reduced again at the end
            self.late = True
            return
        if self.full_grad is None or self._reduce is not None:
            return  # before bind (taken there) or while reducing (taken at the next bind)
        if not self._bound[i] or not self._is_region(i, param.grad):
            self._take(i)

    def _collect(self, *, pooled: bool = True) -> None:
        """``full_grad`` from autograd's per-parameter gradients (zeros where there are none),
        which are released, plus the earlier micro-steps' ``_acc`` (which it becomes). Made in
        ``reduce_dtype`` directly, so a wider reduction needs no second, cast copy."""
        flat = self.flat
        for s in flat.slots:  # (before any memory is taken)
            _check_dense(s)
        adding = self._acc is not None
        # Pooled only when nothing outlives the reduction: the shard is a tensor of its own.
        self._pooled = (
            pooled and not adding and self.pool is not None and not self.consumed_at_handoff
        )
        if adding:
            self.full_grad, self._acc = self._acc, None
        elif self._pooled:
            self.full_grad = self.pool.take(flat.padded_numel, self.reduce_dtype, flat.mesh.device)
        else:
            self.full_grad = torch.empty(
                flat.padded_numel, dtype=self.reduce_dtype, device=flat.mesh.device
            )
        with torch.no_grad():
            for i, s in enumerate(flat.slots):
                view = self.full_grad[s.offset : s.offset + s.numel]
                grad = s.param.grad
                if grad is None:
                    if not adding:
                        view.zero_()
                    continue
                if adding:
                    view.add_(grad.reshape(-1))
                else:
                    view.copy_(grad.reshape(-1))
                self.touched[i] = self.reached = True
                self.arrivals += 1
                s.param.grad = None
            if not adding:
                self._zero_padding()

    def _zero_padding(self) -> None:
        """Zeros where ``full_grad`` holds no parameter: the gaps between them and the tail."""
        assert self.full_grad is not None
        for lo, hi in (*self.flat.gaps, (self.flat.numel, self.flat.padded_numel)):
            self.full_grad[lo:hi].zero_()

    @property
    def folds(self) -> bool:
        """Whether micro-steps that do not reduce add their local gradients in ``reduce_dtype``
        (``_acc``): it is wider than ``param_dtype``, in which autograd makes them (FSDP2's
        ``to_accumulated_grad_if_needed``; summed in BF16, 16 micro-steps were 5x further from
        the FP32 sum)."""
        return self.reduce_dtype.itemsize > self.flat.param_dtype.itemsize

    def fold(self) -> None:
        """A unit of this bucket is done with a backward that does not reduce (accumulation):
        its local gradient, in ``param_dtype``, is added into ``_acc`` and released, so the next
        micro-step's starts afresh. A no-op when nothing new is there, or without ``folds``."""
        if not self.folds or self._reduce is not None:
            return
        if not self.as_views:
            if any(s.param.grad is not None for s in self.flat.slots):
                self._collect(pooled=False)  # into _acc (it becomes full_grad), or a new one
                self._acc, self.full_grad = self.full_grad, None
            return
        if self.full_grad is None or self._reduced or not any(self._bound):
            return
        for i in range(len(self.flat.slots)):
            self._unbind_if_replaced(i)
            if not self._bound[i]:
                self._take(i)  # no gradient reached it in this micro-step: zeros
        with torch.no_grad():
            if self._acc is None:
                self._acc = self.full_grad.to(self.reduce_dtype)
            else:
                self._acc.add_(self.full_grad)
        if self.reduction is Reduction.SCATTER_AND_FREE:
            self._free_full()  # (bind makes it again): only _acc is kept between micro-steps
        else:
            self._unbind()

    def _in(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in ``full_grad``'s memory."""
        full = self.full_grad
        return full is not None and t.untyped_storage().data_ptr() == full.data_ptr()

    def reduce(self) -> None:
        """Start the gradient collective of this bucket's ``Reduction`` (async)."""
        if self._reduce is not None:
            return
        # On a GPU the collect, the cast and the collective run on the reduce-scatter stream.
        with on_side_stream(self.flat.mesh.device, "reduce_scatter"):
            if not self.as_views:
                self._collect()
            else:
                if self.full_grad is None or self._reduced:
                    self.bind()  # every rank reduces every bucket, used or not
                for i, s in enumerate(self.flat.slots):
                    self._unbind_if_replaced(i)
                    if not self._bound[i]:
                        if s.param.grad is None:  # none reached it yet: zeros, and .grad left
                            self._view(i).zero_()  # unbound: one coming later is its own
                            self._unshown = True
                            continue
                        self._take(i)
                    if i not in self._arrived:  # (from before this backward: may come late)
                        self._park(i, keep=True)
                    self._watching.append(s.param.register_hook(weakly(self._before_grad, i)))
            assert self.full_grad is not None
            self.issued = True
            flat, mesh = self.flat, self.flat.mesh
            if self._acc is not None:  # the earlier micro-steps' sum (as_views: see _collect)
                send, self._acc = self._acc.add_(self.full_grad), None
            else:  # 1D padded, every rank (no copy if the same dtype)
                send = self.full_grad.to(self.reduce_dtype)
            if self.reduce_dtype == torch.float16:
                send.div_(mesh.world_size)  # FP16 overflows easily: average before summing
            if self.reduction is Reduction.ALL_REDUCE:
                assert mesh.hybrid is None  # stage 0 drops hybrid sharding (sharding.shard)
                handle = C.all_reduce(
                    send, group=mesh.group, ledger=flat.ledger, label="grads", unit=flat.name
                )
            else:
                lo, hi = shard_range(mesh.shard_rank, flat.padded_numel, mesh.shard_size)
                in_place = self.reduction is Reduction.SCATTER_IN_PLACE or self.consumed_at_handoff
                out = send[lo:hi] if in_place else send.new_empty(hi - lo)
                handle = C.reduce_scatter(
                    out, send, group=mesh.shard_group, ledger=flat.ledger, unit=flat.name
                )
        self._reduce = (handle, send)
        if self.on_reduce is not None:
            self.on_reduce(self)

    def finish(self) -> None:
        """Wait for the collective, average, accumulate into ``shard_grad`` (FP32), and free
        ``full_grad`` when gradients are partitioned."""
        if self._reduce is None:
            return
        handle, _send = self._reduce
        out = handle.wait()
        self._reduce = None  # (after the wait: one that raised is waited again by zero())
        self._dropped.clear()  # new values, which may raise found_inf
        mesh = self.flat.mesh
        if mesh.hybrid is not None:
            # The shard group's sum of this 1/k shard, summed over the replicas holding it.
            C.all_reduce(
                out,
                scope=C.REPLICATE,
                group=mesh.replicate_group,
                ledger=self.flat.ledger,
                label="grads",
                async_op=False,
                unit=self.flat.name,
            )
        if self.reduction is Reduction.ALL_REDUCE:
            out = out[self.flat.range[0] : self.flat.range[1]]
        reduced = out.to(self.flat.master_dtype)  # 1D range numel (alias when the same)
        if reduced is out and self.reduction is Reduction.SCATTER_IN_PLACE and not self._in(out):
            reduced = reduced.clone()  # else it kept a whole temporary send buffer alive
        # Average (FP16 was divided before summing), remove the loss scale and look for inf/NaN
        # in one fused pass, in the master dtype: unscaled in FP16, gradients below its range
        # (what the loss scale is for) were flushed to zero.
        divisor = self.scaling.loss_scale
        if self.reduce_dtype != torch.float16:
            divisor *= self.flat.mesh.world_size
        unscale(reduced, divisor, self.found_inf)
        accumulated = self.shard_grad is not None
        if not accumulated:
            self.shard_grad = reduced
        else:
            self.shard_grad.add_(reduced)
        if self.reduction is Reduction.ALL_REDUCE and self.as_views:
            self._show_average(reduced, accumulated)
        if self.reduction is Reduction.SCATTER_AND_FREE:
            self._free_full()
            if self.handoff is not None:
                self.handoff(self)
        else:
            self._reduced = True
            if self.reduction is Reduction.SCATTER_IN_PLACE and self.as_views:
                # Reduced in place, the buffer holds this rank's averaged range and the others'
                # local sums: ``.grad`` would show neither gradient, so none is shown (stages
                # 2-3 alike); stage 0's all-reduce leaves the averaged whole gradient there.
                self._unbind()

    def _park(self, i: int, *, keep: bool) -> None:
        """Slot ``i`` is bound to a region being reduced, and a gradient may still come in this
        backward (its parameter also read before its unit, so that autograd finishes it after
        the reduction): autograd would add it in place into the region, during the collective
        (a race, and a sum reduced twice). Until the backward ends, ``.grad`` is a tensor of its
        own instead: a late gradient lands there and is reduced again (``came_late``, ``_take``
        minus what was reduced already); otherwise ``end_backward`` shows what it would have
        shown bound (``_unpark``). ``keep``: it starts from the region's value, as ``.grad``
        showed it (an earlier micro-step's gradient, or a zero kept by
        ``zero_grad(set_to_none=False)``), which a post-accumulate hook then sees summed with
        the late one, as under DDP: one copy, read before the collective starts, which ``.grad``
        shows until a late gradient comes (``_before_grad`` copies it then). Else from zeros
        (the region is being reduced already)."""
        base = self._view(i).clone() if keep else None
        self.flat.slots[i].param.grad = base if keep else torch.zeros_like(self._view(i))
        self._parked[i] = base
        self._bound[i] = False

    def _unpark(self) -> None:
        """Slots parked in this backward that no late gradient reached (``.grad`` still their
        starting value; one parked from zeros was parked by a late gradient) show what they
        would have shown bound: the region (stage 0: the averaged gradient), else no ``.grad``."""
        parked, self._parked = self._parked, {}
        shows = self.reduction is Reduction.ALL_REDUCE and self._reduced
        for i, base in parked.items():
            param = self.flat.slots[i].param
            if base is None or param.grad is not base:
                continue  # a late gradient came: taken and reduced again, or replaced by hand
            if shows and self.full_grad is not None:
                param.grad, self._bound[i] = self._view(i), True
            else:
                param.grad = None

    def came_late(self) -> bool:
        """Whether a gradient came after this backward's reduction: in a hook (``as_views``),
        or in autograd's own ``.grad`` (which ``_collect`` had emptied)."""
        if not self.issued or self.as_views:
            return self.late
        return any(s.param.grad is not None for s in self.flat.slots)

    def end_backward(self) -> None:
        """The backward is over (late gradients reduced): the tensor hooks of ``_watching``
        removed, parked slots shown again (``_unpark``); at stage 0, ``.grad`` of parameters
        no gradient reached on this rank show the averaged gradient too, as under DDP; those
        that no rank's reached (all zeros in FP32) keep ``None``, as under torch and DDP. (One
        another rank reached with an average of exactly zero shows None too; the step still
        applies it.)"""
        self.issued = self.late = False
        self._arrived.clear()
        self._unwatch()
        self._unpark()
        unshown, self._unshown = self._unshown, False  # (no walk of the slots otherwise)
        if unshown and self.reduction is Reduction.ALL_REDUCE and self._reduced:  # (persistent)
            slots = [i for i, s in enumerate(self.flat.slots)
                     if not self._bound[i] and s.param.grad is None]  # fmt: skip
            if not slots or self.shard_grad is None:  # (bound since, by a late gradient)
                return
            pieces = self.flat.pieces()
            reached = [self.shard_grad[pieces[i][1]].ne(0).any() for i in slots]  # FP32
            for i, any_rank in zip(slots, torch.stack(reached).tolist()):
                if any_rank:
                    self.flat.slots[i].param.grad, self._bound[i] = self._view(i), True

    def _free_full(self) -> None:
        if self.as_views:  # otherwise .grad are autograd's own, released at collection already
            self._unbind()
        # Forgotten before it is given back: a Ctrl-C in ``give`` left it given back and still
        # held, given again at every zero_grad(), each refused.
        pooled, full = self._pooled, self.full_grad
        self._pooled, self.full_grad = False, None
        if pooled and full is not None:
            self.pool.give(full)

    def zero(self, *, keep_touched: bool = False) -> None:
        """Drop the reduced shard and the local gradient (keeping a persistent buffer), and a
        reduction still in flight (a backward that was interrupted). ``keep_touched``: slots
        that had a gradient keep a zero one (``zero_grad(set_to_none=False)``)."""
        if self._reduce is not None:
            self._reduce[0].wait()  # every rank issued it: complete it, then forget the result
            self._reduce = None
        if self.on_zero is not None:
            self.on_zero(self, None)
        self.shard_grad = self._acc = self._shown_version = self._shown_norm = None
        self._found_version = None
        self._zeroed_version = None
        self.issued = self.late = self._unshown = self._reduced = False
        self._arrived.clear()
        self._parked.clear()
        self._unwatch()
        self.found_inf.zero_()
        self.zeroed.clear()
        self._dropped.clear()
        self.reached, self.zeroings = False, self.zeroings + 1
        if not keep_touched:
            self.touched = [False] * len(self.flat.slots)
        for s in self.flat.slots:  # also autograd's own: no_sync micro-steps' (not as_views),
            s.param.grad = None  # or made outside the engine's backwards (by hand, a penalty)
        if self.full_grad is None:
            return
        if self.reduction is Reduction.SCATTER_AND_FREE:
            self._free_full()
            return
        # persistent: keep the allocation; the next gradients overwrite it
        for i in range(len(self.flat.slots)):
            self._bound[i] = False
            if keep_touched and self.touched[i] and self.reduction is Reduction.ALL_REDUCE:
                self._zero_slot(i)  # stage 0: a zero .grad, as torch and DDP leave it
        if keep_touched and self.reduction is Reduction.ALL_REDUCE:
            self._zeroed_version = self.full_grad._version

    def zero_slots(self, slots: list[int], *, keep_touched: bool = False) -> None:
        """Zero the gradients of ``slots`` only, keeping the others' (one optimizer's
        ``zero_grad`` on a bucket that another optimizer's parameters share: torch's leaves
        theirs). The same on every rank; the memory stays (``zero`` frees it)."""
        if self._reduce is not None:
            self.finish()  # the other slots' reduced values are wanted
        # The other slots' edits through .grad since the reduction (a clip over the model) are
        # what the step takes: adopted before the zeros, which become the new reference (the
        # edits were lost: an unclipped step, 800x DDP's).
        if self.shard_grad is not None:
            self.adopt_edits()
        pieces = self.flat.pieces()
        for i in slots:
            if self.shard_grad is not None:
                self.shard_grad[pieces[i][1]].zero_()
            if self.full_grad is not None:
                self._view(i).zero_()
            if self._acc is not None:
                self._view(i, self._acc).zero_()
            if not self.as_views or not self._bound[i]:
                self.flat.slots[i].param.grad = None  # autograd's own, not a view of ours
            if not keep_touched:
                self.touched[i] = False
        if self._shown_version is not None and self.full_grad is not None:
            self._note_shown(aliased=False)  # these zeros are not a user's edit
        self._dropped.update(slots)
        self._arrived.difference_update(slots)
        for i in slots:
            self._parked.pop(i, None)
        self.zeroings += 1
        if len(self._dropped) == len(self.flat.slots):
            self.found_inf.zero_()
        if self.on_zero is not None:
            self.on_zero(self, slots)

    def _zero_slot(self, i: int) -> None:
        """Slot ``i``'s ``.grad``: its region of ``full_grad``, zeroed; autograd adds to it."""
        view = self._view(i).zero_()
        self.flat.slots[i].param.grad, self._bound[i] = view, True


def unscale(reduced: torch.Tensor, divisor: float, found_inf: torch.Tensor) -> None:
    """Divide ``reduced`` (1D, the master dtype) by ``divisor`` in place and set ``found_inf``
    ((1,) FP32) to 1 where it holds inf/NaN: torch's fused pass, whose inverse is FP32; a
    float64 master divides in float64 (an FP32 inverse of 1/3 or 1/6 would cost it all but
    FP32's precision)."""
    if reduced.dtype != torch.float64:
        inv = torch.full((1,), 1.0 / divisor, dtype=torch.float32, device=reduced.device)
        torch._amp_foreach_non_finite_check_and_unscale_([reduced], found_inf, inv)
        return
    found_inf.copy_(torch.maximum(found_inf, (~reduced.isfinite()).any().to(found_inf.dtype)))
    reduced.div_(divisor)
