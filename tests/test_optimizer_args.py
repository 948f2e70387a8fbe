"""What ``zeroshard.optimizer`` accepts (``zeroshard.model_states.optimizer_args``): parameter
groups in every form torch.optim takes, and what it refuses, each in one line; in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zeroshard


@pytest.mark.parametrize("stage", [0, 3])
def test_a_group_of_one_tensor_is_a_group(lone_process, stage):
    """``{"params": model.head.weight, "lr": ...}``: torch.optim wraps the lone tensor in a
    list; its rows were taken for parameters ("not part of the sharded model")."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage)

    def groups(m):
        return [
            {"params": m[2].weight, "lr": 0.5},
            {"params": [m[0].weight, m[0].bias, m[2].bias]},
        ]

    opt = zeroshard.optimizer(model, torch.optim.SGD, groups(model), lr=0.1)
    ref_opt = torch.optim.SGD(groups(ref), lr=0.1)
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().sum().backward()
        o.step()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    for name, want in ref.state_dict().items():
        assert torch.allclose(full[name], want, atol=1e-6), name


def test_settings_torch_refuses_are_named(lone_process):
    """A setting of the wrong type reached torch's own check as a bare TypeError ("'<=' not
    supported between instances of 'float' and 'str'")."""
    model = zeroshard.shard(nn.Linear(4, 2), stage=1)
    with pytest.raises(TypeError, match=r"AdamW\(lr='3e-3'\) refused its settings: '<='.*not '3e"):
        zeroshard.optimizer(model, torch.optim.AdamW, lr="3e-3")
    with pytest.raises(ValueError, match=r"Adam\(betas=\(0.9, 2.0\)\) refused .*: Invalid beta"):
        zeroshard.optimizer(model, torch.optim.Adam, betas=(0.9, 2.0))
    groups = [{"params": [model.weight], "lr": "3e-3"}, {"params": [model.bias]}]
    with pytest.raises(TypeError, match=r"AdamW\(lr='3e-3'\) in a param group refused"):
        zeroshard.optimizer(model, torch.optim.AdamW, groups, lr=1e-3)  # failed at the step
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)  # the model is still usable
    model(torch.randn(3, 4)).sum().backward()
    assert opt.step()


@pytest.mark.parametrize("elementwise", [False, True])
def test_an_optimizer_given_by_its_name_is_named(lone_process, elementwise):
    """``"AdamW"``: refused as "not a known element-wise optimizer ... pass elementwise=True",
    and with it, a bare AttributeError ("'str' object has no attribute '__module__'")."""
    model = zeroshard.shard(nn.Linear(4, 2), stage=1)
    with pytest.raises(
        TypeError, match=r"not 'AdamW': zeroshard.optimizer\(model, torch.optim.AdamW"
    ):
        zeroshard.optimizer(model, "AdamW", elementwise=elementwise, lr=1e-3)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)  # the model is still usable
    model(torch.randn(3, 4)).sum().backward()
    assert opt.step()


