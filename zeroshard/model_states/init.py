"""Model states at ``shard()`` time: deferred (meta-device) initialization, one unit at a time, and
the check that every rank built the same model.

A model built under ``torch.device("meta")`` has parameters without storage. ``shard`` calls the
``Materializer`` for each FlatParam just before building it: the modules that register those
parameters get real, empty storage on the rank's device (``torch.utils.swap_tensors``, so tied
parameters stay one object) and are initialized by ``param_init_fn(module)`` or their own
``reset_parameters()``. The FlatParam then keeps this rank's shard and the module's tensors are
replaced by views, so at most one unit (or one bucket) is ever materialized in full.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zeroshard import collectives as C
from zeroshard.mesh import Mesh

META = torch.device("meta")


class Materializer:
    """Gives meta-device parameters real storage and initial values, module by module."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        param_init_fn: Callable[[nn.Module], None] | None,
    ) -> None:
        self.device, self.param_init_fn = device, param_init_fn
        self._owners: dict[int, nn.Module] = {}  # id(param) -> first registering module
        self._done: set[int] = set()  # id(param) of parameters initialized here
        self._ancestors: dict[int, list[nn.Module]] = {}  # id(module) -> parents, nearest first
        # A buffer registered in several modules (a tie) is made once and checked at its first
        # owner's init (id -> (the meta tensor, kept alive so that its id stays its, the real)).
        self._buffer_owners: dict[int, nn.Module] = {}
        self._buffers_made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._unchecked: list[tuple[nn.Module, str]] = []  # parameters made, checked at the end
        by_name = dict(model.named_modules())
        self._names = {id(m): name for name, m in by_name.items()}  # for the errors
        # RNNs registering each parameter: their weakrefs to it must go around a swap by another
        # module (a tie's owner), and be made again after.
        self._rnns: dict[int, list[nn.RNNBase]] = {}
        for name, module in by_name.items():
            for p in module.parameters(recurse=False):
                self._owners.setdefault(id(p), module)
                if isinstance(module, nn.RNNBase):
                    self._rnns.setdefault(id(p), []).append(module)
            for b in module.buffers(recurse=False):
                self._buffer_owners.setdefault(id(b), module)
            parts = name.split(".") if name else []
            self._ancestors[id(module)] = [
                by_name[".".join(parts[:i])] for i in range(len(parts) - 1, -1, -1)
            ]

    def __call__(self, params: list[nn.Parameter]) -> None:
        """Materialize and initialize every module registering one of ``params`` on meta; then,
        with a model's own ``_init_weights``, its ancestors (``_init_ancestors``)."""
        if not any(p.device == META for p in params):
            return
        modules = list(dict.fromkeys(self._owners[id(p)] for p in params if p.device == META))
        # Children first, as torch's constructors and ``model.apply`` run: a parent's rule on a
        # child's parameter (MultiheadAttention's zero ``out_proj.bias``) is the one that stays.
        modules.sort(key=lambda m: -len(self._ancestors[id(m)]))
        fresh = {id(p) for m in modules for p in m.parameters(recurse=False)} - self._done
        mine = {id(m) for m in modules}
        for module in modules:
            self._init_module(module, fresh, mine)
        if _applies_to_any_module(self.param_init_fn):
            self._init_ancestors(modules, fresh)
        self._check_params_set()

    def _check_params_set(self) -> None:
        """The parameters just made all hold values (they start as NaN): one that neither the
        module's init nor an ancestor's set kept the memory it was given (garbage, trained on)."""
        unchecked, self._unchecked = self._unchecked, []
        for module, name in unchecked:
            if _still_unset(module._parameters[name]):
                where = ".".join(filter(None, (self._names.get(id(module)), name)))
                raise ValueError(
                    f"{type(module).__name__}'s parameter {where!r} was built on the meta device "
                    "and its initialization (reset_parameters() or param_init_fn) did not set "
                    "it (all of it): it would hold garbage; set it there (e.g. in a "
                    "reset_parameters() of that module, or a param_init_fn that calls the "
                    "model's own and then sets it), or build the model on a real device "
                    "(zeroshard train: drop --meta-init)"
                )

    def _init_ancestors(self, modules: list[nn.Module], fresh: set[int]) -> None:
        """``param_init_fn`` on every ancestor of ``modules``, nearest first (the order of
        ``model.apply``, which Hugging Face's ``post_init`` uses: a parent's rule overrides its
        children's, e.g. GPT-2's ``c_proj`` scaled by its attention block, T5's attention
        weights set by ``T5Attention``), seeing only the ``fresh`` parameters (ids) just
        materialized: every other parameter and buffer of its subtree is a meta stand-in for
        the call, so writes to units built before or after are no-ops."""
        chain = {id(a): a for m in modules for a in self._ancestors[id(m)]}
        depth = {id(a): len(self._ancestors[id(a)]) for a in chain.values()}
        before = [(m, dict(m._parameters)) for m in modules]
        mine = {id(m) for m in modules}
        for ancestor in sorted(chain.values(), key=lambda a: -depth[id(a)]):
            hidden = _stand_ins(ancestor, fresh, mine)
            try:
                with torch.no_grad(), _EmptiesMarkedUnset():
                    self.param_init_fn(ancestor)
            finally:
                _restore(hidden)
            for m, params in before:
                _check_kept(m, params)

    def _init_module(
        self, module: nn.Module, fresh: set[int] | None = None, mine: set[int] | None = None
    ) -> None:
        """Materialize ``module``'s own meta tensors and run its init, which sees as real only
        the ``fresh`` parameters (ids; by default its own) and the buffers of ``mine``
        (modules' ids): a rule that writes a child built in another unit (CLIP's
        ``_init_child_weight``, DistilBERT's sinusoidal table, run again for the parent's
        buffer) writes a meta stand-in, not the child's sharded storage (refused at stage 3,
        drawn anew after sharding at stages 0-2)."""
        rnn = isinstance(module, nn.RNNBase)
        if rnn:  # its weakrefs to its weights make swap_tensors refuse them: remade below
            module._flat_weight_refs = []
        needed = False  # (a module of zero-size tensors only has nothing to initialize)
        # A tied parameter is made and initialized by its owner (its first registering module)
        # alone: a deeper module sharing it, run first, would apply its own rule to it.
        others = {
            n for n, p in module._parameters.items()
            if p is not None and p.device == META and self._owners.get(id(p), module) is not module
        }  # fmt: skip
        for name, p in module._parameters.items():
            if p is not None and p.device == META and name not in others:
                new = nn.Parameter(_unset(p, self.device), p.requires_grad)
                tied_rnns = [m for m in self._rnns.get(id(p), []) if m is not module]
                for m in tied_rnns:
                    m._flat_weight_refs = []
                torch.utils.swap_tensors(p, new)  # same object: ties and optimizer refs hold
                for m in tied_rnns:
                    m._init_flat_weights()
                self._unchecked.append((module, name))
                needed |= p.numel() > 0
        if rnn:
            module._init_flat_weights()
        made = []
        for name, b in module.named_buffers(recurse=False):
            if b.device == META:
                key = id(b)
                real = self._buffers_made.setdefault(key, (b, _unset(b, self.device)))[1]
                module._buffers[name] = real
                if self._buffer_owners.get(key, module) is module:
                    made.append(name)
                    needed |= b.numel() > 0
        # A parameter this module shares with a unit built before was initialized (and sharded)
        # with it, or is its owner's to make: the init below runs on a scratch stand-in, so it
        # is initialized once only, by its owner.
        done = {
            n: p
            for n, p in module._parameters.items()
            if p is not None and (id(p) in self._done or n in others)
        }
        for name, p in done.items():
            scratch = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            module._parameters[name] = nn.Parameter(scratch, p.requires_grad)
        before = dict(module._parameters)
        seen = (fresh or set()) | {id(p) for p in before.values() if p is not None}
        hidden = _stand_ins(module, seen, mine or {id(module)}) if needed else []
        try:
            if needed:
                self._run_init(module)
            _check_kept(module, before)
        finally:
            _restore(hidden)
            module._parameters.update(done)
        self._done.update(
            id(p) for n, p in module._parameters.items() if p is not None and n not in others
        )
        unset = [n for n in made if _still_unset(module._buffers[n])]
        if unset:
            where = ".".join(filter(None, (self._names.get(id(module)), unset[0])))
            raise ValueError(
                f"{type(module).__name__}'s buffer {where!r} was built on the meta device and "
                "its initialization (reset_parameters() or param_init_fn) did not set it: it "
                "would hold garbage; set buffers there too, or build the model on a real device "
                "(zeroshard train: drop --meta-init)"
            )

    def _run_init(self, module: nn.Module) -> None:
        with torch.no_grad():
            if self.param_init_fn is not None:
                with _EmptiesMarkedUnset():
                    self.param_init_fn(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            else:
                raise ValueError(
                    f"{type(module).__name__} was built on the meta device and has no "
                    "reset_parameters(); give it one that initializes its own parameters and "
                    "buffers in place, or pass shard(..., param_init_fn=fn) with such an "
                    "fn(module) (e.g. a Hugging Face model's _init_weights), or build the model "
                    "on a real device (zeroshard train: drop --meta-init)"
                )

    def leftovers(self, model: nn.Module) -> None:
        """Materialize what no FlatParam took: zero-element parameters, buffers of modules
        without parameters."""
        for module in model.modules():
            on_meta = any(t.device == META for t in module.parameters(recurse=False)) or any(
                t.device == META for t in module.buffers(recurse=False)
            )
            if on_meta:
                self._init_module(module)
        self._check_params_set()


def _applies_to_any_module(fn: Callable[[nn.Module], None] | None) -> bool:
    """Whether ``fn`` is a model's own ``_init_weights`` (Hugging Face's convention, bound to
    the model): written for ``model.apply``, it takes any module and sets what it owns or
    names, so its ancestors' rules can run too. Another ``param_init_fn`` is called on the
    modules registering parameters only, as before (one written for leaves, or FSDP1's
    ``to_empty`` then ``reset_parameters``, would break or wipe values on a container)."""
    return (
        inspect.ismethod(fn)
        and fn.__name__ == "_init_weights"
        and isinstance(fn.__self__, nn.Module)
    )


def _stand_ins(
    root: nn.Module, fresh: set[int], mine: set[int]
) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """Replace, in ``root``'s subtree, every parameter not in ``fresh`` (ids) and the buffers of
    modules not in ``mine`` (ids) by meta tensors of their shape; what was replaced, to put
    back."""
    hidden = []
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in fresh:
                hidden.append((module, "_parameters", name, p))
                module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=META), p.requires_grad
                )
        if id(module) not in mine:
            for name, b in module._buffers.items():
                if b is not None:
                    hidden.append((module, "_buffers", name, b))
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=META)
    return hidden


