"""Qwen2-VL / Qwen2.5-VL through the layouts (issue 29 item 3): a LightningModule over the
model's pipeline blocks and :func:`~lightning_mmpar.plans.qwen_vl.qwen_vl_plan`, trained two
steps on batches mixing a text-only sample, one-image samples and a sample with two images of
different resolutions, in the spawned world of each layout's size (2 processes: tp2, pp2,
dp2 FSDP2; 4: tp2 x pp2) against one process. The same worlds run the recipe's Qwen layouts of
their size (:mod:`qwen_recipe_worker`).

The tiny models come from transformers' own classes (:mod:`tests.unit.models.qwen_vl_cases`)
through :func:`~lightning_mmpar.models.hf.qwen_convert.qwen_vl_from_transformers`, so every
layout starts from the same converted weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data.qwen_packing import QwenVLCollator
from lightning_mmpar.losses import caption_loss
from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.models.hf.qwen_convert import qwen_vl_from_transformers
from lightning_mmpar.parallel.parallelize import ParallelPlan
from lightning_mmpar.parallel.pipeline import PipelineSteps
from lightning_mmpar.plans.plan import apply_plan, tp_meshes
from lightning_mmpar.plans.qwen_vl import qwen_vl_plan
from lightning_mmpar.topology import ParallelDims
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import qwen_recipe_worker
from tests.recipes import recipe_faults_worker as rw
from tests.unit.models import qwen_vl_cases as qc

TOKENS, PATCHES, SLOTS = 48, 96, 2
ONE, TWO, OTHER = ((1, 4, 6),), ((1, 4, 4), (1, 6, 8)), ((1, 8, 4),)
"""Image grids of a sample: one image; two images of different sizes; one more size."""
ROWS: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...] = (
    (((),), (ONE,), (TWO,), (OTHER,)),  # step 1: one sample per row
    ((TWO, ()), (ONE, OTHER), ((), ()), ((),)),  # step 2: packed rows
)
"""Per step, per row, the image grids of each sample of the row."""


def _sample(g: torch.Generator, sid: str, grids: tuple[tuple[int, int, int], ...]) -> dict:
    text = torch.randint(3, qc.IMG, (7 + len(sid),), generator=g).tolist()
    ids = text[:2]
    for n, _ in enumerate(grids):
        ids += [qc.START, qc.IMG, qc.END, text[2 + n]]
    ids += text[2 + len(grids) :]
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    pix = torch.randn(int(grid.prod(-1).sum()), qc.PATCH_DIM, generator=g)
    t = torch.tensor(ids)
    return {"id": sid, "input_ids": t, "labels": t, "pixel_values": pix, "image_grid_thw": grid}


def batches(steps: int = 2) -> list[dict[str, Tensor]]:
    """``steps`` batches of 4 rows with fixed shapes (a pipeline builds one schedule per
    shape): step 1 one sample per row, step 2 packed rows with the image rows first (pp2's
    second micro-batch then holds no image)."""
    g = torch.Generator().manual_seed(3)
    collate = QwenVLCollator(
        max_tokens=TOKENS,
        image_token_id=qc.IMG,
        max_patches_per_row=PATCHES,
        max_images_per_row=SLOTS + 1,
        pad_to_max_tokens=True,
    )
    out = []
    for step in range(steps):
        rows = [
            collate([_sample(g, f"{step}.{r}.{k}", grids) for k, grids in enumerate(row)])
            for r, row in enumerate(ROWS[step % 2])
        ]
        assert all(row["input_ids"].shape[0] == 1 for row in rows)  # each row packed as one
        out.append({key: torch.cat([row[key] for row in rows]) for key in rows[0]})
    return out


class QwenVLModule(PipelineSteps, LightningModule):
    """The converted model's blocks (registered as ``blocks``), its plan, the caption loss."""

    def __init__(self, family: str, vision_parallel: str = "tp") -> None:
        super().__init__()
        self.family, self.vision_parallel = family, vision_parallel
        self.blocks: nn.ModuleList | None = None
        self._model: tuple[QwenVLModel, ...] = ()
        self.head = None  # read by the recorder (the fusion recipe's head block)

    plan = staticmethod(qwen_vl_plan)
    """The model's plan function (a subclass's family: its own)."""

    def build(self) -> Any:
        """The converted model of :attr:`family`."""
        return qwen_vl_from_transformers(qc.hf_model(self.family))

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        model = self.build().train()
        self._model = (model,)
        self.blocks = nn.ModuleList(model.pipeline_blocks())

    def parallel_plan(self, dims: ParallelDims) -> ParallelPlan:
        model = self._model[0]
        return self.plan(
            model,
            vision_parallel=self.vision_parallel,  # type: ignore[arg-type]
            dims=dims,
            pipeline_blocks=self.pipeline_blocks,
        )

    def pipeline_blocks(self) -> list[nn.Module]:
        assert self.blocks is not None
        return list(self.blocks)

    def pipeline_inputs(self, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        return QwenVLModel.pipeline_inputs(batch), batch["labels"]

    def pipeline_loss(self, logits: Tensor, labels: Tensor) -> Any:
        return caption_loss(logits, labels, loss_parallel=isinstance(logits, DTensor))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


LAYOUTS: tuple[pm.Layout, ...] = (
    pm.Layout("qwen2_vl tp2", 2, {"tensor_parallel": 2}),
    pm.Layout(
        "qwen2_vl tp2 vision replicate", 2, {"tensor_parallel": 2}, vision_parallel="replicate"
    ),
    pm.Layout("qwen2_vl tp2 vision dp", 2, {"tensor_parallel": 2}, vision_parallel="dp"),
    pm.Layout("qwen2_vl pp2 1f1b", 2, pm._pp("1f1b", 2, 2, 1)),
    pm.Layout("qwen2_vl dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    pm.Layout("qwen2_5_vl tp2", 2, {"tensor_parallel": 2}),
    pm.Layout("qwen2_5_vl pp2 1f1b", 2, pm._pp("1f1b", 2, 2, 1)),
    pm.Layout("qwen2_5_vl dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    pm.Layout("qwen2_5_vl tp2 x pp2", 4, pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)),
)
"""Per family, the layouts of a world size run in the spawned world of that size: the
2-process Qwen-VL world, the 4-process ragged world (:mod:`ragged_parity_worker`)."""


def family(layout: pm.Layout) -> str:
    return layout.name.split()[0]


def reference(name: str) -> rw.Recorder:
    """One process on the same batches."""
    return rw.fit(QwenVLModule(name), batches())  # type: ignore[arg-type]


def run_layout(
    layout: pm.Layout,
    rank: int,
    module: QwenVLModule | None = None,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Train ``layout`` on this rank (its dp share of every batch) with ``module`` (default
    the :func:`family`'s :class:`QwenVLModule`) and ``callbacks``."""
    start = time.perf_counter()
    coords = layout.dims.rank_coords(rank)
    local = [pm.dp_slice(b, layout.dims.dp, coords["dp"]) for b in batches()]
    module = module or QwenVLModule(family(layout), layout.vision_parallel)
    strategy = MultimodalParallelStrategy(**layout.strategy)
    rec = rw.fit(module, local, strategy=strategy, devices=layout.world, callbacks=list(callbacks))  # type: ignore[arg-type]
    return {"losses": rec.losses, "grads": rec.grads, "seconds": time.perf_counter() - start}


def tp_logits(name: str, world_size: int) -> dict[str, Tensor]:
    """Eval logits of the tensor-parallel model (plan applied on a tp mesh of the world) and of
    the same model unsharded, on the first batch."""
    model = qwen_vl_from_transformers(qc.hf_model(name)).eval()
    batch = batches(1)[0]
    with torch.no_grad():
        want = model(batch)
        mesh = init_device_mesh("cpu", (world_size,))
        apply_plan(model, qwen_vl_plan(model), tp_meshes(mesh, None))
        got = model(batch)
    assert isinstance(got, DTensor)
    return {"got": got.full_tensor(), "want": want}


def check_layout(
    tag: str, layout: pm.Layout, results: list[dict[str, Any]], ref: rw.Recorder
) -> None:
    """Assert ``layout``'s per-rank ``results`` equal the one-process ``ref`` (both steps'
    losses and the first step's gradients, the union over the ranks, within a relative 1e-5);
    print the figures under ``tag`` (the family)."""
    assert len(ref.losses) == 2, layout.name
    rw.check_parity(tag, layout.name, results, ref)


def world(rank: int, world_size: int) -> dict[str, Any]:
    """Every layout of this world size on this rank (``{name: result}``), then (2 processes)
    the tp logits checks, then the recipe's layouts of this size."""
    names = pm.only()
    out: dict[str, Any] = {
        x.name: pm.named(x.name, rank, run_layout, x, rank)
        for x in LAYOUTS
        if x.world == world_size and (not names or x.name in names)
    }
    for name in ("qwen2_vl", "qwen2_5_vl") if world_size == 2 else ():
        out[f"{name} tp2 logits"] = pm.named(name, rank, tp_logits, name, world_size)
    return out | qwen_recipe_worker.world(rank, world_size)  # through the recipe