def test_parameters_given_as_torch_optim_refuses_them_are_named(lone_process):
    """As torch.optim: a bare tensor, an empty list, a group without "params" (a bare tensor
    was reported as a parameter of another model; the others passed, or raised KeyError)."""
    model = zeroshard.shard(nn.Linear(4, 2), stage=3)
    with pytest.raises(TypeError, match="an iterable of tensors or of dicts.*got a Parameter"):
        zeroshard.optimizer(model, torch.optim.SGD, model.weight, lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        zeroshard.optimizer(model, torch.optim.SGD, [], lr=0.1)
    with pytest.raises(ValueError, match=r"needs a 'params' key; got keys \['lr'\]"):
        zeroshard.optimizer(model, torch.optim.SGD, [{"lr": 0.1}], lr=0.1)
    with pytest.raises(TypeError, match="param groups mix dicts with a Parameter"):  # (dict())
        zeroshard.optimizer(model, torch.optim.SGD, [{"params": [model.bias]}, model.weight])
    instance = torch.optim.SGD(model.parameters(), lr=0.1)
    for elementwise in (False, True):
        with pytest.raises(TypeError, match=r"the optimizer class \(torch.optim.AdamW\)"):
            zeroshard.optimizer(model, instance, elementwise=elementwise)


def test_keys_of_a_group_that_the_class_does_not_take_are_kept(lone_process):
    """``{"params": ..., "name": "head", "lr_scale": 0.5}`` (timm's, mmengine's and Hugging
    Face's groups): torch.optim keeps such keys in the group and its state dict; they were
    refused as settings of the class."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = zeroshard.shard(copy.deepcopy(ref), stage=1)

    def groups(m):
        return [
            {"params": m[2].parameters(), "name": "head", "lr_scale": 0.5},
            {"params": m[0].parameters(), "name": "body", "lr_scale": 1.0},
        ]

    opts = [zeroshard.optimizer(model, torch.optim.AdamW, groups(model), lr=0.1)]
    opts.append(torch.optim.AdamW(groups(ref), lr=0.1))
    for o in opts:  # a scheduler of the user's own reading its key
        for g in o.param_groups:
            g["lr"] = 0.1 * g["lr_scale"]
    _trained_alike(model, ref, *opts)
    saved = opts[0].state_dict()["param_groups"]
    assert sorted((g["name"], g["lr_scale"]) for g in saved) == [("body", 1.0), ("head", 0.5)]
    opts[0].load_state_dict(opts[0].state_dict())
    assert [g["name"] for g in opts[0].param_groups] == ["head", "body"]


def _trained_alike(model, ref, opt, ref_opt, steps: int = 2) -> None:
    """Train the sharded ``model`` and its unsharded twin ``ref`` on one batch; assert they
    end alike."""
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(steps):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    for name, want in ref.state_dict().items():
        assert torch.allclose(full[name], want, atol=1e-6), name


def test_torch_s_profiling_wrapper_is_not_an_override():
    """torch writes a profiling wrapper of ``step`` into the class of the first optimizer it
    builds before any of its base (``_patch_step_function``): a subclass that only adds
    ``__init__`` was refused as "overrides step()" from its second instance on, depending on
    the order the program built optimizers in."""
    from zeroshard.model_states.optimizer_args import _overridden_step

    class Plain(torch.optim.AdamW):
        pass

    class Own(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    for cls in (Plain, Own):  # as torch patches a class whose step is not hooked yet
        cls.step = torch.optim.Optimizer.profile_hook_step(cls.step)
        cls.step.hooked = True
    assert _overridden_step(Plain) is None
    assert _overridden_step(Own) == "step() of AdamW"


class _Centralized(torch.optim.SGD):
    """Gradient centralization in a step pre-hook registered by ``__init__``: per tensor."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.register_step_pre_hook(self._centralize)

    @staticmethod
    def _centralize(opt, args, kwargs):
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None and p.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=1, keepdim=True))


def test_step_hooks_an_optimizer_registers_itself_are_refused(lone_process):
    """They would run on each rank's 1-D slices: accepted (whenever a plain SGD had been built
    first), they trained 0.01-0.05 off torch."""
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), stage=1)
    with pytest.raises(ValueError, match="registers step hooks in its __init__ .*_centralize"):
        zeroshard.optimizer(model, _Centralized, lr=0.1)
    zeroshard.optimizer(model, _Centralized, lr=0.1, elementwise=True)  # the caller vouches


def test_global_step_hooks_run_once_per_step_on_the_users_optimizer(lone_process):
    """``torch.optim.optimizer.register_optimizer_step_pre_hook`` (a profiler's, a logger's):
    one call per ``step()``, on the zeroshard optimizer; they ran once per sub-group too, on
    torch optimizers of 1-D pieces (8 times at stage 3 with three units)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1)
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", type(o)))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", type(o)))),
    ]
    try:
        opt.backward(model(torch.randn(3, 4)).square().sum())
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == [("pre", type(opt)), ("post", type(opt))], calls


def test_load_pre_hooks_edit_a_copy_of_the_caller_s_dict(lone_process):
    """As torch: a pre-hook stripping a key of the caller's own (an epoch kept beside the
    states) edits a copy; it removed the key from the caller's dict."""
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4)), stage=1)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1)
    opt.register_load_state_dict_pre_hook(lambda o, sd: sd.pop("epoch") and None)
    sd = opt.state_dict()
    sd["epoch"] = 3
    opt.load_state_dict(sd)
    assert sd["epoch"] == 3


