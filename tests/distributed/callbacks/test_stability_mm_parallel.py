"""Stability callbacks under ``mm_parallel``: one 4-rank gloo world, two layouts.

tp2 x dp2 (``data_parallel="ddp"``): a clean run, then a LayerNorm weight (replicated over tp
and over dp) perturbed on rank 3. tp2 x pp2 (1F1B, 4 micro-batches): a clean run, then FP8
layers (converted before the TP plan) with a NaN put into rank 3's shard of a column-parallel
weight gradient. Rank layout: tp fastest, then dp, then pp.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from lightning_mmpar.testing import spawn
from tests.distributed.callbacks.stability_matrix import check_matrix
from tests.distributed.callbacks.stability_worker import mm_world, read_jsonl
from tests.distributed.parallel.parity_worker import reference

pytestmark = pytest.mark.distributed

Results = tuple[list[dict[str, Any]], Path]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Results:
    root = tmp_path_factory.mktemp("stability_mm")
    return spawn(mm_world, 4, str(root)), root


def test_tp_replicated_norm_drift_on_tp_and_dp_groups(world: Results) -> None:
    results, root = world
    recs = read_jsonl(root / "drift_tp2dp2" / "anomalies.jsonl")
    drift = [r for r in recs if r["kind"] == "replica_drift"]
    norm = [r for r in drift if r["param"] == "layers.0.norm1.weight"]
    # rank 3's tp group is {2, 3}, its dp group {1, 3}; rank 0 shares neither
    assert sorted((r["group"], r["rank"]) for r in norm) == [
        ("dp", 1),
        ("dp", 3),
        ("tp", 2),
        ("tp", 3),
    ]
    for r in norm:
        assert r["step"] == 4 and r["shape"] == [32]
        assert r["values"]["drifting_ranks"] == [3] and r["values"]["worst_index"]["3"] == 3
        assert r["values"]["max_abs_diff"]["3"] == pytest.approx(1e-2, rel=1e-3)
        assert r["values"]["ambiguous"]  # two-rank groups: a tie, the lowest rank is reference
    # the perturbed weight also changed rank 3's gradients upstream (embeddings): reported too,
    # but never a tensor-parallel shard compared across tp
    sharded = ("q.", "k.", "v.", "o.", "up.", "down.weight")
    assert not [r for r in drift if r["group"] == "tp" and any(s in r["param"] for s in sharded)]
    # recovery (restore snapshot, redo step 3, step) makes all replicas agree again
    prints = [r["drift_tp2dp2"]["fingerprints"]["layers.0.norm1.weight"] for r in results]
    assert all(p == prints[0] for p in prints)
    for r in results:
        case = r["drift_tp2dp2"]
        assert case["counters"]["redone_steps"] == 1 and case["counters"]["rolled_back_steps"] == 0
        assert len(case["losses"]) == 6 and all(math.isfinite(v) for v in case["losses"])
        assert case["groups"] == {"dp": (54, 0), "tp": (26, 28)}


def test_nan_in_one_tp_shard_under_pipeline_falls_back(world: Results) -> None:
    results, root = world
    recs = read_jsonl(root / "nan_tp2pp2" / "anomalies.jsonl")
    assert not [r for r in recs if r["kind"] == "replica_drift"]  # FP8 x TP keeps norms equal
    local = [r for r in recs if r["kind"] == "nonfinite_local_grad"]
    assert [(r["step"], r["rank"], r["param"], r["shape"]) for r in local] == [
        (2, 3, "layers.3.up.weight", [64, 32])
    ]
    fallbacks = [r for r in recs if r["kind"] == "fp8_fallback"]
    assert sorted(r["rank"] for r in fallbacks) == [0, 1, 2, 3]
    for r in fallbacks:
        assert r["step"] == 2 and r["values"]["attempt"] == 1
        origin = [x for x in r["values"]["reasons"] if x["kind"] == "nonfinite_local_grad"]
        assert [(x["rank"], x["param"], x["shape"]) for x in origin] == [
            (3, "layers.3.up.weight", [64, 32])
        ]
        if r["rank"] in (2, 3):  # the pipeline stage holding layers.3
            assert r["param"] == "layers.3.up" and r["shape"] == [64, 32]
            assert r["values"]["global_shape"] == [128, 32]
        else:
            assert r["param"] is None and "switched no module" in r["action"]
        assert math.isfinite(r["values"]["grad_norm_after_redo"])
    for r in results:
        case = r["nan_tp2pp2"]
        assert case["counters"]["redone_steps"] == 1 and case["counters"]["attempts"] == 1
        assert not case["pipeline_grads_left"]
        assert len(case["losses"]) == 6 and all(math.isfinite(v) for v in case["losses"])
        assert case["losses"][-1] < case["losses"][0]
        bf16 = sorted(n for n, p in case["precision"].items() if p == "bf16")
        assert bf16 == (["layers.3.up"] if r["nan_tp2pp2"]["rank"] >= 2 else [])
    assert len({r["nan_tp2pp2"]["losses"][-1] for r in results}) == 1
    # the fallen-back step stays close to the clean fp32 run
    clean = results[0]["clean_tp2pp2"]["losses"]
    assert results[0]["nan_tp2pp2"]["losses"][-1] == pytest.approx(clean[-1], rel=0.05)


@pytest.mark.parametrize("layout", ["clean_tp2dp2", "clean_tp2pp2"])
def test_clean_run_global_grad_norm_and_noise_scale(world: Results, layout: str) -> None:
    results, root = world
    assert not (root / layout / "anomalies.jsonl").exists()
    ref = reference(steps=1)
    ref_norm = math.sqrt(sum(float(g.double().square().sum()) for g in ref["grads"].values()))
    for r in results:
        case = r[layout]
        assert case["records"] == [] and case["counters"]["redone_steps"] == 0
        probe = case["probe"]
        # the monitor's norm (weighted local squares, one all-reduce) = full-gradient norm
        assert probe["monitor"] == pytest.approx(probe["full"], rel=1e-6)
        assert probe["monitor"] == pytest.approx(ref_norm, rel=1e-5)
        assert case["noise_scale"] is not None and math.isfinite(case["noise_scale"])
        assert case["ratio"] > 1.0  # the pre-sync (micro-batch) gradient is the noisier one
    for key in ("noise_scale", "grad_norm", "ratio"):
        assert len({r[layout][key] for r in results}) == 1
    if layout == "clean_tp2pp2":  # pipeline ranks never compared: tp groups inside a stage
        assert [set(r[layout]["groups"]) for r in results] == [{"tp"}] * 4


@pytest.mark.parametrize("kind", ["tp2dp2", "mm"])
def test_user_module_matrix(world: Results, kind: str) -> None:
    """Issue 15.2: ModelParallelStrategy tp2 x dp2 (the user's parallelize_module and
    fully_shard) and mm_parallel dp4, with an ordinary user module."""
    check_matrix(world[0], kind)
