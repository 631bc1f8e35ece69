"""Qwen2-VL and Qwen3-VL-MoE trained through the recipe (issue 29 items 1-3):
``ClipLlamaModule`` with ``model.pretrained.hf`` a tiny directory written offline (a
:class:`~lightning_mmpar.recipes.qwen_module.QwenVLRecipeModule` /
:class:`~lightning_mmpar.recipes.qwen3_module.Qwen3MoeVLRecipeModule`, each rank reading only
its slices, stages, FSDP shards or experts), on batches of the conversation data module with
the directory's own image processor (images of three sizes, a text-only and a two-image
sample; fixed shapes for the pipeline): Qwen2-VL in tp2, tp2 with the ViT data-parallel, pp2,
dp2 FSDP2 and Qwen3-VL-MoE in ep2 (the 2-process world of :mod:`qwen_vl_worker`), Qwen2-VL
tp2 x pp2 and Qwen3-VL-MoE ep2 x tp2 (the 4-process ragged world); each layout's losses and
first-step gradients equal one process. The :data:`SAVED` / :data:`SAVED_4` runs save their
checkpoint for the export tests.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data import ConversationDataModule
from lightning_mmpar.losses.mml import MMLConfig
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    FusionPlanOptions,
    LossConfig,
    OptimConfig,
    PretrainedConfig,
)
from tests.builders import tiny_qwen_vl_dir
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import recipe_faults_worker as rw
from tests.recipes.hf_llava_worker import SaveAtEnd, _shared
from tests.unit.models.qwen3_moe_cases import EXPERTS

WORDS = "user assistant what is in the picture a red square blue circle and two shapes yes no"
IMAGES = {"a.png": (16, 24), "b.png": (32, 16), "c.png": (16, 16)}
"""Image files and their (height, width): grids (1, 4, 6), (1, 8, 4), (1, 4, 4)."""
RECORDS: list[dict[str, Any]] = [
    {
        "id": "one",
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "<image> what is in the picture"},
            {"from": "gpt", "value": "a red square"},
        ],
    },
    {
        "id": "two",
        "image": ["b.png", "c.png"],
        "conversations": [
            {"from": "human", "value": "<image> and <image> what is in the picture"},
            {"from": "gpt", "value": "two shapes"},
            {"from": "human", "value": "blue circle"},
            {"from": "gpt", "value": "yes"},
        ],
    },
    {
        "id": "text",
        "conversations": [
            {"from": "human", "value": "red square"},
            {"from": "gpt", "value": "no"},
        ],
    },
    {
        "id": "small",
        "image": "c.png",
        "conversations": [
            {"from": "human", "value": "<image> blue"},
            {"from": "gpt", "value": "a blue circle"},
        ],
    },
]
ANSWERS = ("a red square", "two shapes", "yes", "no", "a blue circle")
TOKENS, PATCHES, SLOTS = 48, 48, 2
DATA = {
    "max_tokens": TOKENS,
    "pad_to_max_tokens": True,
    "max_images_per_row": SLOTS,
    "max_patches_per_row": PATCHES,
    "overflow": "error",
    "batch_size": 4,
}
"""The data module's collation: one sample per row, fixed shapes (pipeline-ready)."""
SAVED = ("qwen recipe tp2", "qwen recipe dp2 fsdp", "qwen recipe pp2 1f1b")
"""The 2-process Qwen2-VL runs whose checkpoints the export tests read."""
SAVED_4 = ("qwen3 recipe ep2 x tp2",)
"""The 4-process runs whose checkpoints the export tests read (Qwen3-VL-MoE)."""
LAYOUTS: tuple[pm.Layout, ...] = (
    pm.Layout("qwen recipe tp2", 2, {"tensor_parallel": 2}),
    pm.Layout("qwen recipe tp2 vision dp", 2, {"tensor_parallel": 2}, vision_parallel="dp"),
    pm.Layout("qwen recipe pp2 1f1b", 2, pm._pp("1f1b", 2, 2, 1)),
    pm.Layout("qwen recipe dp2 fsdp", 2, {"data_parallel": "fsdp"}),
    pm.Layout("qwen3 recipe ep2 fsdp", 2, {"expert_parallel": 2}),
    pm.Layout("qwen recipe tp2 x pp2", 4, pm._pp("1f1b", 2, 2, 1, tensor_parallel=2)),
    pm.Layout("qwen3 recipe ep2 x tp2", 4, {"expert_parallel": 2, "tensor_parallel": 2}),
)
UNEVEN = "qwen recipe dp2 fsdp"
"""The layout whose dp ranks hold 3 and 1 of the batch's 4 rows (as packing gives ranks
different row counts): its logged ``train_loss`` is still one process's (the mean of the
ranks' shares, not their row-weighted mean)."""
FAMILIES = {"qwen": "qwen2_vl", "qwen2.5": "qwen2_5_vl", "qwen3": "qwen3_vl_moe"}
"""A recipe layout's first word -> the family of the directory it trains."""


