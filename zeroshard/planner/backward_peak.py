"""Each unit's backward working bytes, found by running the measured forward's backward on meta
and following what autograd keeps alive, operator by operator.

A unit's backward holds, beside the activations saved up to it, the gradients flowing through it
and those its operators make. How many exist at once depends on its operators: GELU's backward
frees the MLP output its projection saved before it makes its own gradient, ReLU's (which saves
its output, the projection's saved input) cannot, and a gated MLP's product holds three
gradients of its width at once. So the unit's peak is followed rather than assumed:

- a saved storage lives until the last node that saved it has run (``SaveCounts``: saves
  counted in the forward, unpacks in the backward);
- what the backward makes (a gradient, or a temporary inside one node: a custom Function's
  products, an in-place operator's ``CopySlices`` copies) lives as long as autograd holds it,
  seen by a dispatch mode as each storage is made and freed (``_Made``); a parameter's gradient
  (into its ``AccumulateGrad``, or a transpose, view or cast before it) is a model state,
  counted by the timeline apart;
- a node belongs to the unit whose forward created it (autograd's sequence numbers, noted as
  units are entered and left, ``Owners``).

The peak of a unit is taken as each of its nodes' operators ends. All sizes are bytes; nothing
is allocated (meta tensors).
"""

from __future__ import annotations

import bisect


def next_sequence_nr() -> int:
    """The sequence number autograd gives the next node it creates (this thread's)."""
    import torch

    probe = torch.empty((), device="meta", requires_grad=True)
    return probe.mul(1).grad_fn._sequence_nr() + 1


class Owners:
    """Which unit (index, or a negative number for the root) created each autograd node: the
    owner in force when the node's sequence number was drawn."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._owners: list[int] = []

    def now(self, owner: int) -> None:
        """From the next node on, nodes are ``owner``'s."""
        start = next_sequence_nr()
        if self._starts and self._starts[-1] == start:
            self._owners[-1] = owner
        else:
            self._starts.append(start)
            self._owners.append(owner)

    def of(self, node) -> int | None:
        """The owner of ``node`` (``None`` before the first ``now``)."""
        i = bisect.bisect_right(self._starts, node._sequence_nr()) - 1
        return self._owners[i] if i >= 0 else None


class SaveCounts:
    """How many times the forward saved each counted storage, and how many of those saves the
    backward has not unpacked yet."""

    def __init__(self) -> None:
        self.nbytes: dict[int, int] = {}
        self.left: dict[int, int] = {}
        self.done: list[int] = []
        """Storages whose last save was unpacked by the node now running."""
        self.on_unpack = None
        """Called at each unpack (``peaks``: what the backward holds as a unit's first node
        unpacks, the moment a checkpoint's recomputation starts)."""

    def saved(self, key: int, nbytes: int) -> None:
        self.nbytes[key] = nbytes
        self.left[key] = self.left.get(key, 0) + 1

    def unpacked(self, key: int) -> None:
        if self.on_unpack is not None:
            self.on_unpack()
        if key in self.left:
            self.left[key] -= 1
            if self.left[key] == 0:
                self.done.append(key)


def _into_parameters(nodes: list) -> dict:
    """The nodes that pass a gradient on to one parameter alone (its ``AccumulateGrad``, or a
    chain of one-input nodes before it: a weight's transpose, view or cast) -> that parameter's
    elements. A gradient of that many elements flowing into one is the parameter's: a model
    state (an embedding's backward also passes to its weight alone, but gets a gradient of the
    tokens' size, an activation's)."""
    found = {n: n.variable.numel() for n in nodes if hasattr(n, "variable")}
    grown = True
    while grown:  # (a chain joins one node per pass at worst)
        grown = False
        for node in nodes:
            nexts = [n for n, _ in node.next_functions if n is not None]
            if node not in found and len(nexts) == 1 and nexts[0] in found:
                found[node] = found[nexts[0]]
                grown = True
    return found


class _Made:
    """The storages the backward creates (on meta), while they are alive: a dispatch mode that
    notes each operator's new output storages (not aliases of its inputs: views and in-place
    results) and drops them as they are freed. Each operator that ends while a node runs is a
    moment (``on_moment``), so that the temporaries inside one node (an in-place ReLU's
    ``CopySlices`` clone, a custom Function's intermediate products) count as much as the
    gradients between nodes.

    What the engine runs between nodes is no moment: where it sums a second gradient into an
    input's first it adds in place on a device (the first held by it alone), not on meta; a
    parameter's ``AccumulateGrad`` makes a model state."""

    def __init__(self, on_moment) -> None:
        self.alive: dict[int, int] = {}  # serial -> bytes
        self.total = 0
        """Bytes of ``alive``."""
        self.nodes_running = 0
        self._serials = None  # storage -> serial (weak)
        self._next = 0
        self._on_moment = on_moment
        self._mark = 0
        self.since = 0
        """Bytes of ``alive`` made since the last ``mark``."""

    def serial(self, t) -> int | None:
        """The serial of ``t``'s storage if the backward made it."""
        return self._serials.get(t.untyped_storage()) if self._serials is not None else None

    def forget(self, serial: int) -> None:
        """No longer count ``serial`` (a model state, counted apart)."""
        nbytes = self.alive.pop(serial, 0)
        self.total -= nbytes
        if serial >= self._mark:
            self.since -= nbytes

    def mark(self) -> None:
        """From now on, ``since`` counts what is made (alive) from here."""
        self._mark, self.since = self._next, 0

    def made_between(self, start: int, end: int) -> list:
        """The storages alive whose serials are in [``start``, ``end``)."""
        alive = self.alive
        return [st for st, n in self._serials.items() if start <= n < end and n in alive]

    @property
    def next_serial(self) -> int:
        """The serial the next storage made will take."""
        return self._next

    @property
    def following(self) -> bool:
        """Whether ``mode`` has started numbering what is made."""
        return self._serials is not None

    def mode(self):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.weak import WeakIdKeyDictionary

        self._serials = WeakIdKeyDictionary()
        made = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {
                    t.untyped_storage()._cdata
                    for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)
                }
                new = []
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    storage = t.untyped_storage()
                    if storage._cdata in inputs or storage in made._serials:
                        continue
                    made._serials[storage] = serial = made._next
                    made._next += 1
                    made.alive[serial] = storage.nbytes()
                    made.total += storage.nbytes()
                    made.since += storage.nbytes()
                    weakref.finalize(storage, made.forget, serial)
                    new.append(serial)
                if made.nodes_running:
                    made._on_moment(new)
                return out

        return Mode()