def _restore(hidden: list[tuple[nn.Module, str, str, torch.Tensor]]) -> None:
    for module, kind, name, value in hidden:
        getattr(module, kind)[name] = value


def _check_kept(module: nn.Module, before: dict[str, nn.Parameter | None]) -> None:
    """A ValueError when the initialization replaced a parameter object instead of writing it:
    the engine shards the one the model was built with (the new one would train unsharded,
    different on every rank, and the optimizer would not find it)."""
    for name, p in before.items():
        if module._parameters.get(name) is not p:
            raise ValueError(
                f"the initialization of {type(module).__name__} (param_init_fn or "
                f"reset_parameters()) replaced its parameter {name!r} with a new object; the "
                "engine shards the one the model was built with. Initialize it in place "
                "(torch.nn.init functions, or p.copy_(...) / p.normal_(...) under "
                "torch.no_grad()), not by assigning a new nn.Parameter"
            )


def _unset(b: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's real storage before its module's init: NaN (floating), the dtype's minimum
    (integers), alternating True and False (bool), so that ``_still_unset`` sees one the init
    did not write (bool buffers kept whatever memory held: a causal mask, wrong at random)."""
    return _mark_unset(torch.empty_like(b, device=device))


class _EmptiesMarkedUnset(TorchDispatchMode):
    """Memory an init allocates without values (``torch.empty``, ``empty_like``: FSDP1's habit
    of ``module.to_empty(...)`` in a ``param_init_fn``, which swaps our marked storage for new)
    gets ``_unset``'s marks, so that a parameter the init then leaves is refused on every rank
    alike; it held whatever memory held, trained on or refused at random, rank by rank."""

    _EMPTIES = frozenset(
        {
            torch.ops.aten.empty.memory_format,
            torch.ops.aten.empty_like.default,
            torch.ops.aten.empty_strided.default,
            torch.ops.aten.new_empty.default,
            torch.ops.aten.new_empty_strided.default,
        }
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._EMPTIES and isinstance(out, torch.Tensor) and out.device != META:
            _mark_unset(out)
        return out


def _mark_unset(out: torch.Tensor) -> torch.Tensor:
    """``out`` filled with ``_unset``'s marks for its dtype."""
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    if out.dtype == torch.bool:
        return out.copy_(_alternating(out))
    return out.fill_(torch.iinfo(out.dtype).min)


def _alternating(b: torch.Tensor) -> torch.Tensor:
    return (torch.arange(b.numel(), device=b.device) % 2 == 0).view(b.shape)


def _still_unset(b: torch.Tensor) -> bool:
    if b.numel() == 0:
        return False
    if b.dtype == torch.bool:  # (one element cannot tell: True may be what the init set)
        return b.numel() > 1 and torch.equal(b, _alternating(b))
    if b.is_floating_point() or b.is_complex():
        return bool(torch.isnan(b).any())
    return bool((b == torch.iinfo(b.dtype).min).all())


def fingerprint(model: nn.Module) -> int:
    """A 63-bit hash of every parameter's and buffer's name, shape, dtype and requires_grad."""
    h = hashlib.sha256()
    for name, p in model.named_parameters(remove_duplicate=False):
        h.update(f"p {name} {tuple(p.shape)} {p.dtype} {p.requires_grad};".encode())
    for name, b in model.named_buffers(remove_duplicate=False):
        h.update(f"b {name} {tuple(b.shape)} {b.dtype};".encode())
    return _as_int(h)


def check_same_model(
    model: nn.Module, mesh: Mesh, settings: dict[str, str] | None = None, call: str = "shard"
) -> None:
    """A ValueError, on every rank, when the ranks' models differ in structure (names, shapes,
    dtypes, requires_grad), or their sharding ``settings`` (name -> a text of its value: the
    stage, the units, mixed precision, ...) differ: sharding them would hang, abort inside the
    backend, or pair one rank's gather of a unit with another's of a unit of the same size and
    train on mixed-up weights without a word (``call``: the function given them, for the
    message). One all-gather of a hash per entry."""
    if mesh.world_size == 1:
        return
    settings = settings or {}
    names = ["model", *settings]
    hashes = [fingerprint(model), *(_hash(v) for v in settings.values())]
    mine = torch.tensor(hashes, dtype=torch.int64, device=mesh.device)
    every = torch.empty(mesh.world_size * len(names), dtype=torch.int64, device=mesh.device)
    C.all_gather(
        every, mine, group=mesh.group, ledger=C.Ledger(), label="fingerprint", async_op=False
    )
    rows = every.view(mesh.world_size, len(names)).tolist()
    differ = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]
    if differ:
        raise ValueError(
            f"the model differs across ranks: ranks {differ} have other parameter or buffer "
            "names, shapes, dtypes or requires_grad than rank 0; build the same model on every "
            "rank before zeroshard.shard()"
        )
    for i, name in enumerate(names[1:], start=1):
        differ = [r for r, row in enumerate(rows) if row[i] != rows[0][i]]
        if differ:
            raise ValueError(
                f"zeroshard.{call}() was called with another {name} on ranks {differ} than on "
                f"rank 0 (rank {mesh.rank}: {_short(settings[name])}); pass the same on every "
                "rank"
            )


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _hash(text: str) -> int:
    return _as_int(hashlib.sha256(text.encode()))


def _as_int(h: hashlib._Hash) -> int:
    """A digest as a non-negative 63-bit int (an int64 tensor element on every rank)."""
    return int.from_bytes(h.digest()[:8], "little") >> 1
