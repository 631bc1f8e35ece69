"""The recipe's optimizer: AdamW, weight decay by role, a learning rate per tower.

Parameter groups: ``{vision, language, projector, adapter} x {decay, no decay}`` (empty groups
left out; ``projector`` only when ``optim.lr_projector`` is set, else the projector is in
``adapter``).
Decay by role is :func:`~lightning_mmpar.models.fusion.weight_decay_split` (none on biases,
norms, positional / class embeddings, gates and the logit scale); the tower of a parameter is
the fusion model's submodule that holds it (``model.vision``, ``model.language``, anything else
is the fresh "adapter" part: projector, adapters, heads, logit scale; a Qwen-VL model's patch
merger). With ``optim.lr_projector`` set, ``model.projector`` (a Qwen-VL model: its patch
merger, the projector's role) is its own ``projector`` part. Each group's peak rate is
``optim.lr_<tower>`` (``None``: ``optim.lr``), every rate follows the same linear warm-up and
cosine decay (separate rates for a pretrained backbone and new layers, as LLaVA (Liu et al.
2023) / Flamingo (Alayrac et al. 2022) fine-tuning does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mmpar.models.fusion import FusionModel, weight_decay_split
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.options import OptimConfig

__all__ = ["StepLambdaLR", "parameter_groups", "recipe_optimizer"]


def tower_of(model: FusionModel, *, projector: bool = False) -> dict[int, str]:
    """``{id(parameter): "vision" | "language"}`` for the towers' parameters; a Qwen-VL
    model's patch merger (``model.vision.merger``, the projector's role; Qwen3-VL's DeepStack
    mergers ``model.vision.deepstack_merger_list`` too) is left to the
    adapter part. With ``projector``: ``"projector"`` for ``model.projector``'s parameters
    (else the merger's)."""
    towers = ("vision", "language")
    out = {id(p): name for name in towers for p in getattr(model, name).parameters()}
    merged = [  # Qwen3-VL: the DeepStack mergers too
        p
        for name in ("merger", "deepstack_merger_list")
        if isinstance(part := getattr(model.vision, name, None), nn.Module)
        for p in part.parameters()
    ]
    for p in merged:
        out.pop(id(p), None)
    if projector:
        part = getattr(model, "projector", None)
        chosen = list(part.parameters()) if isinstance(part, nn.Module) else merged
        out.update({id(p): "projector" for p in chosen})
    return out


def parameter_groups(
    module: nn.Module, model: FusionModel, optim: OptimConfig
) -> list[dict[str, Any]]:
    """AdamW parameter groups of ``module``'s trainable parameters (module docstring).

    Each group has ``params``, ``weight_decay``, ``lr`` and ``name``
    (``<tower>`` or ``<tower>.no_decay``). Call after the strategy wrapped the model (the ids
    of sharded parameters are those ``model`` holds then).
    """
    params = dict(module.named_parameters())
    towers = tower_of(model, projector=optim.lr_projector is not None)
    decay, no_decay = weight_decay_split(module)
    groups: list[dict[str, Any]] = []
    for tower in ("vision", "language", "projector", "adapter"):
        lr = getattr(optim, f"lr_{tower}")
        for names, wd, suffix in ((decay, optim.weight_decay, ""), (no_decay, 0.0, ".no_decay")):
            chosen = [params[n] for n in names if towers.get(id(params[n]), "adapter") == tower]
            if chosen:
                groups.append(
                    {
                        "params": chosen,
                        "weight_decay": wd,
                        "name": tower + suffix,
                        "lr": optim.lr if lr is None else lr,
                    }
                )
    return groups


class StepLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A :class:`~torch.optim.lr_scheduler.LambdaLR` whose checkpoint holds only the step.

    Under pipeline parallelism each stage's optimizer holds a different set of parameter groups
    (a stage without vision layers has no ``vision`` groups), while Lightning saves one
    scheduler state (rank 0's). Torch's ``LambdaLR`` saves ``base_lrs`` and ``_last_lr`` per
    group, so a stage with fewer groups fails on resume (``zip()`` length mismatch). This
    scheduler saves ``{"last_epoch", "_step_count"}`` only; on load it keeps its own groups'
    base rates (from the config) and sets every group's rate to ``base * lambda(last_epoch)``,
    which is what an uninterrupted run has at that step - on any stage and any layout.
    """

    def state_dict(self) -> dict[str, Any]:
        """``{"last_epoch": int, "_step_count": int}``: the step, nothing per group."""
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step and recompute every group's rate at it (keys other than
        ``last_epoch`` / ``_step_count``, as torch's own state carries, are ignored)."""
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        pairs = zip(self.base_lrs, self.lr_lambdas, strict=True)
        rates = [base * f(self.last_epoch) for base, f in pairs]
        for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        self._last_lr = rates


def recipe_optimizer(module: Any) -> Any:
    """``configure_optimizers`` of the recipe: AdamW over :func:`parameter_groups`, linear
    warm-up and cosine decay per step. A rank with no trainable parameter (a pipeline stage of
    a frozen tower's blocks) gets one empty group ``frozen``: it steps nothing and still joins
    every collective of the step."""
    o: OptimConfig = module.optim
    groups = parameter_groups(module, module.fusion_model, o)
    if not groups:  # a pipeline stage of frozen blocks only (a frozen ViT's): nothing to step
        groups = [{"params": [], "weight_decay": 0.0, "name": "frozen", "lr": o.lr}]
    opt = torch.optim.AdamW(groups, lr=o.lr, foreach=False)
    total = max(1, int(module.trainer.estimated_stepping_batches))
    sched = StepLambdaLR(opt, penv.warmup_cosine(o, total))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
