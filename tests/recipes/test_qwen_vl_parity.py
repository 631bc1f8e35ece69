"""Qwen2-VL / Qwen2.5-VL in the layouts (issue 29 item 3): one spawned 2-process world runs
every 2-process layout of :data:`qwen_vl_worker.LAYOUTS` (tp2 with the ViT sharded or
replicated, pp2 1F1B, dp2 FSDP2; their 4-process tp2 x pp2 runs in the ragged world) and the
tp2 eval logits; losses and first-step gradients equal one process within a relative 1e-5, the
tp2 logits equal the unsharded model's within 1e-5. The same world trains through the recipe
(:mod:`qwen_recipe_worker`: ``model.pretrained.hf``, the conversation data with the
directory's image processor) Qwen2-VL in tp2, tp2 with a data-parallel ViT, pp2 and dp2 FSDP2
and Qwen3-VL-MoE in ep2, equal to one process, each rank reading its slices (and experts)
only; the Qwen2-VL tp2, dp2 FSDP2 and pp2 checkpoints export to transformers directories with
the source's tensor names, shapes and bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mmpar.testing import spawn
from tests.recipes import qwen_recipe_worker as qr
from tests.recipes import qwen_vl_worker as qw
from tests.recipes import recipe_faults_worker as rw
from tests.unit.models import qwen_vl_cases as qc

RTOL = 1e-5
_WORLD: list[Any] = []


@pytest.fixture(scope="module")
def references() -> dict[str, rw.Recorder]:
    return {name: qw.reference(name) for name in ("qwen2_vl", "qwen2_5_vl")}


def _world() -> list[dict[str, Any]]:
    if not _WORLD:
        try:
            _WORLD.append(spawn(qw.world, 2, timeout=600))
        except Exception as err:  # kept: the other checks of this world fail with it
            _WORLD.append(err)
    got = _WORLD[0]
    if isinstance(got, Exception):
        raise RuntimeError("the 2-process Qwen-VL world failed (see its error)") from got
    return got


def test_batches_mix_text_only_one_and_two_image_rows() -> None:
    first, second = qw.batches()
    assert first["image_mask"].sum(1).tolist() == [0, 1, 2, 1]
    assert second["image_mask"].sum(1).tolist() == [2, 2, 0, 0]  # pp2's 2nd micro-batch: none
    assert second["sample_ids"].amax(1).tolist() == [1, 1, 1, 0]  # packed rows
    assert first["pixel_values"].shape == second["pixel_values"].shape


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [x for x in qw.LAYOUTS if x.world == 2], ids=lambda x: x.name)
def test_layout_matches_one_process(layout: Any, references: Any) -> None:
    results = [r[layout.name] for r in _world()]
    qw.check_layout("qwen-vl", layout, results, references[qw.family(layout)])


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_tp2_logits_match_the_unsharded_model(family: str) -> None:
    worst = 0.0
    for rank in _world():
        got = rank[f"{family} tp2 logits"]
        worst = max(worst, qc.relative(got["got"], got["want"]))
    print(f"qwen-vl | {family} tp2 eval logits | {worst:.1e}")
    assert worst <= RTOL


@pytest.fixture(scope="module")
def recipe_references() -> dict[str, Any]:
    return {}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [x for x in qr.LAYOUTS if x.world == 2], ids=lambda x: x.name)
def test_recipe_layout_matches_one_process(layout: Any, recipe_references: Any) -> None:
    """Qwen2-VL in tp2 (ViT tp / dp), pp2, dp2 FSDP2 and Qwen3-VL-MoE in ep2 (FSDP2) through
    the recipe: equal to one process, each rank reading its slices (and experts) only."""
    ref = qr.reference(recipe_references, layout)
    qr.check_layout(layout, [r[layout.name] for r in _world()], ref)


@pytest.mark.distributed
@pytest.mark.parametrize("name", qr.SAVED)
def test_recipe_export_from_sharded_checkpoint(name: str, tmp_path: Path) -> None:
    """A Qwen2-VL checkpoint written in tp2 / dp2 FSDP2 / pp2 exports (``export --verify``) to
    a transformers directory: ``from_pretrained`` loads the written tensors exactly, with the
    source directory's tensor names, shapes and total bytes, and its logits are the trained
    model's (1e-5); the source's tokenizer and processor files come along."""
    ckpt, source = _world()[0][name]["checkpoint"]
    qr.check_export(name, ckpt, source, tmp_path)


@pytest.mark.distributed
def test_recipe_export_refuses_a_checkpoint_missing_a_shard(tmp_path: Path) -> None:
    """A copy of the tp2 checkpoint without rank 1's shard file: refused naming that file and
    the tensors it held, nothing written."""
    import shutil

    from lightning_mmpar.recipes.export import export_checkpoint

    ckpt, _ = _world()[0][qr.SAVED[0]]["checkpoint"]
    copy = tmp_path / "partial.ckpt"
    shutil.copytree(ckpt, copy)
    shard = sorted(copy.glob("*.distcp"))[-1]
    shard.unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=shard.name) as err:
        export_checkpoint(copy, tmp_path / "out")
    assert "tensor(s): state_dict.blocks." in str(err.value), err.value  # what it held
    assert not (tmp_path / "out" / "hf").exists()
