"""Ragged-batch parity (issue 28 item 5): the recipe module on packed batches mixing text-only,
one-image and three-image samples, in many layouts inside one spawned world per size, against
one process.

Every global batch has 4 rows packed by :class:`~lightning_mmpar.data.MultimodalCollator` to
fixed shapes (``pad_to_max_tokens`` and ``max_images_per_row``: the pipeline's shape choice,
docs/ragged.md); rows 2-3 of step 1 and rows 0-1 of step 2 hold text-only samples, so a
data-parallel rank (and a pipeline micro-batch) with no image runs beside one with images.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data.packing import MultimodalCollator
from tests.recipes import hf_llava_worker, qwen3_moe_worker, qwen_vl_worker
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import recipe_faults_worker as rw
from tests.recipes import skipped_tower_worker as skipped_tower

VOCAB = 64
IMG = 63  # the image marker (cross-attention fusion: one token per image)
TOKENS, SLOTS = 24, 4
ROWS: tuple[tuple[tuple[int, int], ...], ...] = (  # (images, text length) of each row's samples
    ((1, 6), (3, 7), (0, 5)),
    ((1, 5), (1, 8), (0, 4)),
    ((0, 9), (0, 6)),
    ((0, 11),),
)


def _sample(g: torch.Generator, sid: str, images: int, length: int) -> dict[str, Any]:
    text = torch.randint(4, IMG, (length,), generator=g)
    ids = torch.cat([text[:1], torch.full((images,), IMG), text[1:]])
    pix = torch.randn(images, 3, 16, 16, generator=g)
    return {"id": sid, "input_ids": ids, "labels": ids.clone(), "pixel_values": pix}


def batches(steps: int = 2) -> list[dict[str, Any]]:
    """``steps`` global batches of 4 packed rows; step 2 puts the text-only rows first and has
    other shapes (22 tokens, 5 image slots: the pipeline builds a schedule per shape)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        tokens, slots = (TOKENS, SLOTS) if step % 2 == 0 else (TOKENS - 2, SLOTS + 1)
        collate = MultimodalCollator(
            max_tokens=tokens, image_token_id=IMG, max_images_per_row=slots, pad_to_max_tokens=True
        )
        rows = ROWS if step % 2 == 0 else ROWS[2:] + ROWS[:2]
        parts = [
            collate([_sample(g, f"{step}.{r}.{k}", *spec) for k, spec in enumerate(row)])
            for r, row in enumerate(rows)
        ]
        assert all(p["input_ids"].shape[0] == 1 for p in parts)  # one row per ROWS entry
        out.append({key: torch.cat([p[key] for p in parts]) for key in parts[0]})
    return out


LAYOUTS: tuple[pm.Layout, ...] = (
    pm.Layout("ragged dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    pm.Layout("ragged dp2 ddp", 2, {"data_parallel": "ddp"}),
    # packing gives dp ranks different row counts: rank 0 holds 3 rows, rank 1 one
    pm.Layout("ragged dp2 fsdp, rows 3 / 1", 2, {"data_parallel": "fsdp"}),
    # one optimizer step over both batches: the caption term is the token mean of the window
    # (its tokens summed over the dp ranks before its first batch), as on one process
    pm.Layout("ragged dp2 fsdp, accumulate 2", 2, {"data_parallel": "fsdp"}, accumulate=2),
    pm.Layout("ragged tp2 + sp", 2, {"tensor_parallel": 2}, sequence_parallel=True),
    pm.Layout("ragged pp2 1f1b", 2, pm._pp("1f1b", 2, 2, 1)),
    pm.Layout("ragged pp2 x v2 interleaved", 2, pm._pp("interleaved_1f1b", 2, 2)),
    pm.Layout("ragged pp2 zbv", 2, pm._pp("zbv_zero_bubble", 2, 2)),
    pm.Layout("ragged ep2 (moe)", 2, {"expert_parallel": 2}, moe="moe"),
    pm.Layout("ragged tp2 x pp2", 4, pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)),
    pm.Layout(  # dp rank 1 text-only at step 1, dp rank 0 at step 2; one row per micro-batch
        "ragged tp2 x pp2 x dp2 (sp, v2 interleaved, fsdp)",
        8,
        pm._pp("interleaved_1f1b", 2, 2, tensor_parallel=2),
        sequence_parallel=True,
    ),
)


UNEVEN_ROWS: dict[str, tuple[tuple[int, int], ...]] = {
    "ragged dp2 fsdp, rows 3 / 1": ((0, 3), (3, 4))
}
"""Layouts whose dp ranks take these row ranges of every global batch (others: equal slices)."""


