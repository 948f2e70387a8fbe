"""The stage-agnostic schedule: gather / free around each use of a unit, gradient reduction once
autograd is done with the unit, prefetch of the next unit, the refresh of replicated parameters
after a step. What a stage does comes from ``zeroshard.stages``; nothing here branches on the
stage number. ``zeroshard.sharding.shard`` builds the units and installs an ``Engine``.

Per use of a unit U (``TrainingState`` says what is alive in each state):

    forward:   pre-forward   gather U (wait for its prefetch),
                             prefetch the next unit of the last forward's order, count the use
               post-forward  free U (partitioned parameters; the root may keep its own)
    backward:  pre-backward  gather U again, ready its gradient bucket, prefetch
               post-backward the last pending use of U done: reduce its bucket (once all the
                             bucket's units are done), free U
    end of backward          finish units no hook finished, wait for every reduction

A unit may be used any number of times per forward, and forwards may repeat before a backward:
uses are counted (``unit.Use``); a recomputation in backward (activation checkpointing) is a new use
only when the first forward ran without grad (reentrant checkpointing). What is gathered ahead
(prefetch) and freed early (a unit recomputed before its backward) is ``zeroshard.prefetch``'s;
the backward's half of the schedule is ``zeroshard.backward``'s.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import backward, call_frames, model_checks, module_buffers, prefetch, unwind
from zeroshard import collectives as C
from zeroshard.autograd_hooks import in_backward, on_backward, when_backward_reaches
from zeroshard.loss_scaling import GradScaling
from zeroshard.mesh import Mesh
from zeroshard.model_states import flat_param, param_checks
from zeroshard.model_states.grads import GradBucket
from zeroshard.model_states.reduction_order import ReductionOrder
from zeroshard.module_hooks import install, ran_before
from zeroshard.offload import OffloadError
from zeroshard.precision import MixedPrecision
from zeroshard.residual_states import host_heap
from zeroshard.residual_states.activations import SpanCheckpointing
from zeroshard.residual_states.partitioned import CheckpointKeeper
from zeroshard.shard_config import ShardConfig
from zeroshard.signals import grad_off
from zeroshard.stages import partition
from zeroshard.trees import cast_floats, tensors_reached
from zeroshard.unit import Phase, TrainingState, Unit, Use

if TYPE_CHECKING:
    from zeroshard.model_states.param_swap import ParamSwapper
    from zeroshard.residual_states.buffers import BufferPool

_ATTR, SHARDED_PARAM = "_zeroshard_engine", "_zeroshard_sharded"
"""The sharded model's attribute; each of its parameters' (sharding a part again is refused)."""


_THREADS = threading.Lock()
"""Makes ``Engine.check_thread``'s check and claim one step."""


