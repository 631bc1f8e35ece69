"""The model-parallel RNG tracker and ParallelDropout in one process (Megatron's tracker
semantics): forks leave the default stream alone, region streams advance and are reproducible,
seeds per rank follow the region rules, bad input raises, activation checkpointing replays the
masks with :func:`checkpoint_rng_contexts`, and the fusion plan swaps the adapters' dropout
only when the layout spans several processes."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint as composable
from torch.utils.checkpoint import checkpoint

from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.random import (
    REGIONS,
    ParallelDropout,
    RNGStatesTracker,
    checkpoint_rng_contexts,
    get_rng_tracker,
    model_parallel_manual_seed,
    region_seeds,
    seed_regions,
)
from lightning_mmpar.plans import FusionPlanOptions, fusion_plan, parallelize_fusion
from lightning_mmpar.plans.plan import install_parallel_dropout
from lightning_mmpar.topology import ParallelDims
from tests.builders import tiny_fusion_config

ONE = ParallelDims(world_size=1)


@pytest.fixture(autouse=True)
def fresh_tracker() -> Iterator[None]:
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


def test_fork_leaves_the_default_stream_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(6)
    torch.manual_seed(7)
    tracker = RNGStatesTracker()
    tracker.add("a", 123)
    first = torch.rand(2)
    with tracker.fork("a"):
        inside = torch.rand(1000)  # many draws inside the region
    assert torch.equal(torch.cat([first, torch.rand(4)]), expected)
    torch.manual_seed(123)  # the region's stream is the one its seed starts
    assert torch.equal(inside, torch.rand(1000))


def test_fork_restores_the_default_state_on_error() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    before = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError), tracker.fork("a"):
        torch.rand(3)
        _ = 1 / 0
    assert torch.equal(torch.get_rng_state(), before)


def test_region_states_advance_and_reproduce() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    with tracker.fork("a"):
        one = torch.rand(4)
    with tracker.fork("a"):
        two = torch.rand(4)
    assert not torch.equal(one, two)
    torch.manual_seed(5)
    assert torch.equal(torch.cat([one, two]), torch.rand(8))
    saved = tracker.state_dict()
    with tracker.fork("a"):
        three = torch.rand(4)
    tracker.load_state_dict(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), three)


def test_tracker_errors() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match=r"RNG region 'b' is not in the tracker .*add\(name"):
        with tracker.fork("b"):
            pass
    with pytest.raises(ValueError, match="already added; call reset"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match=r"seed \(1\) is already the seed of RNG region 'a'"):
        tracker.add("c", 1)
    with pytest.raises(ValueError, match=r"name \(''\) must be a non-empty string"):
        tracker.add("", 3)
    with tracker.fork("a"), pytest.raises(RuntimeError, match="already forked on cpu"):
        with tracker.fork("a"):
            pass
    with pytest.raises(ValueError, match=r"state lacks \['seeded_from', 'states'\]"):
        tracker.load_state_dict({"seeds": {}})
    with pytest.raises(ValueError, match=r"region \('dp'\) must be one of"):
        ParallelDropout(0.1, region="dp")


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "3", None])
def test_bad_seed_is_refused(seed: object) -> None:
    tracker = RNGStatesTracker()
    with pytest.raises(ValueError, match=r"seed \(.*\) must be an integer in \[0, 2\*\*64\)"):
        tracker.add("a", seed)  # type: ignore[arg-type]
    if seed is not None:
        with pytest.raises(ValueError, match=r"seed \(.*\) must be an integer"):
            model_parallel_manual_seed(seed, ONE)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"seed \(.*\) must be an integer"):
            region_seeds(seed, ONE)  # type: ignore[arg-type]


def test_region_seeds_follow_the_rules_on_every_rank() -> None:
    dims = ParallelDims(world_size=8, tp=2, pp=2)  # tp2 x dp2 x pp2
    seeds = {r: region_seeds(42, dims, rank=r) for r in range(8)}
    coords = {r: dims.rank_coords(r) for r in range(8)}
    for a, b in product(range(8), repeat=2):
        same_replica = (coords[a]["pp"], coords[a]["dp"]) == (coords[b]["pp"], coords[b]["dp"])
        assert (seeds[a]["replicated"] == seeds[b]["replicated"]) == same_replica
        assert (seeds[a]["tensor-parallel"] == seeds[b]["tensor-parallel"]) == (a == b)
    replicated = {s["replicated"] for s in seeds.values()}
    sharded = {s["tensor-parallel"] for s in seeds.values()}
    assert len(replicated) == 4 and len(sharded) == 8 and not replicated & sharded
    assert 42 not in replicated | sharded  # never the default stream's seed
    assert region_seeds(2**64 - 1, dims, rank=0)["replicated"] == 2717  # wraps modulo 2**64
    with pytest.raises(ValueError, match=r"rank \(8\) must be in \[0, world_size 8\)"):
        region_seeds(42, dims, rank=8)


def test_dropout_draws_from_its_region_and_keeps_nn_dropout_behaviour() -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 6, 8)
    drop = ParallelDropout(0.5, region="tensor-parallel")
    assert isinstance(drop, nn.Dropout) and "region=tensor-parallel" in repr(drop)
    before = torch.get_rng_state()
    y = drop(x)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    torch.manual_seed(region_seeds(3, ONE)["tensor-parallel"])
    assert torch.equal(y, F.dropout(x, 0.5, True))  # the region's seed, then nn.Dropout's math
    assert get_rng_tracker().seeded_from == ("initial_seed", 3, (0, 0, 0, 1, 1, 1))
    drop.eval()
    assert drop(x) is x
    assert ParallelDropout(0.0, region="replicated")(x) is x
    with pytest.raises(TypeError, match="plain tensors"):
        drop.train()(type("DTensor", (torch.Tensor,), {})(x))


def test_lazy_seed_follows_initial_seed_and_explicit_seed_wins() -> None:
    drop = ParallelDropout(0.5, region="replicated")
    x = torch.ones(64)
    torch.manual_seed(11)
    first = [drop(x) for _ in range(2)]
    assert not torch.equal(*first)  # the stream advances per call
    torch.manual_seed(12)  # a new seed reseeds the regions at their next use
    twelve = drop(x)
    assert not torch.equal(twelve, first[0])
    torch.manual_seed(11)
    assert torch.equal(drop(x), first[0])
    seed_regions(ONE)  # what the plans call: a rerun with the same seed starts afresh
    assert torch.equal(drop(x), first[0]) and torch.equal(drop(x), first[1])
    model_parallel_manual_seed(11, ONE)
    torch.manual_seed(99)  # explicit seeding is replaced neither by a new initial seed
    seed_regions(ONE)  # nor by a plan
    assert torch.equal(drop(x), first[0])


def test_checkpoint_contexts_replay_the_masks_in_the_recomputation() -> None:
    """Without the contexts the recomputation draws new masks (wrong gradient): the test can
    fail; with them the checkpointed gradient is the plain one, bit for bit."""
    torch.manual_seed(0)
    lin, drop = nn.Linear(8, 8), ParallelDropout(0.5, region="replicated")
    x = torch.randn(4, 8, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return drop(lin(t)).tanh()

    def grad(**kwargs: Any) -> torch.Tensor:
        model_parallel_manual_seed(1, ONE)
        x.grad = None
        out = checkpoint(block, x, use_reentrant=False, **kwargs) if kwargs else block(x)
        out.sum().backward()
        assert x.grad is not None
        return x.grad.clone()

    plain = grad()
    assert not torch.equal(grad(preserve_rng_state=True), plain)
    assert torch.equal(grad(context_fn=checkpoint_rng_contexts), plain)
    unit = nn.Sequential(lin, drop)  # the composable checkpoint the plans apply (hooks)
    composable(unit, context_fn=checkpoint_rng_contexts)
    model_parallel_manual_seed(1, ONE)
    x.grad = None
    unit(x).tanh().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, plain)


def test_fusion_plan_regions_and_one_process_model_unchanged() -> None:
    model = FusionModel(tiny_fusion_config("tp", adapter__num_blocks=2))
    regions = fusion_plan(model).dropout_regions
    assert regions == (("adapters.0.dropout", "replicated"), ("adapters.1.dropout", "replicated"))
    seq = fusion_plan(model, FusionPlanOptions(sequence_parallel=True)).dropout_regions
    assert {r for _, r in seq} == {"tensor-parallel"}
    ac = FusionPlanOptions(activation_checkpointing=True)
    assert fusion_plan(model, ac).dropout_regions == regions  # AC replays the tracker
    parallelize_fusion(model, ONE)
    assert all(type(a.dropout) is nn.Dropout for a in model.adapters)
    install_parallel_dropout(model, regions, ParallelDims(world_size=2))
    dropout = model.adapters[1].dropout
    assert isinstance(dropout, ParallelDropout) and dropout.region == "replicated"
    assert dropout.p == model.config.adapter.dropout
    with pytest.raises(ValueError, match=r"adapters\.0\.norm_q is a RMSNorm, not an nn\.Dropout"):
        install_parallel_dropout(model, [("adapters.0.norm_q", "replicated")], ONE)
    assert set(REGIONS) == {"replicated", "tensor-parallel"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fork_on_cuda_uses_the_device_generator() -> None:
    torch.manual_seed(4)
    expected = torch.rand(5, device="cuda")
    torch.manual_seed(4)
    cpu_before = torch.get_rng_state()
    drop = ParallelDropout(0.5, region="replicated")
    y = drop(torch.ones(1000, device="cuda"))
    assert torch.equal(torch.rand(5, device="cuda"), expected)
    assert torch.equal(torch.get_rng_state(), cpu_before)
    torch.cuda.manual_seed(region_seeds(4, ONE)["replicated"])
    assert torch.equal(y, F.dropout(torch.ones(1000, device="cuda"), 0.5, True))
