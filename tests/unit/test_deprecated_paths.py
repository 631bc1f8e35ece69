"""Moved modules keep their former import path for one release, with a ``DeprecationWarning``
naming the new one (CHANGELOG.md, "Deprecated")."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MOVED: dict[str, tuple[str, ...]] = {
    "lightning_mmpar.parallel.checkpoint_find": ("lightning_mmpar.parallel.checkpoint.find",),
    "lightning_mmpar.parallel.checkpoint_check": ("lightning_mmpar.parallel.checkpoint.check",),
    "lightning_mmpar.metrics": ("lightning_mmpar.recipes.metrics",),
    "lightning_mmpar.parallel.deepspeed": (
        "lightning_mmpar.parallel.deepspeed_mapping",
        "lightning_mmpar.parallel.deepspeed_strategy",
    ),
    "lightning_mmpar.recipes.deepspeed": ("lightning_mmpar.recipes.deepspeed_cli",),
    "lightning_mmpar.callbacks.memory": ("lightning_mmpar.callbacks.peak_memory",),
    "lightning_mmpar.models.cost": ("lightning_mmpar.models.block_cost",),
    "lightning_mmpar.recipes.captions": ("lightning_mmpar.recipes.caption_writer",),
}
"""Former module path -> the module(s) its names live in now (the warning names the first)."""


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_former_path_warns_and_exports_the_same_names(old: str, new: tuple[str, ...]) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new[0].replace(".", r"\.")):
        alias = importlib.import_module(old)
    targets = [importlib.import_module(n) for n in new]
    assert alias.__all__
    for name in alias.__all__:
        homes = [t for t in targets if hasattr(t, name)]
        assert homes and getattr(alias, name) is getattr(homes[0], name), name


def test_the_package_never_imports_a_deprecated_path() -> None:
    """Importing every public package loads none of the aliases (no warning for users)."""
    code = (
        "import sys, lightning_mmpar.parallel, lightning_mmpar.recipes, lightning_mmpar.callbacks\n"
        "import lightning_mmpar.recipes.clip_llama, lightning_mmpar.models\n"
        f"print([m for m in {sorted(MOVED)!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
