"""The package's names (``zeroshard/__init__.py``): functions and submodules as attributes."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import zeroshard

_FRESH = """
import zeroshard
import zeroshard.checkpoint, zeroshard.model_states.optimizer  # import the state-dict module
assert callable(zeroshard.optimizer_state_dict), zeroshard.optimizer_state_dict
assert callable(zeroshard.load_optimizer_state_dict)
assert callable(zeroshard.export.export_safetensors)
assert callable(zeroshard.state_dict.full_state_dict)
"""


def test_exported_functions_stay_functions_once_their_modules_are_imported():
    # The function zeroshard.optimizer_state_dict was shadowed by its own module of that name
    # once anything imported it (Python binds a submodule on its package): "not callable".
    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_submodule_is_an_attribute():
    # zeroshard.export.export_safetensors, as the README writes it, was an AttributeError.
    for info in pkgutil.iter_modules(zeroshard.__path__):
        if info.name not in zeroshard._EXPORTS:
            assert getattr(zeroshard, info.name).__name__ == f"zeroshard.{info.name}"
    assert {"checkpoint", "export", "state_dict", "wrap"} <= set(dir(zeroshard))
    try:
        zeroshard.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no attribute 'no_such_thing'" in str(exc)
    else:
        raise AssertionError("an unknown name was found")
