"""Deprecated: the planner CLI moved to :mod:`lightning_mmpar.recipes.planner`
(``python -m lightning_mmpar.recipes.planner``); this name (``plan`` is also the parallel plans
of :mod:`lightning_mmpar.plans.plan`) works for one more release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import sys
import warnings

from lightning_mmpar.recipes import planner

_MESSAGE = (
    "lightning_mmpar.recipes.plan is deprecated: use lightning_mmpar.recipes.planner "
    "(python -m lightning_mmpar.recipes.planner); the old name goes in the next release."
)

if __name__ == "__main__":
    warnings.warn(_MESSAGE, DeprecationWarning, stacklevel=1)
    sys.exit(planner.main())
warnings.warn(_MESSAGE, DeprecationWarning, stacklevel=2)
sys.modules[__name__] = planner
