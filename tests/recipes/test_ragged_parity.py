"""Ragged batches through the layouts (issue 28 items 3, 5): one spawned world per size (2, 4
and 8 processes) runs every ragged layout of :data:`ragged_parity_worker.LAYOUTS`; each
layout's losses and first-step gradients equal one process within a relative 1e-5, and a
data-parallel rank with a text-only batch beside one with images completes (the world's timeout
is the failure). The 2-process world also runs tp 2 on batches with no image slot at all, and
a user's own module that skips its vision tower on a text-only rank
(:mod:`skipped_tower_worker`).

The 2- and 4-process worlds also train transformers' LLaVA (issue 29, :mod:`hf_llava_worker`):
one process's logits equal ``LlavaForConditionalGeneration``'s per sample, and tp2, pp2,
tp2 x pp2 and dp2 FSDP2 equal one process (first-step logits, losses, first-step gradients,
1e-5); the tp2 and dp2 FSDP2 checkpoints export bit-exactly. The 4-process world also runs
the Qwen families' 4-process layouts (issue 29): Qwen2.5-VL tp2 x pp2 and Qwen3-VL-MoE
ep2 x tp2 / ep2 x pp2 / tp2 x pp2 (:mod:`qwen_vl_worker`, :mod:`qwen3_moe_worker`), Qwen2-VL
tp2 x pp2 and Qwen3-VL-MoE ep2 x tp2 through the recipe (:mod:`qwen_recipe_worker`), the latter's
checkpoint exported with every expert."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mmpar.testing import spawn
from tests.recipes import hf_llava_worker as hw
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import qwen3_moe_worker as mw
from tests.recipes import qwen_recipe_worker as qr
from tests.recipes import qwen_vl_worker as qw
from tests.recipes import ragged_parity_worker as rp
from tests.recipes import recipe_faults_worker as rw
from tests.recipes import skipped_tower_worker as sw

RTOL = 1e-5
_WORLDS: dict[int, Any] = {}


@pytest.fixture(scope="module")
def references() -> dict[tuple[str | None, int], rw.Recorder]:
    keys = sorted({(x.moe, x.accumulate) for x in rp.LAYOUTS}, key=str)
    return {key: rp.reference(*key) for key in keys}


def _world(size: int) -> list[dict[str, Any]]:
    if size not in _WORLDS:
        try:
            _WORLDS[size] = spawn(rp.world, size, timeout=600)
        except Exception as err:  # kept: the other layouts of this world fail with it
            _WORLDS[size] = err
    got = _WORLDS[size]
    if isinstance(got, Exception):
        raise RuntimeError(f"the {size}-process ragged world failed (see its error)") from got
    return got


def test_batches_mix_text_only_one_and_three_image_samples() -> None:
    first = rp.batches()[0]
    per_row = first["image_mask"].sum(1).tolist()
    assert per_row == [4, 2, 0, 0], per_row
    assert first["input_ids"].shape == (4, rp.TOKENS)
    assert int(first["sample_ids"].max()) == 2  # three packed samples in a row


@pytest.mark.distributed
@pytest.mark.parametrize("layout", rp.LAYOUTS, ids=[x.name for x in rp.LAYOUTS])
def test_ragged_layout_matches_one_process(layout: Any, references: Any) -> None:
    ref = references[layout.moe, layout.accumulate]
    results = [r[layout.name] for r in _world(layout.world)]
    rw.check_parity("ragged", layout.name, results, ref, RTOL)


@pytest.mark.distributed
def test_pipeline_ranks_with_different_batch_shapes_stop_with_one_clear_error() -> None:
    messages = [r["shape mismatch"] for r in _world(2)]
    assert all("pipeline ranks got batches of different shapes" in m for m in messages), messages
    assert f"(4, {rp.TOKENS + 2})" in messages[0] and f"(4, {rp.TOKENS})" in messages[0]


@pytest.mark.distributed
def test_tp2_batch_with_no_image_slot_matches_one_process() -> None:
    ref = rw.fit(pm.build(rp.VOCAB, None), rp.text_only_batches())
    results = [r["no image slot"] for r in _world(2)]
    for got in results:
        for a, b in zip(got["losses"], ref.losses, strict=True):
            assert abs(a - b) <= RTOL * abs(b), (got["losses"], ref.losses)
    grads = {k: v for got in results for k, v in got["grads"].items()}
    name, ratio = rw.worst_gradient(grads, ref.grads)
    assert grads.keys() == ref.grads.keys() and ratio <= RTOL, (name, ratio)


@pytest.mark.distributed
def test_own_module_that_skips_its_tower_on_one_rank_trains_or_stops_clearly() -> None:
    """FSDP2: every rank raises the same error naming each rank's next unit and the fix,
    within seconds; DDP, and FSDP2 with the documented dummy-image fix: trains, equal to one
    process (rank 1 never ran the tower, yet its tower weights moved as rank 0's did)."""
    runs = [r["skipped tower"] for r in _world(2)]
    ref = sw.reference()
    for name in ("ddp skipped", "fsdp dummy", "fsdp dummy, unchecked"):
        for rank, run in enumerate(runs):
            assert "error" not in run[name], (name, rank, run[name].get("error"))
            got = run[name]["weights"]
            worst = max(float((got[n] - w).norm() / w.norm()) for n, w in ref.items())
            assert worst <= RTOL, (name, rank, worst)
    for run in runs:  # check_unit_order=False: no guard, none of its pre-hooks (one per unit)
        checked, unchecked = run["fsdp dummy"], run["fsdp dummy, unchecked"]
        assert checked["guarded"] and not unchecked["guarded"], run
        assert checked["units"] == unchecked["units"] > 0, run
        assert checked["hooks"] == unchecked["hooks"] + checked["units"], run
    for rank, run in enumerate(runs):  # the guard's gloo group beside an NCCL dp group
        got = run["nccl group"]
        assert got["new"] and got["backend"] == "gloo" and got["ranks"] == [0, 1], (rank, got)
        assert got["gathered"] == [10, 11], (rank, got)
    messages = [run["fsdp skipped"].get("error", "no error") for run in runs]
    assert len(set(messages)) == 1, messages
    assert "rank 0: 'vision'; rank 1: 'layers.0'" in messages[0], messages[0]
    assert "dummy input" in messages[0] and "data_parallel='ddp'" in messages[0], messages[0]
    assert max(run["fsdp skipped"]["seconds"] for run in runs) < 30, runs


@pytest.fixture(scope="module")
def llava_reference() -> dict[str, Any]:
    return hw.run(None)


def test_llava_recipe_logits_match_transformers(llava_reference: dict[str, Any]) -> None:
    """The recipe's model read from the LLaVA directory (``model.pretrained.hf``) gives
    transformers' logits on every packed sample of the first batch (run per sample)."""
    from transformers import LlavaForConditionalGeneration

    path = hw.checkpoint()
    oracle = LlavaForConditionalGeneration.from_pretrained(str(path), local_files_only=True)
    batch, logits = hw.batches()[0], llava_reference["logits"]
    worst, samples = 0.0, 0
    for row, images in enumerate(hw.IMAGES):
        for sid, count in enumerate(images):
            where = batch["sample_ids"][row] == sid
            mine = batch["image_mask"][row] & (batch["image_sample"][row] == sid)
            pix = batch["pixel_values"][row][mine] if count else None
            with torch.no_grad():
                want = oracle(input_ids=batch["input_ids"][row][where][None], pixel_values=pix)
            got = logits[row][where][:, : want.logits.shape[-1]]
            worst = max(worst, float((got - want.logits[0]).abs().max() / want.logits.abs().max()))
            samples += 1
    print(f"llava | recipe vs transformers | logits {worst:.1e} | {samples} samples")
    assert samples == 8 and worst <= RTOL


@pytest.mark.distributed
@pytest.mark.parametrize("layout", hw.LAYOUTS, ids=[x.name for x in hw.LAYOUTS])
def test_llava_layout_matches_one_process(layout: Any, llava_reference: dict[str, Any]) -> None:
    ref = llava_reference
    results = [r[layout.name] for r in _world(layout.world)]
    grads: dict[str, Any] = {}
    loss_diff = logit_diff = 0.0
    rows = [r["logits"] for r in results if r["logits"] is not None]
    dp = layout.dims.dp
    for got in results:
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            loss_diff = max(loss_diff, abs(a - b) / abs(b))
        grads.update(got["grads"])
    assert len(results[0]["losses"]) == len(ref["losses"])
    full = torch.cat(rows[:: max(1, len(rows) // dp)]) if dp > 1 else rows[0]
    logit_diff = float((full - ref["logits"]).abs().max() / ref["logits"].abs().max())
    assert grads.keys() == ref["grads"].keys(), grads.keys() ^ ref["grads"].keys()
    name, ratio = rw.worst_gradient(grads, ref["grads"])
    took = max(r["seconds"] for r in results)
    print(
        f"llava | {layout.name} | logits {logit_diff:.1e} | loss {loss_diff:.1e} | gradient "
        f"{ratio:.1e} ({name}) | {took:.1f} s"
    )
    assert max(logit_diff, loss_diff, ratio) <= RTOL, (layout.name, logit_diff, loss_diff, ratio)
    read = [r["bytes_read"] for r in results]  # each rank its shard, stage or slice only
    assert all(0 < b < ref["bytes_read"] for b in read), (read, ref["bytes_read"])


@pytest.mark.distributed
@pytest.mark.parametrize("name", hw.SAVED)
def test_llava_export_from_sharded_checkpoint(name: str, tmp_path: Any) -> None:
    """A checkpoint written in tp2 / dp2 FSDP2 exports (``export --verify``) to a transformers
    directory: ``from_pretrained`` loads exactly the checkpoint's weights (max abs diff 0), the
    same tensor names, shapes and bytes as the source checkpoint, and its logits are the
    trained model's."""
    from transformers import LlavaForConditionalGeneration

    from lightning_mmpar.recipes.export import export_checkpoint, load_fusion_model

    ckpt, source = _world(2)[0][name]["checkpoint"]
    result = export_checkpoint(ckpt, tmp_path, verify=True)
    assert "hf" in result.files and result.diffs["hf"] == 0.0, result.diffs
    assert qr.tensor_sizes(tmp_path / "hf") == qr.tensor_sizes(source)
    exported = LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    original = LlavaForConditionalGeneration.from_pretrained(str(source)).eval()
    key = "lm_head.weight"  # trained: not the source's
    assert not torch.equal(exported.state_dict()[key], original.state_dict()[key])
    model = load_fusion_model(ckpt)[0]
    batch = hw.batches()[0]
    row = batch["sample_ids"][1] == 0  # the two-image sample
    with torch.no_grad():
        ours = model.forward_ragged(batch).logits[1][row][:, :64]
        pix = batch["pixel_values"][1][batch["image_mask"][1]]
        want = exported(input_ids=batch["input_ids"][1][row][None], pixel_values=pix).logits[0]
    diff = float((ours - want).abs().max() / want.abs().max())
    print(f"llava | export of {name} | weights 0 | logits {diff:.1e}")
    assert diff <= RTOL


@pytest.fixture(scope="module")
def qwen_recipe_references() -> dict[str, Any]:
    return {}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [x for x in qr.LAYOUTS if x.world == 4], ids=lambda x: x.name)
def test_qwen_recipe_4_process_layout_matches_one_process(
    layout: Any, qwen_recipe_references: dict[str, Any]
) -> None:
    """Qwen2-VL in tp2 x pp2 and Qwen3-VL-MoE in ep2 x tp2 through the recipe
    (``model.pretrained.hf``): losses and first-step gradients equal one process (1e-5), each
    rank reading only its slices (and its half of the experts)."""
    ref = qr.reference(qwen_recipe_references, layout)
    qr.check_layout(layout, [r[layout.name] for r in _world(4)], ref)


@pytest.mark.distributed
@pytest.mark.parametrize("name", qr.SAVED_4)
def test_qwen3_recipe_export_from_ep2_x_tp2_checkpoint(name: str, tmp_path: Any) -> None:
    """The Qwen3-VL-MoE checkpoint written in ep2 x tp2 (experts over ep, attention over tp,
    FSDP2 over dp) exports (``export --verify``) to a transformers directory with every
    expert: the source's tensor names, shapes and total bytes, its logits the trained
    model's (1e-5)."""
    ckpt, source = _world(4)[0][name]["checkpoint"]
    qr.check_export(name, ckpt, source, tmp_path)


@pytest.fixture(scope="module")
def qwen_family_references() -> dict[str, rw.Recorder]:
    return {}


QWEN_4 = [x for x in (*qw.LAYOUTS, *mw.LAYOUTS) if x.world == 4]
"""Qwen2.5-VL tp2 x pp2, Qwen3-VL-MoE ep2 x tp2 and ep2 x pp2 (the models' own modules)."""


@pytest.mark.distributed
@pytest.mark.parametrize("layout", QWEN_4, ids=lambda x: x.name)
def test_qwen_family_layout_matches_one_process(
    layout: Any, qwen_family_references: dict[str, rw.Recorder]
) -> None:
    """Qwen2.5-VL in tp2 x pp2 and Qwen3-VL-MoE in ep2 x tp2 / ep2 x pp2 (FSDP2 over the
    data-parallel ranks): both steps' losses and the first step's gradients equal one
    process (1e-5) on batches mixing text-only, one-image and two-image samples of two
    resolutions."""
    family = qw.family(layout)
    if family not in qwen_family_references:
        moe = family == "qwen3_vl_moe"
        qwen_family_references[family] = mw.reference()[0] if moe else qw.reference(family)
    ref = qwen_family_references[family]
    qw.check_layout(family, layout, [r[layout.name] for r in _world(4)], ref)
