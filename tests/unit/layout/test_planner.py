"""The layout planner (lightning_mmpar.layout.planner) and predict's composition, on a small
synthetic ModelSpec (pure Python, no model, no process)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_mmpar.layout.comm import comm_bytes
from lightning_mmpar.layout.cost import (
    DEVICES,
    GIB,
    bubble_fraction,
    compute_seconds,
    default_graph,
    predict,
)
from lightning_mmpar.layout.devices import DeviceGraph
from lightning_mmpar.layout.model import Boundary, Collective, ModelSpec, ParamSpec
from lightning_mmpar.layout.placement import Placement
from lightning_mmpar.layout.planner import candidate_layouts, describe, divisors, plan
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.value import ParallelLayout

H100 = DEVICES["h100"]


def model(blocks: int = 8, width: int = 4096) -> ModelSpec:
    """``blocks`` transformer-sized blocks: one ``[width, 4 width]`` trainable weight each."""
    n = width * 4 * width
    specs = tuple(
        BlockSpec(
            f"decoder{i}", "language", 6.0 * n * 2048, 34 * 2048 * width * 4, 4.0 * n, 4.0 * n
        )
        for i in range(blocks)
    )
    params = tuple(ParamSpec(f"layer{i}.w", (4 * width, width), i, 0, True) for i in range(blocks))
    hidden = (Boundary(2048 * width * 4, True),)  # [T, D] fp32 between blocks
    reduce = tuple(
        Collective("tp", "all_reduce", 2048 * width * 4, phase) for phase in ("forward", "backward")
    )
    return ModelSpec(
        blocks=specs, params=params, boundaries=(hidden,) * blocks, collectives=(reduce,) * blocks
    )


def test_candidate_layouts_cover_the_space_and_respect_the_constraints() -> None:
    got = candidate_layouts(16, 20, global_batch=32)
    keys = [describe(x) for x in got]
    assert len(keys) == len(set(keys))
    for x in got:
        assert x.world == 16 and x.tp <= 8 and x.pp * x.virtual <= 20
        assert x.global_batch == 32 and x.ep == 1
        assert not x.sequence_parallel or x.tp > 1
        assert x.data_parallel == "fsdp" or x.dp > 1
        assert (x.virtual > 1) == (x.schedule == "interleaved_1f1b")
        assert x.pp > 1 or x.micro_batches == 1
    brief = [x for x in got if (x.tp, x.pp, x.virtual, x.dp) == (4, 2, 2, 2)]
    assert brief and {x.micro_batches for x in brief} == {2, 4, 8, 16}
    moe = candidate_layouts(8, 10, global_batch=8, experts=4, sequence_parallel=(False,))
    assert {x.ep for x in moe if x.dp == 8} == {1, 2, 4}  # divisors of dp and of 4 experts
    with pytest.raises(ValueError, match=r"global_batch \(0\)"):
        candidate_layouts(8, 10, global_batch=0)


def test_predict_composes_compute_comm_bubble_and_memory() -> None:
    spec = model()
    lay = ParallelLayout(
        tp=2, pp=2, dp=2, micro_batches=4, micro_batch_size=2, precision="bf16-mixed"
    )
    p = predict(spec, lay, H100)
    assert p.bubble == bubble_fraction("1f1b", 2, 1, 4) == pytest.approx(1 / 5)
    assert p.compute_seconds == max(compute_seconds(spec, lay, H100))
    # step = (compute + tp + ep + pp comm) / (1 - bubble) + dp comm; blocks are equal, so
    # every pipeline rank has the same critical path
    critical = p.compute_seconds + sum(p.comm_seconds.get(d, 0.0) for d in ("tp", "ep", "pp"))
    assert p.step_seconds == pytest.approx(critical / (1 - p.bubble) + p.comm_seconds["dp"])
    flops = sum(b.flops for b in spec.blocks) * lay.global_batch
    assert p.mfu == pytest.approx(flops / (p.step_seconds * lay.world * H100.peak("bf16-mixed")))
    assert p.comm_bytes == {k: v for k, v in comm_bytes(spec, lay, 0).items() if v} or all(
        p.comm_bytes[k] >= v for k, v in comm_bytes(spec, lay, 1).items()
    )
    # memory: 4 of 8 blocks per pipeline rank, tp 2 and fsdp 2 shards -> 1/4 of each
    weights = 4 * 4 * 4096 * 4 * 4096 // 4
    assert (p.memory.parameters, p.memory.gradients) == (weights, weights)
    assert p.fits and p.memory.total < 80 * GIB
    with pytest.raises(ValueError, match="topology has 4 devices, the layout needs 8"):
        predict(spec, lay, H100, DeviceGraph.uniform(4, 4))


def test_placement_and_slow_links_change_only_communication() -> None:
    spec = model()
    lay = ParallelLayout(tp=4, dp=2, precision="bf16-mixed")
    graph = DeviceGraph.uniform(8, 4)  # two nodes of 4: tp inside a node in Megatron's order
    inside = predict(spec, lay, H100, graph)
    across = predict(spec, lay, H100, graph, Placement((0, 4, 1, 5, 2, 6, 3, 7)))
    assert across.comm_seconds["tp"] > 5 * inside.comm_seconds["tp"]
    assert across.compute_seconds == inside.compute_seconds
    assert across.step_seconds > inside.step_seconds


def test_plan_ranks_by_step_time_and_rejects_with_reasons() -> None:
    spec = model(blocks=8, width=8192)  # 1 GiB of fp32 weights per block, 4 GiB with AdamW
    ranked, rejected = plan(
        spec,
        8,
        H100,
        memory_gib=40,
        global_batch=8,
        checkpointing=(False,),
        accept=lambda x: "no tp 8 here" if x.tp == 8 else None,
    )
    steps = [p.step_seconds for p in ranked]
    assert ranked and steps == sorted(steps)
    assert all(p.memory.total <= 40 * GIB for p in ranked)
    assert {r.reason for r in rejected if r.layout.tp == 8} == {"no tp 8 here"}
    # dp 8 under DDP: every rank holds all 8 blocks: 8 + 8 + 16 GiB of state + activations
    (ddp,) = [r for r in rejected if r.layout.dp == 8 and r.layout.data_parallel == "ddp"]
    assert ddp.prediction is not None and ddp.prediction.memory.total > 40 * GIB
    assert ddp.reason.startswith(
        "needs 49.0 GiB (pipeline rank 0: parameters 8.0 + gradients "
        "8.0 + optimizer 16.0 + activations 17.0) > 40 GiB"
    )
    # FSDP shards the same state 8 ways: it fits
    assert any(p.layout.dp == 8 and p.layout.data_parallel == "fsdp" for p in ranked)


def test_moe_dispatch_is_timed_as_an_all_to_all_and_bad_sizes_raise() -> None:
    """comm_bytes' ``ep.all_to_all_v`` (routed tokens, an expected value) is priced as an
    even all-to-all of its bytes; the sizes the planner enumerates from must be >= 1."""
    spec = model(blocks=4, width=1024)

    def with_ep(first: str) -> ModelSpec:
        ep = (
            Collective("ep", first, 1 << 20, "forward"),
            Collective("ep", "all_to_all", 1 << 20, "backward"),
        )
        return replace(spec, collectives=tuple(c + ep for c in spec.collectives))

    layout = ParallelLayout(dp=4, ep=2)
    routed = predict(with_ep("all_to_all_v"), layout, H100)
    even = predict(with_ep("all_to_all"), layout, H100)
    assert routed.comm_bytes["ep.all_to_all_v"] == 4 << 20
    assert 0 < routed.comm_seconds["ep"] == pytest.approx(even.comm_seconds["ep"], rel=1e-12)
    assert routed.step_seconds == pytest.approx(even.step_seconds, rel=1e-12)
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=r"n \(.*\) must be an int >= 1"):
            divisors(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_tp \(0\) must be an int >= 1"):
        candidate_layouts(8, 4, global_batch=8, max_tp=0)
    # the assumed graph: one NVSwitch node up to 8 devices, else nodes of gcd(world, 8)
    shapes = {w: (default_graph(w).nodes, default_graph(w).num_devices) for w in (4, 12, 32)}
    assert shapes == {4: (1, 4), 12: (3, 12), 32: (4, 32)}


def test_plan_never_predicts_a_placement_slower_than_megatrons_order() -> None:
    """A placement function that splits every tensor-parallel group of 4 over the two nodes:
    the planner predicts each layout both ways and keeps the faster, so no layout is predicted
    slower than in Megatron's order; where the split loses (tp 4, pp 1) ``Prediction.placement`` is
    None, where it wins (some layout) it is the placement."""
    spec, graph = model(), DeviceGraph.uniform(8, 4)
    split = Placement((0, 4, 1, 5, 2, 6, 3, 7))
    kw = dict(global_batch=8, checkpointing=(False,), memory_gib=80)
    ranked, _ = plan(spec, 8, H100, graph, placement=lambda lay: split, **kw)
    plain = {p.layout: p.step_seconds for p in plan(spec, 8, H100, graph, **kw)[0]}
    assert plain.keys() == {p.layout for p in ranked}
    assert all(p.step_seconds <= plain[p.layout] for p in ranked)
    tp4 = [p for p in ranked if p.layout.tp == 4 and p.layout.pp == 1]
    assert tp4 and all(p.placement is None for p in tp4)  # split tp groups: Megatron's kept
    won = [p for p in ranked if p.step_seconds < plain[p.layout]]
    assert won and all(p.placement == split for p in won)
