"""The cost of non-colocated layouts (lightning_mmpar.layout.towers_cost) on a small synthetic
vision + language ModelSpec (pure Python, no model, no process)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lightning_mmpar.layout.cost import DEVICES, default_graph, predict
from lightning_mmpar.layout.devices import collective_seconds
from lightning_mmpar.layout.model import Boundary, ModelSpec, ParamSpec
from lightning_mmpar.layout.planner import candidate_layouts, describe, plan
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.towers_cost import (
    TowerCost,
    run_ahead_seconds,
    split_towers,
    tower_cost,
)
from lightning_mmpar.layout.value import ParallelLayout

H100 = DEVICES["h100"]
TOKENS, VIT, WIDTH = 577, 1024, 4096
PIXELS = 3 * 336 * 336 * 4


def vlm(images: float = 1.0, vision: int = 4, language: int = 8, train_vision: bool = True):
    """``vision`` ViT-L-sized blocks (cost x ``images``) then ``language`` decoder blocks."""
    nv, nl = VIT * 4 * VIT, WIDTH * 4 * WIDTH
    specs = [
        BlockSpec(f"vision.layer{i}", "vision", 6.0 * nv * TOKENS * images, 1e7 * images, 4 * nv, 0)
        for i in range(vision)
    ] + [
        BlockSpec(f"decoder{i}", "language", 6.0 * nl * 2048, 1e8, 4 * nl, 4 * nl)
        for i in range(language)
    ]
    params = [ParamSpec(f"v{i}.w", (4 * VIT, VIT), i, 0, train_vision) for i in range(vision)]
    params += [
        ParamSpec(f"l{i}.w", (4 * WIDTH, WIDTH), vision + i, 0, True) for i in range(language)
    ]
    tokens = Boundary(round(TOKENS * VIT * 4 * images), True)
    hidden = Boundary(2048 * WIDTH * 4, True)
    bounds = [(tokens,)] * vision + [(hidden,)] * language
    return ModelSpec(
        blocks=tuple(specs),
        params=tuple(params),
        boundaries=tuple(bounds),
        extra={"pixel_bytes_per_sample": PIXELS * images},
    )


def ARGS(lay: ParallelLayout) -> tuple[Any, ...]:
    """``tower_cost``'s device rate and graph for ``lay`` on H100s (what ``predict`` passes)."""
    return (H100.peak(lay.precision) * H100.efficiency, H100.overhead), default_graph(
        lay.world + lay.vision_ranks
    )


LAYOUT = ParallelLayout(tp=2, pp=2, dp=2, micro_batches=4, micro_batch_size=2)


def test_split_towers_renumbers_blocks_and_keeps_parameters() -> None:
    spec = vlm()
    vision, language = split_towers(spec)
    assert [b.kind for b in vision.blocks] == ["vision"] * 4
    # the language side starts with the engine's TowerInlet: no cost, no parameter, the
    # tower's output as its own; the decoder blocks follow, renumbered from 1
    inlet = language.blocks[0]
    assert (inlet.name, inlet.kind, inlet.flops, inlet.parameter_bytes) == (
        "tower.inlet",
        "aligner",
        0.0,
        0.0,
    )
    assert language.boundaries[0] == spec.boundaries[3] and language.collectives == ()
    assert len(language.blocks) == 9 and {p.block for p in language.params} == set(range(1, 9))
    assert language.boundaries[1:] == spec.boundaries[4:]
    assert len(vision.params) + len(language.params) == 12
    with pytest.raises(ValueError, match="first blocks"):
        split_towers(ModelSpec(blocks=language.blocks, params=language.params))


def test_language_ranks_price_less_compute_than_colocated() -> None:
    spec = vlm()
    colo = predict(spec, LAYOUT, H100)
    nonco = predict(spec, replace(LAYOUT, vision_ranks=2), H100)
    # the language ranks' compute lost the ViT (stage 0 held it colocated)
    assert nonco.breakdown["compute"] < colo.breakdown["compute"]
    assert nonco.step_seconds == pytest.approx(sum(nonco.breakdown.values()))
    assert not colo.idle and set(nonco.idle) == {"language ranks", "vision ranks"}
    assert nonco.idle["language ranks"] > 0 and nonco.idle["vision ranks"] > 0


