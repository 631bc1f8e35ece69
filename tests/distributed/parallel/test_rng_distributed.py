"""The model-parallel RNG in one real 4-process gloo world (tp2 x dp2, ParallelDims' mesh).

Checked directly on the masks every rank draws: the ``replicated`` region gives equal masks on
TP peers and different ones across dp replicas, the ``tensor-parallel`` region different masks
everywhere; forks leave the default generator's next draws as they were (equal on all ranks);
the same seed gives the same masks again. Then the fusion model after ``parallelize_fusion`` at
tp2 with adapter dropout 0.5 in train mode: without sequence parallel the adapters' residual
branch masks and outputs are identical on TP peers, with it each TP rank's sequence shard gets
its own mask; dp replicas differ in both. A control run with torch's dropout
(``apply_tensor_parallel``, which keeps it) shows the fault the plan fixes: equal masks on dp
replicas, and the same mask pattern on both sequence shards.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.random import (
    ParallelDropout,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from lightning_mmpar.plans.fusion import (
    FusionPlanOptions,
    apply_tensor_parallel,
    parallelize_fusion,
)
from lightning_mmpar.testing import spawn
from lightning_mmpar.topology import ParallelDims
from tests.builders import tiny_fusion_model

pytestmark = pytest.mark.distributed

SEED = 1234
PEERS = ((0, 1), (2, 3))  # tp groups (Megatron order: tp fastest)
REPLICAS = ((0, 2), (1, 3))  # dp groups


def tiny_fusion() -> FusionModel:
    """The ``tp`` preset with two adapter blocks and adapter dropout 0.5 (masks to compare)."""
    return tiny_fusion_model("tp", adapter__num_blocks=2, adapter__dropout=0.5)


def region_masks(dims: ParallelDims) -> dict[str, Tensor]:
    x = torch.ones(4096)
    out = {}
    for region in ("replicated", "tensor-parallel"):
        drop = ParallelDropout(0.5, region=region, dims=dims)
        out[region] = torch.stack([drop(x) != 0 for _ in range(2)])
    return out


def adapter_masks(model: FusionModel, batch: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Every adapter's dropout masks (local tensors) and outputs in one train-mode forward."""
    seen: dict[str, Tensor] = {}
    hooks = []
    for i, adapter in enumerate(model.adapters):

        def keep_mask(_m: Any, inp: Any, out: Tensor, i: int = i) -> None:
            n = sum(k.startswith(f"mask{i}.") for k in seen)
            seen[f"mask{i}.{n}"] = (out != 0) | (inp[0] == 0)

        def keep_out(_m: Any, _inp: Any, out: Tensor, i: int = i) -> None:
            seen[f"out{i}"] = out.detach().clone()

        hooks += [model.get_submodule(f"adapters.{i}.dropout").register_forward_hook(keep_mask)]
        hooks += [adapter.register_forward_hook(keep_out)]
    model.train()
    out = model(*batch)
    loss = out.image_features.sum() + out.text_features.sum()
    loss.backward()  # masks must also work through backward
    for h in hooks:
        h.remove()
    return seen


