"""Each unit's backward working bytes, found by running the measured forward's backward on meta
and following what autograd keeps alive, node by node.

A unit's backward holds, beside the activations saved up to it, the gradients flowing through it
and those its operators make. How many exist at once depends on its operators: GELU's backward
frees the MLP output its projection saved before it makes its own gradient, ReLU's (which saves
its output, the projection's saved input) cannot, and a gated MLP's product holds three
gradients of its width at once. So the unit's peak is followed rather than assumed:

- a saved storage lives until the last node that saved it has run (``SaveCounts``: saves
  counted in the forward, unpacks in the backward);
- a gradient lives from the node that makes it until the node it flows into has run (a second one
  into the same input is summed into the first's buffer); a parameter's gradient (into its
  ``AccumulateGrad``, or a transpose, view or cast before it) is a model state, counted by the
  timeline apart;
- a node belongs to the unit whose forward created it (autograd's sequence numbers, noted as
  units are entered and left, ``Owners``); the engine runs nodes in decreasing sequence order.

The peak of a unit is taken as each of its nodes ends, before what it consumed is freed. All sizes
are bytes; nothing is allocated (meta tensors).
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

    def saved(self, key: int, nbytes: int) -> None:
        self.nbytes[key] = nbytes
        self.left[key] = self.left.get(key, 0) + 1

    def unpacked(self, key: int) -> None:
        if key in self.left:
            self.left[key] -= 1
            if self.left[key] == 0:
                self.done.append(key)


def _storage(t) -> tuple[int, int]:
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


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


def peaks(loss, saves: SaveCounts, owners: Owners) -> dict[int, int]:
    """Run ``loss``'s backward (on meta) and give, per owner (``Owners``), the most bytes of saved
    activations and gradients alive at the end of any of its nodes. ``saves`` must be the
    counts of the forward's saved-tensor hooks, whose unpack hook calls ``saves.unpacked``."""
    from torch.autograd.graph import Node

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
    pending: dict = {}  # node -> {input: (storage, bytes)}: the gradients flowing into it
    consumed: dict[int, int] = {}  # storage -> bytes: the running node's incoming gradients
    found: dict[int, int] = {}

    def before(grad_outputs) -> None:
        consumed.clear()
        consumed.update(_storage(g) for g in grad_outputs if g is not None)

    def after(node: Node):
        def hook(grad_inputs, _grad_outputs) -> None:
            nonlocal alive
            made = [
                (into, slot, _storage(g))
                for g, (into, slot) in zip(grad_inputs, node.next_functions)
                if g is not None and into is not None and weights.get(into) != g.numel()
            ]
            live = dict(consumed)
            for slots in pending.values():
                live.update(slots.values())
            live.update(storage for _, _, storage in made)  # (beside a buffer summed into)
            for into, slot, storage in made:
                # A second gradient into one input is summed into the first's buffer.
                pending.setdefault(into, {}).setdefault(slot, storage)
            owner = owners.of(node)
            if owner is not None:
                found[owner] = max(found.get(owner, 0), alive + sum(live.values()))
            pending.pop(node, None)  # (summed into one buffer, or consumed as they are)
            alive -= sum(saves.nbytes[k] for k in saves.done)
            saves.done.clear()

        return hook

    handles = []
    for node in nodes:
        if not hasattr(node, "variable"):  # (not an AccumulateGrad)
            handles.append(node.register_prehook(before))
            handles.append(node.register_hook(after(node)))
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return found
