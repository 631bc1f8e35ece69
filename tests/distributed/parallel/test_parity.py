"""TP x PP x DP layouts against a plain single-process torch loop (fp32, AdamW, 10 steps).

The mechanisms on a toy transformer (every schedule, both data-parallel engines, clipping in
three layouts, plain LightningModules, resume across layouts); the product's own model in every
shipped layout, 8 processes included, is ``tests/recipes/test_parity_matrix.py``.

Losses must match at every step (relative 1e-5) and first-step gradients (relative to each
tensor's largest entry, 1e-5). Final weights are compared with an absolute 5e-4: Adam divides by
sqrt(v), so a gradient entry that is ~0 turns summation-order noise (1e-9) into an lr-sized
(1e-2) update; 5e-4 is 5% of one step and still catches any wrong gradient.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mmpar.testing import spawn
from tests.distributed.parallel import parity_worker as pw

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
WEIGHT_ATOL = 5e-4


CLIP = 0.5  # below the toy's gradient norm (~1-3) for the first steps: clipping is active


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return pw.reference()


@pytest.fixture(scope="module")
def ref_clipped() -> dict[str, Any]:
    return pw.reference(clip=CLIP)


def merged(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r[key])
    return out


def check(name: str, results: list[dict[str, Any]], ref: dict[str, Any], first: int = 0) -> float:
    """Assert parity of one run (every rank's view); return the max relative loss difference."""
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results), f"{name}: ranks logged different losses"
    expected = ref["losses"][first:]
    assert len(losses) == len(expected), name
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    assert rel < LOSS_RTOL, f"{name}: loss differs by {rel:.2e} (relative)"
    weights = merged(results, "weights")
    assert weights.keys() == ref["weights"].keys(), name
    for k, w in ref["weights"].items():
        torch.testing.assert_close(weights[k], w, rtol=0, atol=WEIGHT_ATOL, msg=f"{name}: {k}")
    if "val_loss" in results[0]:
        for r in results:
            err = abs(r["val_loss"] - ref["val_loss"]) / ref["val_loss"]
            assert err < LOSS_RTOL, f"{name}: validation loss differs by {err:.2e}"
    if "grads" in results[0]:
        grads = merged(results, "grads")
        assert grads.keys() == ref["grads"].keys(), f"{name}: missing gradients"
        for k, g in ref["grads"].items():
            err = ((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
            assert err < GRAD_RTOL, f"{name}: gradient of {k} differs by {err:.2e}"
    print(f"{name}: max relative loss difference {rel:.2e}")
    return rel


def _by_job(results: list[dict[str, Any]], job: str) -> list[dict[str, Any]]:
    return [r[job] for r in results]


def test_two_rank_layouts(ref: dict[str, Any], ref_clipped: dict[str, Any]) -> None:
    clipped = [  # Trainer(gradient_clip_val=...): the norm spans every shard and stage
        ("121-clip", "layout", (1, 2, 1, "1f1b", 1, "fsdp", pw.STEPS, CLIP)),
        ("112-clip", "layout", (1, 1, 2, "1f1b", 1, "fsdp", pw.STEPS, CLIP)),
        ("211-clip", "layout", (2, 1, 1, "1f1b", 1, "fsdp", pw.STEPS, CLIP)),
    ]
    jobs = [
        ("211", "layout", (2, 1, 1)),
        ("121", "layout", (1, 2, 1)),
        ("112", "layout", (1, 1, 2)),
        ("211-ddp", "layout", (2, 1, 1, "1f1b", 1, "ddp")),
        ("121-gpipe", "layout", (1, 2, 1, "gpipe")),
        ("121-interleaved", "layout", (1, 2, 1, "interleaved_1f1b", 2)),
    ]
    res = spawn(pw.run_many, 2, [*jobs, *clipped, ("batch_sizes", "batch_sizes", ())])
    for r in _by_job(res, "batch_sizes"):
        # evaluation batches of another size get their own schedule ...
        assert abs(r[4][0]["val_loss"] - ref["val_loss"]) / ref["val_loss"] < LOSS_RTOL
        # ... and batches the micro-batches do not divide run their stages in order
        assert isinstance(r[6], list), r[6]
        assert abs(r[6][0]["val_loss"] - ref["val_loss"]) / ref["val_loss"] < LOSS_RTOL
        assert 0 < r["fit_then_validate"] < ref["val_loss"]  # trained, on the same Trainer
    for name, _, _ in jobs:
        check(name, _by_job(res, name), ref)
    for name, _, _ in clipped:
        check(name, _by_job(res, name), ref_clipped)


def test_four_rank_layouts_plain_module_and_resume(ref: dict[str, Any], tmp_path: Path) -> None:
    jobs = [
        ("221", "layout", (2, 2, 1)),
        ("212", "layout", (2, 1, 2)),
        ("122", "layout", (1, 2, 2)),
        ("plain-tp2-dp2-fsdp", "plain", (2, "fsdp")),
        ("plain-tp2-dp2-ddp", "plain", (2, "ddp")),
        # a module written for Lightning's ModelParallelStrategy runs unchanged
        ("lightning-names-tp2-dp2", "plain", (2, "fsdp", True)),
        ("resume", "resume", ()),
    ]
    res = spawn(pw.run_many, 4, jobs, str(tmp_path))
    for name, fn, _ in jobs:
        if fn != "resume":
            check(name, _by_job(res, name), ref)
    # collectives of the strategy (world = 4: tp2 x dp2), seen from every rank
    for rank, probe in enumerate(r["probe"] for r in _by_job(res, "plain-tp2-dp2-ddp")):
        assert probe["reduce_mean"] == 1.5 and probe["reduce_sum"] == 6.0
        assert probe["broadcast"] == {"from": 0}
        assert probe["all_gather"] == [0.0, 1.0, 2.0, 3.0]
        # data are sharded over the dp ranks only: tp peers (0,1) and (2,3) read the same shard
        assert probe["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert probe["coords"]["tp"] == rank % 2 and probe["coords"]["dp"] == rank // 2
    # Resume at step 5 in the same layout and in the other one (tp2 pp2 <-> tp1 pp1 dp4):
    # steps 6..10 equal the uninterrupted single-process run, and so do the final weights.
    resumed = _by_job(res, "resume")
    assert len(resumed[0]) == 4
    for case in resumed[0]:
        check(f"resume {case}", [r[case] for r in resumed], ref, first=5)