def peaks(
    loss,
    saves: SaveCounts,
    owners: Owners,
    param_owners: dict[int, int] | None = None,
    first_unpacked: dict[int, int] | None = None,
) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, int]]:
    """Run ``loss``'s backward (on meta) and give, per owner (``Owners``), the most bytes of saved
    activations and of what the backward made (gradients, temporaries inside a node) alive at
    once while one of its nodes ran, and the most of what the backward made alone. ``saves``
    must be the counts of the forward's saved-tensor hooks, whose unpack hook calls
    ``saves.unpacked``. Parameters' gradients are model states, counted by the timeline: left
    out of those two; the third is the first with them in while the node making them runs
    (where each is copied into a persistent bucket as soon as it is accumulated, it lives no
    longer). The fourth is the first with the owner's own parameters' gradients
    (``param_owners``: ``id`` of a parameter -> the unit holding it) kept from the moment each
    is made, as autograd holds them where the engine collects a unit's gradient only at its
    post-backward (partitioned gradients, a bucket per unit): those made so far at each moment,
    where the largest one beside every moment counted a mixture of experts' stacked weights,
    whose gradients are made after its peak. ``first_unpacked`` (filled if given): per owner,
    the bytes the backward made and holds (the gradients flowing in, parameters' apart) as its
    first node unpacks a saved tensor, where a checkpoint's recomputation of its span runs."""
    nodes, todo, seen = [], [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(n for n, _ in node.next_functions)
    weights = _into_parameters(nodes)

    alive = sum(saves.nbytes.values())
    found: dict[int, int] = {}
    made_most: dict[int, int] = {}
    with_grads: dict[int, int] = {}
    holding: dict[int, int] = {}
    param_owners = param_owners or {}
    held: dict[int, int] = {}  # per owner: bytes of its parameters' gradients accumulated
    holders: set[int] = set()  # (``id`` of the parameters those are of)
    running: list = [None]  # the owner of the node running (or that ran last)
    # The node running: the sizes of what it made, and per moment, the bytes alive and which of
    # its own storages were (a parameter's gradient among them is known as it ends).
    sizes: dict[int, int] = {}
    moments: list[tuple[int, tuple[int, ...]]] = []

    def moment(new: list[int]) -> None:
        sizes.update((s, made.alive[s]) for s in new)
        moments.append((made.total, tuple(s for s in sizes if s in made.alive)))

    made = _Made(moment)

    def before(node):
        def hook(_grad_outputs) -> None:
            sizes.clear()
            moments.clear()
            made.nodes_running += 1
            running[0] = owners.of(node)

        return hook

    def after(node):
        def hook(grad_inputs, _grad_outputs) -> None:
            nonlocal alive
            states, onward = set(), set()
            for g, (into, _) in zip(grad_inputs, node.next_functions):
                if g is not None and into is not None:
                    to_param = weights.get(into) == g.numel()
                    (states if to_param else onward).add(made.serial(g))
            # (one tensor also flowing on down an activation, ``x + pos_embed``, is no state:
            # AccumulateGrad copies it there, and it stays)
            states -= onward
            moment([])
            owner = owners.of(node)
            if owner is not None:
                for total, own in moments:
                    made_now = total - sum(sizes[s] for s in own if s in states)
                    found[owner] = max(found.get(owner, 0), alive + made_now)
                    made_most[owner] = max(made_most.get(owner, 0), made_now)
                    with_grads[owner] = max(with_grads.get(owner, 0), alive + total)
                    now = alive + total + held.get(owner, 0)
                    holding[owner] = max(holding.get(owner, 0), now)
            for serial in states - {None}:
                made.forget(serial)
            made.nodes_running -= 1
            alive -= sum(saves.nbytes[k] for k in saves.done)
            saves.done.clear()

        return hook

    def accumulated(param) -> None:  # (a copy AccumulateGrad made, not the gradient it got)
        serial = made.serial(param.grad)
        if serial is not None:
            made.forget(serial)
        owner = param_owners.get(id(param))
        if owner is not None and owner == running[0] and id(param) not in holders:
            holders.add(id(param))  # (a second gradient is added into the first)
            held[owner] = held.get(owner, 0) + param.grad.untyped_storage().nbytes()

    def unpacking() -> None:
        owner = running[0]
        if first_unpacked is not None and made.nodes_running and owner is not None:
            first_unpacked.setdefault(owner, made.total)

    handles = []
    saves.on_unpack = unpacking
    for node in nodes:
        if hasattr(node, "variable"):
            handles.append(node.variable.register_post_accumulate_grad_hook(accumulated))
        else:
            handles.append(node.register_prehook(before(node)))
            handles.append(node.register_hook(after(node)))
    try:
        with made.mode():
            loss.backward()
    finally:
        saves.on_unpack = None
        for h in handles:
            h.remove()
    return found, made_most, with_grads, holding