def write_data(root: Path) -> Path:
    """The images and the LLaVA-format JSON of :data:`RECORDS` under ``root``."""
    rng = np.random.default_rng(0)
    for name, (h, w) in IMAGES.items():
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(root / name)
    (root / "data.json").write_text(json.dumps(RECORDS))
    return root / "data.json"


def files(family: str = "qwen2_vl") -> tuple[Path, Path]:
    """``(the family's directory, data JSON)``, written once by (global) rank 0 and shared.
    The families' tokenizers, image processors and image token ids are the same, so are
    the batches."""

    def make() -> Path:
        root = Path(tempfile.mkdtemp(prefix="qwen-recipe"))
        tiny_qwen_vl_dir(root / family, WORDS.split(), family)
        write_data(root)
        return root

    root = _shared(make)
    return root / family, root / "data.json"


def family(layout: pm.Layout | None) -> str:
    """The family a recipe layout trains (``None``: Qwen2-VL)."""
    return FAMILIES[layout.name.split()[0]] if layout else "qwen2_vl"


def data_module(source: Path, data: Path, **changes: Any) -> ConversationDataModule:
    """The conversation data with the directory's tokenizer and image processor."""
    args = {**DATA, **changes}
    return ConversationDataModule(
        train_file=str(data), image_root=str(data.parent), image_processor=str(source), **args
    )


def batches(steps: int = 2) -> list[dict[str, Tensor]]:
    """``steps`` copies of the one 4-row batch of the four records, in order."""
    source, data = files()
    module = data_module(source, data)
    batch = module.collator()([module.dataset()[i] for i in range(len(RECORDS))])
    return [batch for _ in range(steps)]


def module(source: Path, vocab_size: int, vision_parallel: str = "tp") -> ClipLlamaModule:
    """Every part trainable, caption loss only, a per-tower learning rate."""
    return ClipLlamaModule(
        pretrained=PretrainedConfig(hf=str(source)),
        finetune=FinetuneConfig(train_vision=True, train_decoder_layers=-1, train_embeddings=True),
        loss=LossConfig(contrastive_weight=0.0, mml=MMLConfig(weight=0.0), negatives="micro_batch"),
        optim=OptimConfig(lr=1e-3, lr_vision=5e-4, warmup_steps=1, min_lr_ratio=1.0),
        plan=FusionPlanOptions(vision_parallel=vision_parallel),  # type: ignore[arg-type]
        vocab_size=vocab_size,
    )