def _rows(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def local_batches(layout: pm.Layout, rank: int) -> list[dict[str, Any]]:
    """This rank's part of every global batch of the layout: its dp slice, or the row range of
    :data:`UNEVEN_ROWS`."""
    dp_rank = layout.dims.rank_coords(rank)["dp"]
    data = _data(layout.accumulate)
    if layout.name in UNEVEN_ROWS:
        start, stop = UNEVEN_ROWS[layout.name][dp_rank]
        return [_rows(b, start, stop) for b in data]
    return [pm.dp_slice(b, layout.dims.dp, dp_rank) for b in data]


def accumulation_batches() -> list[dict[str, Any]]:
    """:func:`batches` with the second batch's targets cut after token 12 (its rows hold as
    many target tokens as the first's otherwise: the window's token mean would equal the mean
    of the two batches' token means, and accumulating would test nothing)."""
    out = batches()
    out[1]["labels"][:, 12:] = -100
    return out


def _data(accumulate: int) -> list[dict[str, Any]]:
    return accumulation_batches() if accumulate > 1 else batches()


def reference(moe: str | None, accumulate: int = 1) -> rw.Recorder:
    """One process on the same batches (accumulating: under ``mm_parallel``, which counts
    each accumulation window's tokens first)."""
    strategy = MultimodalParallelStrategy() if accumulate > 1 else "auto"
    data = _data(accumulate)
    return rw.fit(pm.build(VOCAB, moe), data, strategy=strategy, accumulate=accumulate)


def run_layout(layout: pm.Layout, rank: int) -> dict[str, Any]:
    start = time.perf_counter()
    local = local_batches(layout, rank)
    module = pm.build(VOCAB, layout.moe, layout.sequence_parallel)
    module.text_length = TOKENS
    strategy = MultimodalParallelStrategy(**layout.strategy)
    accumulate = layout.accumulate
    rec = rw.fit(module, local, strategy=strategy, devices=layout.world, accumulate=accumulate)
    return {"losses": rec.losses, "grads": rec.grads, "seconds": time.perf_counter() - start}


def text_only_batches() -> list[dict[str, Any]]:
    """2 global batches of 4 text-only rows and no image slot at all (``pixel_values [4, 0,
    C, H, W]``: no ``max_images_per_row``)."""
    g = torch.Generator().manual_seed(1)
    collate = MultimodalCollator(max_tokens=TOKENS, image_token_id=IMG, pad_to_max_tokens=True)
    out = []
    for step in range(2):
        rows = [collate([_sample(g, f"t{step}.{r}", 0, 6 + 2 * r)]) for r in range(4)]
        out.append({key: torch.cat([p[key] for p in rows]) for key in rows[0]})
    assert out[0]["pixel_values"].shape[1] == 0
    return out


def no_image_slot(rank: int) -> dict[str, Any]:
    """tp 2 on :func:`text_only_batches` (the adapter's cross-attention over zero image
    tokens raised ``integer modulo by zero`` in DTensor's view before): losses, gradients."""
    module = pm.build(VOCAB, None)
    module.text_length = TOKENS
    strategy = MultimodalParallelStrategy(tensor_parallel=2)
    rec = rw.fit(module, text_only_batches(), strategy=strategy, devices=2)
    return {"losses": rec.losses, "grads": rec.grads}


def shape_mismatch(rank: int) -> str:
    """pp 2 where the two pipeline ranks get batches of different lengths: every rank must
    raise the engine's ValueError (not hang, not reshape). Returns this rank's message."""
    data = batches(1)
    if rank == 1:  # two more pad tokens on this rank only
        data = [
            {
                k: torch.cat([v, v[:, :2].fill_(-1 if k == "sample_ids" else 0)], dim=1)
                if v.ndim == 2 and v.shape[1] == TOKENS
                else v
                for k, v in b.items()
            }
            for b in data
        ]
    module = pm.build(VOCAB, None)
    strategy = MultimodalParallelStrategy(**pm._pp("1f1b", 2, 2, 1))
    try:
        rw.fit(module, data, strategy=strategy, devices=2)
    except ValueError as err:
        return str(err)
    return "no error"


def selected(world_size: int) -> list[pm.Layout]:
    """The layouts of this size (``MMPAR_PARITY_ONLY="<layout>;<layout>"``: those alone)."""
    names = pm.only()
    return [x for x in LAYOUTS if x.world == world_size and (not names or x.name in names)]


def world(rank: int, world_size: int) -> dict[str, Any]:
    """Every ragged layout of this world size on this rank: ``{layout name: result}``."""
    out = {x.name: pm.named(x.name, rank, run_layout, x, rank) for x in selected(world_size)}
    out |= hf_llava_worker.world(rank, world_size)  # transformers' LLaVA (issue 29)
    if world_size == 4:  # Qwen-VL's 4-process layouts (the 2-process ones run in their worlds)
        out |= qwen_vl_worker.world(rank, world_size)  # with the recipe's (Qwen2-VL tp2 x pp2)
        out |= qwen3_moe_worker.world(rank, world_size)
    if world_size == 2 and not pm.only():
        out["no image slot"] = pm.named("tp2, no image slot", rank, no_image_slot, rank)
        out["skipped tower"] = pm.named(
            "own module, skipped tower", rank, skipped_tower.world, rank
        )
        out["shape mismatch"] = pm.named("shape mismatch", rank, shape_mismatch, rank)
    return out
