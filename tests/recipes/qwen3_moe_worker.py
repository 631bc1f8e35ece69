"""Qwen3-VL-MoE through the layouts (issue 29 items 3 and 5): the model's pipeline blocks under
:func:`~lightning_mmpar.plans.qwen3_moe_vl.qwen3_moe_vl_plan`, trained two steps on the batches
of :mod:`qwen_vl_worker` (a text-only sample, one-image samples, a sample with two images of
different resolutions; step 2 packed) in the spawned world of each layout's size (2
processes: ep2, tp2, pp2; 4: ep2 x tp2, ep2 x pp2) against one process; then (2 processes)
the export of an ep2 model (experts sharded) back to a transformers directory, and the
refusal of an export holding one rank's experts only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_mmpar.models.hf.qwen3_convert import (
    export_qwen3_moe_vl_state,
    qwen3_moe_vl_from_transformers,
    save_qwen3_moe_vl_hf,
)
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLModel
from lightning_mmpar.parallel.experts import apply_expert_parallel
from lightning_mmpar.parallel.tensor import full_state_dict
from lightning_mmpar.plans.qwen3_moe_vl import qwen3_moe_vl_plan
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import qwen_vl_worker as qw
from tests.recipes import recipe_faults_worker as rw
from tests.unit.models import qwen3_moe_cases as mc


class Qwen3MoeModule(qw.QwenVLModule):
    """:class:`qwen_vl_worker.QwenVLModule` over the converted Qwen3-VL-MoE and its plan."""

    plan = staticmethod(qwen3_moe_vl_plan)

    def build(self) -> Any:
        return qwen3_moe_vl_from_transformers(mc.hf_model())


LAYOUTS: tuple[pm.Layout, ...] = (
    pm.Layout("qwen3_vl_moe ep2 fsdp", 2, {"expert_parallel": 2}),
    pm.Layout("qwen3_vl_moe ep2 ddp", 2, {"expert_parallel": 2, "data_parallel": "ddp"}),
    pm.Layout("qwen3_vl_moe tp2", 2, {"tensor_parallel": 2}),
    pm.Layout("qwen3_vl_moe pp2 1f1b", 2, pm._pp("1f1b", 2, 2, 1)),
    pm.Layout("qwen3_vl_moe ep2 x tp2", 4, {"expert_parallel": 2, "tensor_parallel": 2}),
    pm.Layout("qwen3_vl_moe ep2 x pp2 1f1b", 4, pm._pp("1f1b", 2, 2, 1, expert_parallel=2)),
    pm.Layout("qwen3_vl_moe tp2 x pp2 1f1b", 4, pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)),
)
"""The layouts of a world size run in the spawned world of that size: the 2-process
Qwen3-VL-MoE world, the 4-process ragged world (:mod:`ragged_parity_worker`)."""


EXPORTED = "qwen3_vl_moe ep2 fsdp"
"""The layout whose trained weights are exported (experts sharded over ep, FSDP2 on top)."""


class FinalState(Callback):
    """The model's full state dict (our names, every DTensor gathered: collective) at the end
    of training."""

    def __init__(self) -> None:
        self.state: dict[str, Tensor] = {}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.state = full_state_dict(pl_module._model[0])  # type: ignore[index]


def reference() -> tuple[rw.Recorder, dict[str, Tensor]]:
    """One process on the same batches: its recorder and its trained weights (transformers'
    names)."""
    final = FinalState()
    module = Qwen3MoeModule("qwen3_vl_moe")
    rec = rw.fit(module, qw.batches(), callbacks=[final])  # type: ignore[arg-type]
    model = module._model[0]
    assert isinstance(model, Qwen3MoeVLModel)
    return rec, export_qwen3_moe_vl_state(final.state, model.config)


def _export_trained(state: dict[str, Tensor], root: str) -> dict[str, Tensor]:
    """``state`` (gathered on every rank) exported (rank 0 writes), loaded back by
    ``from_pretrained``."""
    hf = mc.hf_model()
    original, out = Path(root) / "trained_original", Path(root) / "trained"
    hf.save_pretrained(original)
    dist.barrier()
    save_qwen3_moe_vl_hf(state, original, out)
    dist.barrier()
    return dict(type(hf).from_pretrained(out).state_dict())


def run_layout(layout: pm.Layout, rank: int, root: str) -> dict[str, Any]:
    """Train ``layout`` on this rank (its dp share of every batch); :data:`EXPORTED` also
    exports its trained weights."""
    module = Qwen3MoeModule("qwen3_vl_moe", layout.vision_parallel)
    final = FinalState()
    out = qw.run_layout(layout, rank, module, callbacks=[final])
    if layout.name == EXPORTED:
        model = module._model[0]
        assert isinstance(model, Qwen3MoeVLModel)
        out["trained"] = export_qwen3_moe_vl_state(final.state, model.config)
        out["exported"] = _export_trained(final.state, root)
    return out


def ep_export(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The converted model with its experts sharded over an ep mesh of the world (each rank
    holds ``E / ep`` experts of every MoE layer), exported: first this rank's local tensors
    (refused), then the gathered full state; the written directory loaded back by
    ``from_pretrained`` and compared tensor by tensor with the original model."""
    start = time.perf_counter()
    hf = mc.hf_model()
    original, out, short = (Path(root) / name for name in ("original", "out", "short"))
    hf.save_pretrained(original)  # transformers writes on rank 0 only
    dist.barrier()
    model = qwen3_moe_vl_from_transformers(hf)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    for path in model.moe_layers():
        apply_expert_parallel(model.get_submodule(path), mesh)
    state = model.state_dict()
    local_experts = [tuple(v.to_local().shape) for v in state.values() if isinstance(v, DTensor)]
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    refused = ""
    try:
        save_qwen3_moe_vl_hf(local, original, short)
    except ValueError as err:
        refused = str(err)
    written = save_qwen3_moe_vl_hf(full_state_dict(model), original, out)
    dist.barrier()
    back = type(hf).from_pretrained(out).eval()
    want, got = hf.state_dict(), back.state_dict()
    return {
        "local_experts": local_experts,
        "refused": refused,
        "short_written": short.exists(),
        "names": sorted(got) == sorted(want),
        "diff": max(float((got[k] - want[k]).abs().max()) for k in want),
        "bytes": (sum(v.nbytes for v in written.values()), sum(v.nbytes for v in want.values())),
        "experts": [tuple(v.shape) for k, v in got.items() if ".experts." in k],
        "seconds": time.perf_counter() - start,
    }


def world(rank: int, world_size: int, root: str = "") -> dict[str, Any]:
    """Every layout of this world size on this rank (``{name: result}``), then (2 processes)
    the ep2 export; ``root``: a directory for the exports (2 processes only)."""
    names = pm.only()
    out: dict[str, Any] = {
        x.name: pm.named(x.name, rank, run_layout, x, rank, root)
        for x in LAYOUTS
        if x.world == world_size and (not names or x.name in names)
    }
    if world_size == 2:
        out["ep2 export"] = pm.named("ep2 export", rank, ep_export, rank, world_size, root)
    return out