def run(layout: pm.Layout | None, rank: int = 0, name: str = "qwen2_vl") -> dict[str, Any]:
    """Train ``layout`` (``None``: one process of the family ``name``) on this rank: losses,
    first-step gradients, checkpoint bytes read, the experts read (``{parameter: (first,
    last + 1)}`` on dim 0), seconds and, for :data:`SAVED` / :data:`SAVED_4`, ``(last.ckpt,
    the directory)``."""
    start = time.perf_counter()
    source, _ = files(family(layout) if layout else name)
    data = batches()
    strategy: Any = "auto"
    devices = 1
    if layout is not None:
        data = [dp_rows(b, layout, rank) for b in data]
        strategy, devices = MultimodalParallelStrategy(**layout.strategy), layout.world
    m = module(source, 128, layout.vision_parallel if layout else "tp")
    m.text_length = TOKENS
    saved = layout is not None and layout.name in (*SAVED, *SAVED_4)
    ckpt = _shared(lambda: Path(tempfile.mkdtemp(prefix="qwen-run")) / "last.ckpt")
    callbacks = [SaveAtEnd(ckpt)] if saved else []
    torch.manual_seed(0)
    rec = rw.fit(m, data, strategy=strategy, devices=devices, callbacks=callbacks)
    return {
        "losses": rec.losses,
        "grads": rec.grads,
        "seconds": time.perf_counter() - start,
        "bytes_read": m.load_report.bytes_read if m.load_report else 0,
        "experts_read": _experts_read(m),
        "checkpoint": (ckpt, source) if saved else None,
    }


def dp_rows(batch: dict[str, Tensor], layout: pm.Layout, rank: int) -> dict[str, Tensor]:
    """This rank's rows of ``batch``: an even share (:func:`~tests.recipes.parity_matrix_worker.
    dp_slice`), or under :data:`UNEVEN` all rows but the last on dp rank 0, the last on 1."""
    dp, coord = layout.dims.dp, layout.dims.rank_coords(rank)["dp"]
    if layout.name != UNEVEN:
        return pm.dp_slice(batch, dp, coord)
    cut = batch["input_ids"].shape[0] - 1
    rows = slice(0, cut) if coord == 0 else slice(cut, None)
    return {k: v[rows] if isinstance(v, Tensor) else v for k, v in batch.items()}


def reference(cache: dict[str, Any], layout: pm.Layout) -> dict[str, Any]:
    """The one-process run of ``layout``'s family (run once per family, kept in ``cache``)."""
    name = family(layout)
    if name not in cache:
        cache[name] = run(None, name=name)
    return cache[name]


def _experts_read(module: ClipLlamaModule) -> dict[str, tuple[int, int]]:
    """``{expert parameter: (first expert, last + 1)}`` this rank read from the directory."""
    report = module.load_report
    read = report.read if report else {}
    return {
        name: (index[0].start, index[0].stop)
        for name, (_, index) in read.items()
        if ".experts.w_" in name
    }


def world(rank: int, world_size: int) -> dict[str, Any]:
    """Every recipe layout of this world size: ``{layout name: result}``."""
    names = pm.only()
    chosen = [x for x in LAYOUTS if x.world == world_size and (not names or x.name in names)]
    return {x.name: pm.named(x.name, rank, run, x, rank) for x in chosen}