def test_vision_side_scales_with_images_per_sample() -> None:
    lay = replace(LAYOUT, vision_ranks=2)
    one, three = tower_cost(vlm(1.0), lay, *ARGS(lay)), tower_cost(vlm(3.0), lay, *ARGS(lay))
    assert three.forward == pytest.approx(3 * one.forward)
    assert three.backward == pytest.approx(3 * one.backward)
    assert three.embedding_bytes == 3 * one.embedding_bytes
    # twice the vision ranks: half the samples each
    assert tower_cost(
        vlm(), replace(lay, vision_ranks=1), *ARGS(replace(lay, vision_ranks=1))
    ).forward == pytest.approx(2 * one.forward)


def test_transfer_bytes_and_seconds_by_hand() -> None:
    lay = replace(LAYOUT, vision_ranks=1)  # fan-in: vision rank 0 serves both replicas
    cost = tower_cost(vlm(), lay, *ARGS(lay))
    samples = lay.global_batch  # 16, all on the one vision rank
    per = TOKENS * VIT * 4
    assert cost.samples == samples
    assert cost.embedding_bytes == per * samples * lay.tp  # to both tp ranks of stage 0
    assert cost.gradient_bytes == per * samples  # back from tp rank 0
    assert cost.pixel_bytes == PIXELS * samples
    graph = default_graph(lay.world + 1)
    half = samples // 2  # per replica; first stage tp ranks: devices 0, 1 (replica 0), 2, 3
    want = sum(
        collective_seconds(graph, "send_recv", [8, d], n * half)
        for d in (0, 1, 2, 3)
        for n in ((per, per, PIXELS) if d % 2 == 0 else (per,))
    )
    assert cost.transfer == pytest.approx(want)
    frozen = tower_cost(vlm(train_vision=False), lay, *ARGS(lay))
    assert frozen.gradient_bytes == 0 and frozen.backward == 0 and frozen.sync == 0


def test_vision_memory_is_full_copies_and_step_modes() -> None:
    lay = replace(LAYOUT, vision_ranks=2)
    cost = tower_cost(vlm(), lay, *ARGS(lay))
    vit = 4 * (4 * VIT * VIT * 4)
    assert cost.state[:2] == (vit, vit)  # DDP: whole parameters and gradients
    serial = predict(vlm(), lay, H100)
    spec = vlm()
    heavy = [replace(b, activation_bytes=1e10) if b.kind == "vision" else b for b in spec.blocks]
    full = predict(replace(spec, blocks=tuple(heavy)), lay, H100)  # 8 samples x 4 x 10 GB
    assert not full.fits and "a vision rank" in full.reason
    assert full.memory.activations == 8 * 4 * 10**10
    piped = predict(vlm(), lay, H100, tower_overlap=True)
    lang = serial.step_seconds - cost.busy - cost.transfer
    assert piped.step_seconds == pytest.approx(max(cost.busy, lang) + cost.transfer)
    assert piped.step_seconds < serial.step_seconds
    assert piped.step_seconds == pytest.approx(sum(piped.breakdown.values()))
    assert serial.comm_bytes["towers.send"] == cost.embedding_bytes


def test_run_ahead_step_by_hand() -> None:
    """The engine's order (vision rank one batch ahead inside a window), worked by hand: per
    batch forward 1, backward 2, language 3 (window of 4; no transfer, no sync):

    vision  F1 F2 .. B1 F3 B2 F4 B3 .. B4     language  . L1 L2 L3 L4
    finishes at 15 s (serial: 24 s; the pipelined bound max(12, 12) = 12 s)."""
    tower = TowerCost(8, 4.0, 8.0, 0.0, 0.0, 0, 0, 0, (0, 0, 0), 0)
    assert run_ahead_seconds(tower, 12.0, 4) == 15.0
    assert run_ahead_seconds(tower, 12.0, 1) == 24.0  # one batch: serial
    synced = replace(tower, sync=1.0, transfer=4.0)  # 1 s per batch with the embeddings
    assert run_ahead_seconds(synced, 12.0, 1) == 4 + 4 + 12 + 8 + 1