def test_a_group_choosing_foreach_is_not_given_fused(lone_process):
    """zeroshard builds Adam/AdamW fused unless told otherwise: a group's own ``foreach=True``
    is telling it (torch refused "fused and foreach cannot be True together")."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = zeroshard.shard(copy.deepcopy(ref), stage=2)
    opts = [
        zeroshard.optimizer(
            model, torch.optim.AdamW, [{"params": model.parameters(), "foreach": True}]
        ),
        torch.optim.AdamW([{"params": ref.parameters(), "foreach": True}]),
    ]
    x = torch.randn(3, 4)
    for m, o in zip((model, ref), opts):
        m(x).square().sum().backward()
        o.step()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    for name, want in ref.state_dict().items():
        assert torch.allclose(full[name], want, atol=1e-6), name


def test_backward_of_something_not_a_tensor_is_named(lone_process):
    """``opt.backward(loss.item())`` or of a list failed inside the loss scaler ("'float'
    object has no attribute 'dtype'")."""
    model = zeroshard.shard(nn.Linear(4, 2), stage=3)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    loss = model(torch.randn(3, 4)).square().mean()
    for wrong, name in ((loss.item(), "float"), ([loss], "list")):
        with pytest.raises(TypeError, match=f"backward\\(\\) takes the loss tensor, got {name}"):
            opt.backward(wrong)
    opt.backward(loss)  # the graph is still there


def test_state_dict_functions_name_what_they_take(lone_process):
    """Raw AttributeErrors ("no attribute 'engine'", "no attribute 'mesh'") and KeyError
    'param_groups' for plausible mix-ups; ``device_mesh`` takes the sharded model too."""
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4)), stage=1)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1)
    for wrong in (model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)):
        with pytest.raises(TypeError, match="takes the optimizer zeroshard.optimizer"):
            zeroshard.optimizer_state_dict(wrong)
    with pytest.raises(ValueError, match="a model's state dict goes to model.load_state_dict"):
        opt.load_state_dict(model.state_dict())
    assert zeroshard.device_mesh(model) is zeroshard.device_mesh(zeroshard.engine_of(model))
    with pytest.raises(ValueError, match="not sharded"):
        zeroshard.device_mesh(nn.Linear(2, 2))


def test_an_optimizer_given_as_a_partial_trains_as_its_class(lone_process):
    """``functools.partial(torch.optim.AdamW, betas=...)`` (Hydra's ``_partial_``): refused as
    not element-wise, and with ``elementwise=True``, as its advice said, an AttributeError."""
    import functools

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = zeroshard.shard(copy.deepcopy(ref), stage=3)
    factory = functools.partial(torch.optim.AdamW, betas=(0.5, 0.9), lr=1.0)
    opt = zeroshard.optimizer(model, factory, lr=0.05)  # the call's lr over the partial's
    ref_opt = torch.optim.AdamW(ref.parameters(), betas=(0.5, 0.9), lr=0.05)
    _trained_alike(model, ref, opt, ref_opt)
    assert opt.param_groups[0]["betas"] == (0.5, 0.9)
    for fixed in (  # (the message printed the partial: every parameter's NaN placeholders)
        functools.partial(torch.optim.AdamW, list(model.parameters())),
        functools.partial(torch.optim.AdamW, params=list(model.parameters())),
    ):
        with pytest.raises(TypeError, match="keyword settings only") as raised:
            zeroshard.optimizer(model, fixed)
        assert len(str(raised.value)) < 400 and "nan" not in str(raised.value)


def test_a_group_of_a_set_is_refused_as_torch_refuses_it(lone_process):
    # Accepted, the group's order differed between ranks (a set's order is its tensors' ids).
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), stage=1)
    with pytest.raises(TypeError, match="ordered collections"):
        zeroshard.optimizer(model, torch.optim.SGD, [{"params": set(model.parameters())}], lr=0.1)
