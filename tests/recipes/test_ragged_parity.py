"""Ragged batches through the layouts (issue 28 items 3, 5): one spawned world per size runs
every ragged layout of :data:`ragged_parity_worker.LAYOUTS`; each layout's losses and
first-step gradients equal one process within a relative 1e-5, and a data-parallel rank with
a text-only batch beside one with images completes (the world's timeout is the failure)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_mmpar.testing import spawn
from tests.recipes import ragged_parity_worker as rp
from tests.recipes import recipe_faults_worker as rw

RTOL = 1e-5
_WORLDS: dict[int, Any] = {}


@pytest.fixture(scope="module")
def references() -> dict[str | None, rw.Recorder]:
    return {moe: rp.reference(moe) for moe in sorted({x.moe for x in rp.LAYOUTS}, key=str)}


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
    ref = references[layout.moe]
    results = [r[layout.name] for r in _world(layout.world)]
    grads: dict[str, Any] = {}
    loss_diff = 0.0
    for got in results:
        assert len(got["losses"]) == len(ref.losses), layout.name
        for a, b in zip(got["losses"], ref.losses, strict=True):
            loss_diff = max(loss_diff, abs(a - b) / abs(b))
        grads.update(got["grads"])
    assert grads.keys() == ref.grads.keys(), (layout.name, grads.keys() ^ ref.grads.keys())
    name, ratio = rw.worst_gradient(grads, ref.grads)
    took = max(r["seconds"] for r in results)
    print(
        f"ragged | {layout.name} | loss {loss_diff:.1e} | gradient {ratio:.1e} ({name}) | "
        f"{took:.1f} s"
    )
    assert loss_diff <= RTOL and ratio <= RTOL, (layout.name, loss_diff, name, ratio)


@pytest.mark.distributed
def test_pipeline_ranks_with_different_batch_shapes_stop_with_one_clear_error() -> None:
    messages = [r["shape mismatch"] for r in _world(2)]
    assert all("pipeline ranks got batches of different shapes" in m for m in messages), messages
    assert f"(4, {rp.TOKENS + 2})" in messages[0] and f"(4, {rp.TOKENS})" in messages[0]