def test_accumulating_layouts_are_priced_as_the_engine_runs_them() -> None:
    lay = replace(LAYOUT, vision_ranks=2, accumulate=4)
    cost = tower_cost(vlm(), lay, *ARGS(lay))
    ahead = predict(vlm(), lay, H100)
    lang = ahead.step_seconds - ahead.idle["language ranks"]
    assert ahead.step_seconds == pytest.approx(run_ahead_seconds(cost, lang, 4))
    serial = cost.busy + cost.transfer + lang  # the same window, one side at a time
    assert max(cost.busy, lang) <= ahead.step_seconds < serial
    assert ahead.step_seconds == pytest.approx(sum(ahead.breakdown.values()))
    assert min(ahead.breakdown.values()) >= 0 and min(ahead.idle.values()) >= 0
    per_batch = sum(b.activation_bytes for b in split_towers(vlm())[0].blocks) * 32 / 4
    assert cost.activations == round(2 * per_batch)  # a batch and the one encoded ahead


def test_planner_offers_the_run_ahead_to_noncolocated_layouts() -> None:
    """Non-colocated candidates accumulate 1, 2, 4 or 8 batches per step (those dividing the
    global batch; the engine's vision rank encodes one batch ahead inside each window),
    colocated ones 1; with both towers working the best non-colocated layout accumulates and
    is priced below its serial twin (the same layout, one batch per step)."""
    both = candidate_layouts(
        12, 12, global_batch=16, vision_ranks=(0, 2, 4), checkpointing=(False,)
    )
    kinds = {(x.vision_ranks > 0, x.accumulate) for x in both}
    assert kinds == {(False, 1), (True, 1), (True, 2), (True, 4), (True, 8)}
    assert all(x.global_batch == 16 and x.micro_batch_size >= 1 for x in both)
    keys = [describe(x) for x in both]
    assert len(keys) == len(set(keys))
    assert " acc 4 " in describe(next(x for x in both if x.accumulate == 4))
    assert " acc " not in describe(next(x for x in both if x.accumulate == 1))
    odd = candidate_layouts(6, 12, global_batch=12, vision_ranks=(2,))  # 8 does not divide 12
    assert {x.accumulate for x in odd} == {1, 2, 4}
    fewer = candidate_layouts(
        12, 12, global_batch=16, vision_ranks=(2,), noncolocated_accumulate=(1, 4)
    )
    assert {x.accumulate for x in fewer} == {1, 4}
    with pytest.raises(ValueError, match=r"noncolocated_accumulate\[1\] \(0\) must be an int"):
        candidate_layouts(
            12, 12, global_batch=16, vision_ranks=(2,), noncolocated_accumulate=(1, 0)
        )
    ranked, _ = plan(vlm(3.0), 12, H100, candidates=both)
    by_name = {describe(p.layout): p for p in ranked}
    best = next(p for p in ranked if p.layout.vision_ranks)
    lay = best.layout
    assert lay.accumulate > 1
    serial = replace(lay, accumulate=1, micro_batch_size=lay.micro_batch_size * lay.accumulate)
    twin = by_name[describe(serial)]
    assert best.step_seconds < twin.step_seconds
    assert best.idle["language ranks"] < twin.idle["language ranks"]