def check_layout(layout: pm.Layout, results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Assert ``layout``'s per-rank ``results`` equal the one-process ``ref`` (losses and
    first-step gradients within 1e-5), that every rank read less than the whole
    checkpoint and, under expert parallelism, only its ``E / ep`` experts of every expert
    tensor, the ep ranks together all of them; print the figures."""
    grads: dict[str, Tensor] = {}
    loss_diff = 0.0
    for got in results:
        assert len(got["losses"]) == len(ref["losses"]) == 2, layout.name
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            loss_diff = max(loss_diff, abs(a - b) / abs(b))
        grads.update(got["grads"])
    assert grads.keys() == ref["grads"].keys(), grads.keys() ^ ref["grads"].keys()
    name, ratio = rw.worst_gradient(grads, ref["grads"])
    read = [r["bytes_read"] for r in results]
    took = max(r["seconds"] for r in results)
    print(
        f"qwen recipe | {layout.name} | loss {loss_diff:.1e} | gradient {ratio:.1e} ({name}) | "
        f"read {read} of {ref['bytes_read']} | {took:.1f} s"
    )
    assert loss_diff <= 1e-5 and ratio <= 1e-5, (layout.name, loss_diff, name, ratio)
    assert all(0 < b < ref["bytes_read"] for b in read), (read, ref["bytes_read"])
    ep = layout.dims.ep
    if ep > 1:
        spans = [set(r["experts_read"].values()) for r in results]
        assert all(len(s) == 1 and {b - a for a, b in s} == {EXPERTS // ep} for s in spans), spans
        assert set().union(*spans) == {
            (i * EXPERTS // ep, (i + 1) * EXPERTS // ep) for i in range(ep)
        }
        assert all(len(r["experts_read"]) == len(ref["experts_read"]) for r in results)


def hf_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' inputs for a one-sample-per-row batch of the data module: the ids,
    right padding as the attention mask, each row's patches and grids flattened."""
    grids = batch["image_grid_thw"][batch["image_mask"]]
    rows = batch["image_grid_thw"].prod(-1).sum(-1).tolist()
    pixels = torch.cat([batch["pixel_values"][r, :n] for r, n in enumerate(rows)])
    ids = batch["input_ids"]
    return {
        "input_ids": ids,
        "attention_mask": (batch["sample_ids"] >= 0).long(),
        "mm_token_type_ids": (ids == 100).int(),
        "pixel_values": pixels,
        "image_grid_thw": grids,
    }


def tensor_sizes(directory: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """``{key: (shape, bytes)}`` of a directory's safetensors files."""
    from safetensors import safe_open

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                t = handle.get_tensor(key)
                out[key] = (tuple(t.shape), t.numel() * t.element_size())
    return out


def check_export(name: str, ckpt: Path, source: Path, out: Path) -> None:
    """Assert ``export --verify`` of the recipe checkpoint ``ckpt`` (trained from ``source``)
    writes a transformers directory that ``from_pretrained`` loads exactly, with the source's
    tensor names, shapes and total bytes (every expert of a MoE model), a trained ``lm_head``,
    the source's tokenizer / processor files, and logits equal to the trained model's (1e-5).
    """
    import transformers

    from lightning_mmpar.models.hf.qwen3_convert import QWEN3_MOE_FAMILIES
    from lightning_mmpar.models.hf.qwen_convert import QWEN_FAMILIES
    from lightning_mmpar.recipes.export import main
    from lightning_mmpar.recipes.export_qwen import load_qwen_model

    result = main(["--ckpt", str(ckpt), "--out", str(out), "--verify"])
    assert result.files == ["hf", "export.json"] and result.diffs["hf"] == 0.0, result.diffs
    got, want = tensor_sizes(out / "hf"), tensor_sizes(source)
    assert got == want
    total = sum(b for _, b in got.values())
    cls = getattr(transformers, (QWEN_FAMILIES | QWEN3_MOE_FAMILIES)[source.name])
    exported = cls.from_pretrained(str(out / "hf")).eval()
    original = cls.from_pretrained(str(source)).eval()
    key = "lm_head.weight"  # trained: not the source's
    assert not torch.equal(exported.state_dict()[key], original.state_dict()[key])
    for side in ("tokenizer.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (out / "hf" / side).is_file(), side
    batch = batches(1)[0]
    inputs = hf_inputs(batch)
    with torch.no_grad():
        ours = load_qwen_model(ckpt, source)(batch)
        theirs = exported(**inputs).logits
    keep = inputs["attention_mask"].bool()
    diff = float((ours[keep] - theirs[keep]).abs().max() / theirs[keep].abs().max())
    print(f"qwen recipe | export of {name} | {len(got)} tensors, {total} bytes | logits {diff:.1e}")
    assert diff <= 1e-5