def worker(rank: int, world: int) -> dict[str, Any]:
    dims = ParallelDims(world_size=world, tp=2)
    dims.build_mesh("cpu")
    result: dict[str, Any] = {"coords": (dims.local_rank("tp"), dims.local_rank("dp"))}
    # regions, the default stream, determinism
    torch.manual_seed(SEED)
    plain = torch.rand(16)
    torch.manual_seed(SEED)
    result["regions"] = region_masks(dims)
    result["after_forks"] = torch.rand(16)
    result["plain"] = plain
    torch.manual_seed(SEED)
    get_rng_tracker().reset()
    result["rerun"] = region_masks(dims)
    model_parallel_manual_seed(SEED + 1, dims)
    result["explicit"] = region_masks(dims)
    get_rng_tracker().reset()
    # the fusion model, with and without sequence parallel, and torch's dropout as control
    ref = tiny_fusion()
    torch.manual_seed(5)  # the same batch on every rank: only masks can differ
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 8)), torch.ones(2, 8).long())
    for sp in (False, True):
        torch.manual_seed(SEED)
        options = FusionPlanOptions(sequence_parallel=sp)
        model = parallelize_fusion(copy.deepcopy(ref), dims, options)
        assert all(isinstance(a.dropout, ParallelDropout) for a in model.adapters)
        result[f"fusion_sp{int(sp)}"] = adapter_masks(model, batch)
        torch.manual_seed(SEED)
        control = apply_tensor_parallel(
            copy.deepcopy(ref), dims.get_mesh("tp"), sequence_parallel=sp
        )
        assert all(type(a.dropout) is torch.nn.Dropout for a in control.adapters)
        result[f"control_sp{int(sp)}"] = adapter_masks(control, batch)
    torch.manual_seed(SEED)
    again = parallelize_fusion(copy.deepcopy(ref), dims)
    result["fusion_rerun"] = adapter_masks(again, batch)
    return result


def same(results: list[dict[str, Any]], key: str, a: int, b: int) -> bool:
    x: Any = results[a]
    y: Any = results[b]
    for part in key.split("/"):
        x, y = x[part], y[part]
    return bool(torch.equal(x, y))


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(worker, 4, timeout=900)


def test_rank_coordinates(results: list[dict[str, Any]]) -> None:
    assert [r["coords"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("run", ["regions", "rerun", "explicit"])
def test_region_masks_follow_the_layout(results: list[dict[str, Any]], run: str) -> None:
    for a, b in PEERS:
        assert same(results, f"{run}/replicated", a, b), "TP peers must share replicated masks"
        assert not same(results, f"{run}/tensor-parallel", a, b)
    for a, b in REPLICAS:
        assert not same(results, f"{run}/replicated", a, b), "dp replicas need their own masks"
        assert not same(results, f"{run}/tensor-parallel", a, b)
    for r in results:  # two draws of a region differ (the stream advances), rate about p
        for masks in r[run].values():
            assert not torch.equal(masks[0], masks[1])
            assert abs(float(masks.float().mean()) - 0.5) < 0.03


def test_forks_leave_the_default_stream_and_reruns_repeat(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert torch.equal(r["after_forks"], r["plain"])
        assert torch.equal(r["after_forks"], results[0]["after_forks"])
        for region in ("replicated", "tensor-parallel"):
            assert torch.equal(r["rerun"][region], r["regions"][region])
            assert not torch.equal(r["explicit"][region], r["regions"][region])


def test_fusion_without_sequence_parallel_replicates_masks(results: list[dict[str, Any]]) -> None:
    keys = sorted(results[0]["fusion_sp0"])
    assert len([k for k in keys if k.startswith("mask")]) == 4  # 2 adapters x 2 branches
    for key in keys:
        for a, b in PEERS:  # masks and adapter outputs identical on TP peers
            assert same(results, f"fusion_sp0/{key}", a, b), key
        for a, b in REPLICAS:
            assert not same(results, f"fusion_sp0/{key}", a, b), key
            assert same(results, f"control_sp0/{key}", a, b), key  # torch's dropout: the fault
        for r in range(4):
            assert torch.equal(results[r]["fusion_rerun"][key], results[r]["fusion_sp0"][key])


def test_fusion_with_sequence_parallel_shards_masks(results: list[dict[str, Any]]) -> None:
    masks = [k for k in sorted(results[0]["fusion_sp1"]) if k.startswith("mask")]
    assert len(masks) == 4
    for key in masks:
        assert results[0]["fusion_sp1"][key].shape[1] == 4  # T / tp tokens per rank
        for a, b in (*PEERS, *REPLICAS):
            assert not same(results, f"fusion_sp1/{key}", a, b), key
        for a, b in PEERS:  # torch's dropout draws one pattern for both sequence shards
            assert same(results, f"control_sp1/{key}", a, b), key