def test_planner_ranks_noncolocated_beside_colocated() -> None:
    both = candidate_layouts(
        12, 12, global_batch=16, vision_ranks=(0, 2, 4), checkpointing=(False,)
    )
    counts = {x.vision_ranks for x in both}
    assert counts == {0, 2, 4}
    for x in both:
        assert x.world + x.vision_ranks == 12
        assert not x.vision_ranks or (not x.sequence_parallel and x.ep == 1)
    assert "+ 2 vision" in describe(next(x for x in both if x.vision_ranks == 2))
    ranked, _ = plan(vlm(3.0), 12, H100, candidates=both)
    assert {p.layout.vision_ranks for p in ranked} == {0, 2, 4}
    steps = [p.step_seconds for p in ranked]
    assert steps == sorted(steps)
    assert all(p.idle for p in ranked if p.layout.vision_ranks)
    assert not any(p.idle for p in ranked if not p.layout.vision_ranks)
    odd = replace(both[0], tp=1, pp=1, dp=3, vision_ranks=2, micro_batches=1, micro_batch_size=1)
    _, refused = plan(vlm(), 5, H100, candidates=[odd])  # 3 replicas, 2 vision ranks
    assert "must divide one" in refused[0].reason


def test_vision_fsdp_shards_memory_and_prices_gathers_and_reduce_scatters() -> None:
    """``vision_data_parallel="fsdp"``: a vision rank holds 1/V of the tower's parameters,
    gradients and moments; per batch each block's unit all-gathers twice (forward, backward)
    and reduce-scatters once (bytes by hand: no padding at V = 2), one gather and no
    reduce-scatter for a frozen tower; DDP all-reduces the whole gradient."""
    from lightning_mmpar.layout.towers_cost import vision_comm_bytes

    ddp = replace(LAYOUT, vision_ranks=2)
    fsdp = replace(ddp, vision_data_parallel="fsdp")
    vit = 4 * (4 * VIT * VIT * 4)
    full, sharded = tower_cost(vlm(), ddp, *ARGS(ddp)), tower_cost(vlm(), fsdp, *ARGS(fsdp))
    assert sharded.state[:2] == (vit // 2, vit // 2) and full.state[:2] == (vit, vit)
    assert sharded.state[2] < full.state[2]
    assert vision_comm_bytes(vlm(), ddp) == {"vision.all_reduce": vit}
    assert vision_comm_bytes(vlm(), fsdp) == {
        "vision.all_gather": 2 * vit,
        "vision.reduce_scatter": vit,
    }
    frozen = vision_comm_bytes(vlm(train_vision=False), fsdp)
    assert frozen == {"vision.all_gather": vit}
    assert vision_comm_bytes(vlm(), replace(fsdp, accumulate=2))["vision.reduce_scatter"] == 2 * vit
    got = predict(vlm(), fsdp, H100)
    assert (
        got.comm_bytes["vision.all_gather"] == 2 * vit and got.comm_bytes["vision.all_reduce"] == 0
    )
    assert got.memory.parameters <= predict(vlm(), ddp, H100).memory.parameters
    assert sharded.sync > 0 and full.sync > 0


def test_planner_tries_vision_fsdp_over_two_or_more_vision_ranks() -> None:
    """``vision_data_parallel=("ddp", "fsdp")``: each non-colocated candidate with ``V >= 2``
    also sharded (named ``+ V vision fsdp``), ``V = 1`` only as full copies; the default
    enumeration keeps full copies only."""
    args = {"global_batch": 16, "vision_ranks": (0, 1, 2), "checkpointing": (False,)}
    both = candidate_layouts(12, 12, vision_data_parallel=("ddp", "fsdp"), **args)
    plain = candidate_layouts(12, 12, **args)
    assert {x.vision_data_parallel for x in plain} == {"ddp"}
    sharded = [x for x in both if x.vision_data_parallel == "fsdp"]
    assert sharded and {x.vision_ranks for x in sharded} == {2}
    assert len(both) == len(plain) + len(sharded)
    assert describe(sharded[0]).endswith("+ 2 vision fsdp")
    ranked, _ = plan(vlm(3.0), 12, H100, candidates=both)
    assert any(p.layout.vision_data_parallel == "fsdp" for p in ranked)
