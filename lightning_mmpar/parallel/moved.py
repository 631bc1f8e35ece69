"""Old import paths of moved modules, kept one release with a ``DeprecationWarning``.

A moved module keeps no file at its old path (so version control sees a plain rename): an
import finder answers the old name with a module that holds the new module's names and warns
once, at that import. :data:`MOVED` lists old -> new paths; :func:`install` (called by
``lightning_mmpar.parallel``) puts the finder on ``sys.meta_path`` once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "MovedModules", "install"]

MOVED: dict[str, str] = {
    "lightning_mmpar.parallel.pipeline_schedules": "lightning_mmpar.parallel.pipeline.schedules",
    "lightning_mmpar.parallel.pipeline_steps": "lightning_mmpar.parallel.pipeline.steps",
}
"""Old module path -> new module path (deprecated in 0.1, removed in the next release)."""


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import finder and loader of the old paths in ``moved`` (old -> new module path)."""

    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def exec_module(self, module: ModuleType) -> None:
        """Fill ``module`` (the old path) with the new module's names; warn the importer."""
        new = self.moved[module.__name__]
        target = importlib.import_module(new)
        names = {k: v for k, v in vars(target).items() if not k.startswith("__")}
        module.__dict__.update(names)
        module.__all__ = list(getattr(target, "__all__", names))  # type: ignore[attr-defined]
        module.__doc__ = f"Deprecated alias of :mod:`{new}`."
        warnings.warn(
            f"{module.__name__} moved to {new}; import from there (the old path is removed in "
            "the next release).",
            DeprecationWarning,
            stacklevel=2,  # warnings skips importlib's frames: the import statement
        )


def install() -> None:
    """Put one :class:`MovedModules` finder of :data:`MOVED` on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules(MOVED))