class Engine(backward.Backward, unwind.Unwinding, prefetch.Prefetching):
    """Per-model state of zeroshard: the units, the stage's partition and the schedule."""

    def __init__(
        self,
        model: nn.Module,
        unit_list: list[Unit],
        *,
        mesh: Mesh,
        stage: int,
        config: ShardConfig,
        mixed_precision: MixedPrecision,
        ledger: C.Ledger,
        scaling: GradScaling,
        checkpoint_keeper: CheckpointKeeper | None = None,
    ) -> None:
        """``checkpoint_keeper``: with activation checkpointing, where span inputs are kept
        (``sharding._checkpoint_keeper``); None without it."""
        self.model, self.units, self.mesh = model, unit_list, mesh
        self._job = weakref.ref(dist.distributed_c10d._get_default_group())
        """The default process group the model was sharded in: its groups live and die with it."""
        self.scaling = scaling  # shared with every bucket: the loss scale, found inf/NaN
        self.stage, self.partition = stage, partition(stage)
        self.config, self.mixed_precision, self.ledger = config, mixed_precision, ledger
        self.phase, self.sync_grads = Phase.IDLE, True
        self.ending_forward = False
        """The root's forward is over for the user's forward hooks, which run now: one that
        raises makes ``_forward_raised`` free what the forward held."""
        self.step_thread: threading.Thread | None = None
        """The thread whose forward ran last; while its step is open (a forward running, or
        its backward to come or running) another thread's use of the model is an error."""
        self._claiming: threading.Thread | None = None  # its forward begun, its phase not yet
        self._backward_due = False  # the last root forward's outputs require grad
        self._forward_call: int | None = None  # the root's running call (call_frames.current)
        self._arrivals_at: int | None = None  # gradients made before the running backward began
        self._partial = False  # a backward that raised had made gradients (``unwind``)
        self._zeroed_by: set[int] = set()  # optimizers that dropped their part of those since
        self.forward_order: list[Unit] = []  # last forward's units, first use first
        self._recording: dict[Unit, None] | None = None  # this one's (not summoned), in order
        self._pending: deque[GradBucket] = deque()  # reductions in flight, oldest first
        # Every FlatParam and bucket once, in unit order (units may share them at stages 0-2).
        self.flat_params = list(dict.fromkeys(f for u in unit_list for f in u.flat_params))
        self.buckets = list(dict.fromkeys(b for u in unit_list for b in u.buckets))
        self._pools = list({id(f.buffers): f.buffers for f in self.flat_params}.values())
        # The parameters shard() flattened (ids): one added later trains apart per rank (said
        # once, ``model_checks.added_parameters``; None once said).
        self._known_params: set[int] | None = {
            id(s.param) for f in self.flat_params for s in f.slots
        }
        self._registrations = -1  # ``model_checks.registrations()`` at the last look
        self._units_left: dict[GradBucket, int] = {}  # per backward: units yet to finish
        self._again: set[Unit] = set()  # per backward: units finished, then reached again
        self._dirty: dict[GradBucket, None] = {}  # their buckets, to reduce once more at the end
        self._no_grads = False  # per backward: it makes no parameter's gradient (_makes_grads)
        self._held: list[GradBucket] = []  # buckets ready meanwhile, reduced if one comes
        self._unbound: dict[GradBucket, None] = {}  # and those not bound for it meanwhile
        self._grads_before: list[tuple[int, int] | None] = []  # and ``_own_grads`` at its start
        self.reduction_order = ReductionOrder(self.buckets, in_order=not self.partition.parameters)
        """The one order of every rank's reductions (stages 0-2; stage 3: each at once)."""
        self.summoned = 0  # depth of summon_full_params
        self._window_trained = False  # a training forward since the pools' window began
        self.discarding = 0  # of them, how many undo writes (writeback=False): no step inside
        self.untrusted: str | None = None  # why values are not to be used (checkpoint._load)
        self.to_reload: set[int] = set()  # ids of the model and optimizers that clear it loaded
        self.run_id: str | None = None  # its checkpoints' run (zeroshard.checkpoint: keep)
        self.backward_by: object = None  # the optimizer whose backward() runs, if one does
        _LIVE.add(self)
        self.heap = (
            host_heap.HeapKeeper(config.trim_host_memory)
            if config.trim_host_memory and mesh.device.type == "cpu"
            else None
        )
        """Training on the CPU: returns freed memory when the process grows (``end_step``)."""
        self.param_swap: ParamSwapper | None = None
        """With ``Offload(parameters="nvme")``: the masters on NVMe, read ahead of each gather
        along ``forward_order`` (``zeroshard.model_states.param_swap``; set by ``shard``)."""
        self.checkpointing = checkpoint_keeper and SpanCheckpointing(
            config.checkpoint_every, mesh.device, checkpoint_keeper
        )
        inner = [u for u in unit_list if not u.is_root]
        if self.checkpointing and not inner:
            warnings.warn(
                f"checkpoint_every={config.checkpoint_every} has nothing to checkpoint: the "
                "model is one unit (no wrap policy, or one that matched nothing), and "
                "activation checkpointing (with partitioned or offloaded activations) works on "
                "spans of wrapped units; wrap the model's blocks (wrap=zeroshard.wrap."
                "by_class(Block), zeroshard train --wrap Block)",
                stacklevel=3,
            )
        # Outermost non-root units only: a unit inside another is covered by the outer one.
        nested = {u for u in inner for o in inner if u.name.startswith(o.name + ".")}
        self._checkpointed = set(inner) - nested
        if self.checkpointing:
            for unit in self._checkpointed:
                # A span's recomputation replays its units eagerly (in backward, outside any
                # compiled frame), and must save what their forward saved: under torch.compile
                # a compiled forward saves other tensors (torch's CheckpointError "Recomputed
                # values ... have different metadata"). Checkpointed units run eagerly.
                unit.module.forward = torch._dynamo.disable(unit.module.forward)
        self._handles: list[Any] = []
        for unit in unit_list:
            self._handles += install(self, unit)

    # ----------------------------------------------------------------- queries
    @property
    def root(self) -> Unit:
        return self.units[0]

    # ----------------------------------------------------------------- hooks
    def _pre_lend(self, unit: Unit, owner: nn.Module, args: tuple, kwargs: dict):
        self._after_interrupted_forward()
        self._after_raised_backward()
        backward = in_backward()
        # After its backward, in the same backward: a custom Function's backward that
        # recomputes a layer part by part, each part's own backward in between (reversible
        # layers: Reformer, RevNet) lends the unit again, as a recomputation.
        done = unit.state is TrainingState.POST_BACKWARD and backward
        if unit.lender is not None or (unit.state is not TrainingState.IDLE and not done):
            return None  # inside the unit's own forward, recomputation or backward
        if unit.recomputing and backward:
            return None
        unit.lender, unit.lent_gathered = owner, not unit.is_sharded
        return self._pre_forward(unit, args, kwargs, entry=False)

    def _post_lend(self, unit: Unit, owner: nn.Module, output: Any) -> Any:
        if unit.lender is not owner:
            return None
        unit.lender = None
        return self._post_forward(unit, output, entry=False, keep=unit.lent_gathered)

    def _pre_forward(
        self, unit: Unit, args: tuple, kwargs: dict, *, entry: bool = True
    ) -> tuple[tuple, dict]:
        """Before a use of ``unit``: its module's own call (``entry``) or an owner's (a lend)."""
        model_checks.no_functorch_transform()
        recompute = in_backward()
        root_entry = unit.is_root and entry
        raw_args, raw_kwargs = args, kwargs
        if entry and not recompute:
            self.check_thread(claim=True)
            try:
                if root_entry:
                    self._begin_forward()
                else:
                    self._after_interrupted_forward()  # (a Ctrl-C'd forward, then a block alone)
                    if self.phase is not Phase.FORWARD:
                        self._after_interrupted_call(unit)
                        self._begin_alone(unit)
            finally:
                self._claiming = None  # (the phase says from here whether a step is open)
        edits, call = None, None
        if entry:  # the inputs' containers edited in place: undone by ``_leave``
            if not recompute and unit.state is not TrainingState.FORWARD:
                unwind.undo_calls([unit])  # an outer call: a Ctrl-C's leftovers (no hook of it ran)
            edits = []
            call = [edits, None, {}, next(_CALLS)]  # (edits, the inputs given, their tensors
            unit.edits.append(call)  # by id, the order of the calls)
        if entry and not recompute:  # (a recomputation may stop before its end: not counted)
            unit.depth = unit.depth + 1 if unit.state is TrainingState.FORWARD else 1
        elif entry:  # (as depth, by its calls: a reentrant checkpoint's runs whole, `_leave`)
            unit.recomputing += 1
        if entry and unit.lending is not None and not unit.is_root:
            # No lend inside its own call; `_leave` attaches them again. (The root's stay: a
            # Ctrl-C in a forward runs no `_leave`, and a layer of the root called on its own
            # after it must still find its hooks, which clean up the interrupted forward.)
            unit.lending.detach()
        if self._recording is not None and not recompute:
            self._recording[unit] = None
        unit.unshard(async_op=False)
        unit.wait_unshard()
        if self.partition.parameters and not recompute:
            self._prefetch(self.forward_order, unit)
        if unit.state is TrainingState.IDLE and not recompute:
            unit.to(TrainingState.FORWARD)
        mp = unit.precision  # the model's policy, or one of its own (shard's unit_precision)
        cast = mp.cast_root_inputs if unit.is_root else mp.cast_forward_inputs
        if entry and cast and mp.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype, edits)
        # A recomputation is a use of its own only when the first forward counted none: the
        # reentrant checkpoint runs that one without grad, then backward through the recomputed
        # graph (a non-reentrant one refills saved tensors of the first forward's graph).
        unit.recompute_use = (
            recompute
            and unit.pending_uses == 0
            and unit.state in (TrainingState.IDLE, TrainingState.POST_BACKWARD)
        )
        if torch.is_grad_enabled() and (not recompute or unit.recompute_use):
            # A use whose inputs need no gradient cannot report its end: the count then stays
            # above 0 and the end-of-backward callback finishes the unit.
            use = Use(self, unit)
            # The positional inputs alone when one needs grad: a reentrant checkpoint inside
            # the unit (transformers' GradientCheckpointingLayer) detaches those and backprops
            # through what it closed over (a keyword's tensor, DeBERTa's rel_embeddings), which
            # then walked a node shared with them twice: "backward through the graph a second
            # time" (FSDP2's too). Autograd runs the hook's node after the unit's own (created
            # later), so it still fires once the unit's backward for this use is done.
            hooked = False
            # A unit without parameters (unit_precision's GELU) only casts: its backward has
            # nothing to reduce, and a view of its input refused an in-place one (ReLU(inplace=
            # True): "Output 0 of BackwardHook is a view and is being modified inplace").
            if unit.flat_params or unit.is_root:
                args, hooked = on_backward(use, args, edits)
                if not hooked:  # (nothing changed, nothing recorded in edits)
                    (args, kwargs), hooked = on_backward(use, (args, kwargs), edits)
            use.counted = hooked
            unit.pending_uses += 1  # an unhooked use stays counted until the end of backward
            ckpt = self.checkpointing is not None and entry and unit in self._checkpointed
            if ckpt and not recompute:
                self.checkpointing.enter(
                    unit.module, raw_args, raw_kwargs, ran_before(unit), given=(args, kwargs)
                )
            if call is not None and not recompute:
                call[1:3] = [(args, kwargs), {id(t): t for t in tensors_reached((args, kwargs))}]
        return args, kwargs

    def _end_root_forward(self, output: Any) -> Any:
        """The root's first forward hook, in front of the user's: the forward is over for
        them (idle units, its order recorded: ``summon_full_params`` may be entered there), and
        they see the output in the policy's ``output_dtype``. The root's reshard and the
        backward's hook on the output come after theirs (``_post_forward``)."""
        root = self.root
        if in_backward() or root.depth > 1:
            return output  # (a call of the root inside its own goes on with its output)
        if root.state is TrainingState.FORWARD:
            root.to(TrainingState.IDLE)
        self.phase, self.ending_forward = Phase.IDLE, True  # (until ``_post_forward``)
        if self._recording is not None:
            self.forward_order, self._recording = list(self._recording), None
            self._free_unused_prefetches()
        out_dtype = self.mixed_precision.output_dtype
        return output if out_dtype is None else cast_floats(output, out_dtype)

    @staticmethod
    def _side_outputs(unit: Unit) -> list[torch.Tensor]:
        """Tensors with a graph that the call running put into its inputs' containers (an aux
        loss appended to the caller's list): outputs too, whose backward needs the unit."""
        inputs, seen = unit.edits[-1][1:3] if unit.edits else (None, {})
        if inputs is None:
            return []
        added = (t for t in tensors_reached(inputs) if seen.get(id(t)) is not t)
        return [t for t in added if t.grad_fn is not None]

    def _stop_dropping(self, module: nn.Module) -> None:
        if self.checkpointing is not None and not in_backward():
            self.checkpointing.exit(module)

    def _post_forward(
        self, unit: Unit, output: Any, *, entry: bool = True, keep: bool = False
    ) -> Any:
        if entry and unit.depth > 1 and not in_backward():
            return output  # called inside its own call, which goes on with it
        own = unit.precision  # unit_precision's: outputs back to the model's dtype, recomputed too
        if entry and not unit.is_root and own is not self.mixed_precision and own.output_dtype:
            output = cast_floats(output, own.output_dtype)
        if in_backward():  # a recomputation
            if unit.recompute_use and torch.is_grad_enabled():
                unit.recompute_use = False
                when_backward_reaches(self._when_reached(unit), output)
            if self._free_after_recompute(unit):
                output = unit.unalias(output)
                unit.reshard()
            return output
        if unit.state is TrainingState.FORWARD:
            unit.to(TrainingState.IDLE)
        grad = torch.is_grad_enabled()
        root_entry = unit.is_root and entry
        # The root stays gathered for its backward, which comes right after; not when nothing
        # of it trains and no output requires grad (a frozen reference model): none comes.
        backward_due = root_entry and grad and any(t.requires_grad for t in tensors_reached(output))
        keep = keep or (root_entry and grad and not self.config.reshard_root_after_forward and (
            any(f.requires_grad for f in unit.flat_params) or backward_due))  # fmt: skip
        if (root_entry or not keep) and not self.summoned:  # (the root reshards after backward)
            output = unit.unalias(output)
        if not keep and not self.summoned:
            unit.reshard(adopt=True)
        if root_entry:  # (the phase and the order: ``_end_root_forward``, before the user's)
            self._backward_due, self.ending_forward = backward_due, False
        if grad:
            reached = (output, self._side_outputs(unit)) if entry else output
            when_backward_reaches(self._when_reached(unit), reached)
        if self.checkpointing is not None:
            if root_entry:
                self.checkpointing.close()
            elif entry and unit in self._checkpointed:
                self.checkpointing.note_output(unit.module, output)
        return output

    def check_thread(self, *, claim: bool = False) -> None:
        """A RuntimeError when another thread's step is open (units are per model, not per
        thread: an evaluation in a second thread moved them under the training thread's backward,
        which failed inside, or trained on mixed-up weights). ``claim``: a forward of this thread
        begins. A backward is not checked: autograd runs it in threads of its own."""
        me = threading.current_thread()
        if self.step_thread is me and (self.phase is not Phase.IDLE or not claim):
            return  # (every unit's entry asks: no lock for the thread of the step)
        with _THREADS:
            owner = self.step_thread  # (a thread that ended holds no step open)
            other = owner is not None and owner is not me and owner.is_alive()
            # (a forward claimed, its phase not set yet: another thread let in there ran
            # beside it, on weights the first one moved)
            busy = self.phase is not Phase.IDLE or self._backward_due or self._claiming is owner
            if other and busy:
                raise RuntimeError(
                    f"the sharded model is in the middle of a step of another thread "
                    f"({owner.name}: a forward running, or the backward of its forward "
                    "to come): a sharded model runs one forward and backward at a time. "
                    "Evaluate in the training thread between steps (or in another process); "
                    "a forward whose backward never comes runs under torch.no_grad()"
                )
            if claim:
                self.step_thread = self._claiming = me

    def _begin_forward(self) -> None:
        model_checks.not_wrapped(self.model)
        running = call_frames.running(self._forward_call, self.model, besides_current=True)
        if self.phase is Phase.FORWARD and not running:
            self._forward_raised()  # the last one was interrupted (Ctrl-C): no hook of it ran
        self._forward_call = call_frames.current(self.model)
        self.ending_forward = False  # (a Ctrl-C's leftover in the last one's hooks)
        if torch.is_grad_enabled():  # (a model frozen whole for inference is fine)
            param_checks.check_requires_grad(self.flat_params)
        self.check_trusted()
        self.adopt_writes()  # (parameters replaced are an error before they count as added)
        module_buffers.check_filled(self.model)  # (a load fills them: not before one)
        if torch.is_grad_enabled():
            seen = model_checks.registrations()  # (a walk only after a registration)
            if (
                self._known_params is not None
                and seen != self._registrations
                and not call_frames.in_functional_call()  # (its tensors stand in for a call)
            ):
                self._registrations = seen
                if model_checks.added_parameters(self.model, self._known_params):
                    self._known_params = None  # (said once)
        # The last step's use of gather buffers is the next one's: a window ends as a training
        # forward starts (an evaluation's, without backward, would tell the pool to free what
        # the next step needs), or any forward where none trained since (inference alone).
        if torch.is_grad_enabled() or not self._window_trained:
            for pool in self.buffer_pools():
                pool.settle()
        self._window_trained = torch.is_grad_enabled()
        self.phase = Phase.FORWARD
        if self.checkpointing is not None:
            self.checkpointing.close()
        self._recording = None if self.summoned else {}  # (rank 0's generate() there alone)
        self._clean_after_backward()

    def buffer_pools(self) -> list[BufferPool]:
        """The constant buffers stage 3's gathered units borrow (one pool per model; below
        stage 3 a pool that keeps nothing), free ones included: memory trackers are given
        their ``tensors()``. (Read at every unit's backward: made once, with the units.)"""
        return list(self._pools)

    def _begin_alone(self, unit: Unit) -> None:
        """A unit entered with no root forward running (a submodule called on its own: T5's
        encoder in ``generate()``, a loop over blocks): the root's checks of its parameters,
        which ``_begin_forward`` would have made (a ``requires_grad`` switched since
        ``shard()``; a write to them adopted into the masters)."""
        self._after_raised_backward()
        if unit.state is not TrainingState.IDLE:
            return
        module_buffers.check_filled(self.model)
        if torch.is_grad_enabled():
            param_checks.check_requires_grad(unit.flat_params)
        self.check_trusted()
        self.adopt_writes(unit.flat_params)

    # ----------------------------------------------------------------- after a step
    def end_step(self) -> None:
        """After an optimizer step (taken or skipped): close the ledger's step; on the CPU, return
        freed memory to the system if the process grew (``zeroshard.residual_states.host_heap``)."""
        self.ledger.end_step()
        if self.heap is not None:
            self.heap.after_step()

    def forget_order(self) -> None:
        """After the ranks ran units in different orders (``agreed``): the ledger's digest
        restarts, and no prefetch follows this rank's own last forward order (it differs)."""
        self.ledger.order = 0
        self.forward_order = []

    def params_changed(self, flats: Collection[flat_param.FlatParam] | None = None) -> None:
        """The FP32 masters of ``flats`` (None: all; a step's: not frozen ones) changed (a step,
        a load): refresh replicated parameters, waited for here: code between ``step()`` and
        the next forward (an EMA, an in-place write) must see the new values."""
        if self.param_swap is not None:
            self.param_swap.params_changed()  # write changed masters, drop held ones
            if not self.summoned:
                self._read_masters_ahead(self.forward_order, root=True)  # the next forward's
        changed = self.flat_params if flats is None else [f for f in self.flat_params if f in flats]
        self._drop_stale_gathers(changed)
        pending = list(zip(changed, [f.refresh_full(async_op=True) for f in changed]))
        interrupted: BaseException | None = None
        while pending:
            f, handle = pending[0]
            try:
                if handle is not None:
                    handle.wait()
                elif self.summoned:
                    f.regather()  # held gathered by summon_full_params: keep its views current
            except Exception:  # a failed collective: the group is broken
                raise
            except BaseException as exc:  # a Ctrl-C: every refresh finishes first, so that no
                interrupted = interrupted or exc  # rank's replicas are left behind the others'
                if handle is None:  # a regather, not to be issued twice: its interrupted gather
                    pending.pop(0)  # is finished at the next collective's start (an orphan)
                continue  # (a handle's wait taken up again: waits are idempotent)
            pending.pop(0)
        if interrupted is not None:
            f = handle = None  # (the raised exception's traceback holds this frame: no cycle
            raise interrupted  # keeps the last handle for the garbage collector)

    def _drop_stale_gathers(self, changed: list[flat_param.FlatParam]) -> None:
        """Partitioned units still gathered from masters that have just changed, and used by no
        running pass (prefetched by a backward that raised, then a step): freed, so that their
        next use gathers the new values instead of computing with the old ones. Local (no
        collective): the ranks need not agree on what they hold."""
        if self.summoned or not self.partition.parameters:
            return
        dead = self.phase is Phase.BACKWARD and not in_backward()  # (its end never ran)
        for u in self.units:
            unused = u.state is TrainingState.IDLE or dead
            if unused and u.is_gathered and any(f in changed for f in u.flat_params):
                u.reshard()

    def slots_touched(self) -> torch.Tensor:
        """1D, one FP32 flag per trainable parameter (buckets in order, slots in order): 1 where
        a gradient reached it on this rank since the last ``zero_grad``."""
        flags = [t for b in self.buckets for t in b.touched]
        return torch.tensor(flags, dtype=torch.float32, device=self.mesh.device)

    def check_trusted(self) -> None:
        """Before a forward, a step, a save: the error of a load that failed midway, or of a
        swap of offloaded states that failed (``StopsOnFailure.failed``), if any."""
        if self.untrusted is not None:
            raise RuntimeError(self.untrusted)
        swappers = [self.param_swap]
        swappers += [s for o in self.optimizers for s in (o._swap, o._grad_swap)]
        failed = next((s.failed for s in swappers if s is not None and s.failed), None)
        if failed is not None:
            raise OffloadError(failed)

    def loaded(self, part: object) -> None:
        """``part`` (the model, an optimizer) loaded a whole state: once all that a failed
        load left ``untrusted`` have, it is trusted again."""
        self.to_reload.discard(id(part))
        if not self.to_reload:
            self.untrusted = None

    def in_its_job(self) -> bool:
        """Whether the default process group the model was sharded in is still the running
        one (not destroyed, nor destroyed and replaced by a new one)."""
        if not dist.is_initialized():
            return False
        return dist.distributed_c10d._get_default_group() is self._job()

    def adopt_writes(self, flats: Collection[flat_param.FlatParam] | None = None) -> None:
        """Copy into the masters what was written to replicated parameters that compute in a
        narrower dtype (``nn.init``, ``p.mul_`` under ``no_grad``) since the last call
        (``FlatParam.adopt_writes``): before a forward, a step, a state dict, a save; ``flats``
        alone (a unit entered on its own, a bucket about to step in backward), else all, the
        model's registration checked first."""
        whole = flats is None
        if flats is None:
            if not self.in_its_job():  # (else torch's TypeError in a mesh, or a new job's
                raise RuntimeError(  # ranks gathering its shards in their order, silently)
                    "the process group this model was sharded over is gone "
                    "(dist.destroy_process_group(), then maybe a new group: its ranks are not "
                    "the model's); a sharded model lives in its group: save "
                    "it (zeroshard.checkpoint) before destroying the group, and shard a new "
                    "model in the new one"
                )
            param_checks.check_registered(self.model, self.flat_params)
            flats = self.flat_params
        with grad_off():
            # every flat's views given back before one error is raised (model.half() recovers
            # in one call, not one per unit)
            problem = param_checks.check_views(flats, self.flat_params)
            if whole:  # buffers a conversion replaced, cast back and said with the rest
                problem = module_buffers.restore_after_conversion(self.model, problem)
            if problem is not None:
                raise problem
            for f in flats:
                # Inside summon_full_params with writeback, taken now (a state dict or save
                # inside sees them, and a step starts from them); discarded ones are left.
                f.adopt_writes(keep=not self.discarding)

    # ----------------------------------------------------------------- user controls
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without communicating."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous


_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


def live_engines() -> list[Engine]:
    """Every engine of this process whose model is alive: one loss may reach several sharded
    models (an encoder and a decoder sharded apart, a GAN's discriminator in the generator's
    loss), and an optimizer's backward speaks for all of them."""
    return list(_LIVE)


def engine_of(model: nn.Module) -> Engine:
    """The engine of a model passed through ``shard``; a ValueError otherwise (one naming a
    submodule of a sharded model as such: it was told to call ``shard``, which refuses it)."""
    engine = getattr(model, _ATTR, None)
    if engine is None:
        held = next((n for n, m in model.named_modules() if getattr(m, _ATTR, None)), None)
        part = any(hasattr(p, SHARDED_PARAM) for p in model.parameters())
        raise ValueError(f"{type(model).__name__} " + (
            f"holds a sharded model ({held}); pass the model that zeroshard.shard returned"
            if held is not None
            else "is a part of a sharded model; pass the model that zeroshard.shard returned"
            if part
            else "is not sharded; call zeroshard.shard(model, ...) first"))  # fmt: skip
    return engine


_CALLS = itertools.count()
"""Orders the calls of all units: an inner call's edits are undone before its caller's."""
