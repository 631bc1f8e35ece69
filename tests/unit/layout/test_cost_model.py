"""The layout cost model (lightning_mmpar.layout.cost): bubble, in-flight micro-batches, kept
activations (predicted vs measured on the recipe's tiny fusion model), compute, devices."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mmpar.layout.cost import (
    DEVICES,
    REPLICATED_SHARE,
    activation_bytes,
    compute_seconds,
)
from lightning_mmpar.layout.schedules import SCHEDULES, bubble_fraction, in_flight, stage_ranks
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.value import ParallelLayout
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.pipeline import schedules as ps
from tests.recipes import recipe_faults_worker as rw


def layout(**kw: Any) -> ParallelLayout:
    """A layout of one micro-batch unless ``kw`` says otherwise."""
    return ParallelLayout(**{"micro_batches": 1, **kw})


def blocks(n: int = 4, kind: str = "language") -> SimpleNamespace:
    specs = tuple(
        BlockSpec(f"b{i}", kind, 1e9 * (i + 1), 1000.0 * (i + 1), 10.0, 10.0) for i in range(n)
    )
    out = tuple(
        (SimpleNamespace(bytes_per_sample=60), SimpleNamespace(bytes_per_sample=40)) for _ in specs
    )
    return SimpleNamespace(blocks=specs, boundaries=out)


def test_bubble_fractions_follow_the_papers_formulas() -> None:
    """With a stage's F, I, W one unit each (tests/unit/test_schedule_facts.py checks every
    schedule against torch's order)."""
    p, m = 4, 8
    assert bubble_fraction("1f1b", p, 1, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction("gpipe", p, 1, m) == bubble_fraction("1f1b", p, 1, m)
    assert bubble_fraction("interleaved_1f1b", p, 2, m) == pytest.approx((p - 1) / (2 * m + p - 1))
    assert bubble_fraction("looped_bfs", p, 2, m) == bubble_fraction("interleaved_1f1b", p, 2, m)
    # zero bubble: ZB-H1 idles (p - 1)(F + I - W) = p - 1 units, a third of 1F1B's 3 (p - 1)
    zb = bubble_fraction("interleaved_zero_bubble", p, 2, m)
    assert zb < bubble_fraction("interleaved_1f1b", p, 2, m)
    assert zb == pytest.approx((p - 1) / (3 * 2 * m + p - 1))
    zbv = bubble_fraction("zbv_zero_bubble", p, 2, m)  # fill and drain only: p - 1 units
    assert 0 < zbv == pytest.approx(zb) and zbv == bubble_fraction("dualpipev", p, 2, m)
    assert all(bubble_fraction(s, 1, 1, 1) == 0.0 for s in ("gpipe", "1f1b"))
    # more micro-batches, smaller bubble
    assert bubble_fraction("1f1b", 4, 1, 32) < bubble_fraction("1f1b", 4, 1, 4)
    with pytest.raises(ValueError, match=r"schedule \('zb'\)"):
        bubble_fraction("zb", 2, 1, 2)
    with pytest.raises(ValueError, match=r"micro_batches \(0\)"):
        bubble_fraction("1f1b", 2, 1, 0)


def test_stage_ranks_and_in_flight_match_the_strategys_plan() -> None:
    for schedule in SCHEDULES:
        v = 1 if schedule in ("gpipe", "1f1b") else 2
        for pp in (1, 2, 4):
            ranks = stage_ranks(schedule, pp, v)
            assert ranks == ps.stage_ranks(schedule, pp * v, pp), (schedule, pp)
            assert len(in_flight(schedule, pp, v, 8)) == pp * v, (schedule, pp)
    # interleaved, pp 4, v 2, rounds of 4: rank 0 warms up 4 + 2 * 3 = 10 stage-micro-batches,
    # + 1 -> 11: 7 of stage 0, 4 of stage 4 (torch's order, tests/unit/test_schedule_facts.py)
    assert in_flight("interleaved_1f1b", 4, 2, 16) == [7, 5, 4, 4, 4, 4, 3, 1]
    assert in_flight("interleaved_1f1b", 4, 2, 2) == [2, 2, 2, 2, 2, 2, 2, 1]  # capped at m


def test_activation_bytes_per_rank_tp_sp_checkpointing_precision() -> None:
    model = blocks(4)  # activations 1000, 2000, 3000, 4000 bytes per sample
    assert activation_bytes(model, layout(micro_batch_size=3)) == 3 * 10_000
    # pp 2, 1F1B: rank 0 holds 2 micro-batches of blocks 0-1, rank 1 one of blocks 2-3
    two = layout(pp=2, micro_batches=4)
    assert [activation_bytes(model, two, r) for r in (0, 1)] == [2 * 3000, 7000]
    # tp 2: 1 / tp of the sharded part; sequence parallel shards everything
    share = REPLICATED_SHARE + (1 - REPLICATED_SHARE) / 2
    assert activation_bytes(model, layout(tp=2)) == round(10_000 * share)
    assert activation_bytes(model, layout(tp=2, sequence_parallel=True)) == 5000
    vision = blocks(4, "vision")
    assert activation_bytes(vision, layout(tp=2, vision_parallel="replicate")) == 10_000
    # checkpointing: the inputs of blocks 1-3 (100 each; block 0 takes the batch) + the largest
    # block's activations (recomputed in its backward)
    assert activation_bytes(model, layout(activation_checkpointing=True)) == 300 + 4000
    assert activation_bytes(model, layout(precision="bf16-mixed")) == 5000


def test_compute_seconds_per_pipeline_rank() -> None:
    model, device = blocks(4), DEVICES["h100"]
    rate = device.tflops["bf16"] * 1e12 * device.efficiency
    got = compute_seconds(
        model, layout(pp=2, micro_batches=2, micro_batch_size=4, precision="bf16-mixed"), device
    )
    # x 4/3: with a pipeline every block runs the gradient cache's forward-only pass too
    assert got == pytest.approx([8 * 3e9 * 4 / 3 / rate, 8 * 7e9 * 4 / 3 / rate])
    tp = compute_seconds(model, layout(tp=4, precision="bf16-mixed"), device)
    assert tp == pytest.approx([10e9 / 4 / rate])
    ckpt = compute_seconds(model, layout(activation_checkpointing=True), device)
    assert ckpt[0] == pytest.approx(10e9 * 4 / 3 / (device.tflops["fp32"] * 1e12 * 0.6))


def test_devices_table_and_precision_errors() -> None:
    assert DEVICES["h100"].peak("bf16-mixed") == pytest.approx(989.5e12)
    assert DEVICES["h200"].peak("fp8") == 2 * DEVICES["h200"].peak("bf16-true")
    assert DEVICES["b200"].peak("bf16-mixed") > DEVICES["h100"].peak("bf16-mixed")
    assert DEVICES["h200"].memory_gib > DEVICES["h100"].memory_gib
    assert all(d.source for d in DEVICES.values())
    with pytest.raises(ValueError, match="precision 'fp8' has no peak figure on A100"):
        DEVICES["a100"].peak("fp8")


def _measured_activations(batch: int) -> tuple[dict[str, float], dict[str, float]]:
    """Kept bytes of one training micro-batch of the tiny fusion model, by tower: the unique
    storages autograd saves (saved_tensors_hooks), parameters excluded; and the prediction."""
    module = rw.tiny_module(64)
    module.configure_model()
    module.train()
    specs = module.pipeline_block_specs(rw.TEXT_LENGTH)
    params = {p.untyped_storage().data_ptr() for p in module.fusion_model.parameters()}
    measured: dict[str, float] = {}
    predicted: dict[str, float] = {}
    seen: set[int] = set()
    g = torch.Generator().manual_seed(0)
    state = FusionModel.pipeline_inputs(
        torch.randn(batch, 3, 16, 16, generator=g),
        torch.randint(0, 64, (batch, rw.TEXT_LENGTH), generator=g),
    )
    for spec, block in zip(specs, module.pipeline_blocks(), strict=True):
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor, kept: dict[int, int] = kept) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in seen:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            state = block(*state)
        seen.update(kept)
        measured[spec.kind] = measured.get(spec.kind, 0.0) + sum(kept.values())
        predicted[spec.kind] = predicted.get(spec.kind, 0.0) + spec.activation_bytes * batch
    return measured, predicted


def test_activation_memory_within_15_percent_of_measured() -> None:
    measured, predicted = _measured_activations(batch=4)
    total_m, total_p = sum(measured.values()), sum(predicted.values())
    assert abs(total_p - total_m) / total_m <= 0.15, (predicted, measured)
    for kind in ("vision", "language"):  # the towers that dominate at scale
        assert abs(predicted[kind] - measured[kind]) / measured[kind] <= 0.15, kind


def test_comm_calls_count_each_op_of_each_mechanism() -> None:
    """``comm_calls``: what a call's fixed cost multiplies, each op one call (the benchmark
    checks them equal to ``CommCounter.calls`` on every rank of its 7 layouts): DDP one
    coalesced all-reduce per dtype and batch, per optimizer step at ``tp == pp == 1`` (torch's
    DDP, one bucket for these sizes); FSDP per unit two all-gathers (forward, backward)
    and one reduce-scatter, ``2 m + 1`` gathers under a pipeline; one send per boundary tensor,
    micro-batch and forward pass; the same keys as ``comm_bytes``."""
    from lightning_mmpar.layout.comm import comm_bytes, comm_calls
    from lightning_mmpar.layout.model import Boundary, ModelSpec, ParamSpec

    ps_ = (
        ParamSpec("w", (6, 4), 0, None, True),
        ParamSpec("v", (4,), 0, None, True),
        ParamSpec("u", (4, 4), 1, None, True),
    )
    model = ModelSpec(
        blocks=blocks(2).blocks,
        params=ps_,
        boundaries=((Boundary(100, True), Boundary(8, False)), ()),
    )
    ddp = ParallelLayout(dp=2, data_parallel="ddp", accumulate=3)
    assert comm_calls(model, ddp) == {
        "dp.all_gather": 1,
        "dp.all_reduce": 1 + 3 * 2,
        "dp.broadcast": 3,
    }  # grads once per step (torch's DDP) + pair + terms per batch; guard; SIGTERM
    ddp_pp = ParallelLayout(pp=2, dp=2, data_parallel="ddp", accumulate=3)
    assert comm_calls(model, ddp_pp)["dp.all_reduce"] == 3 * 3  # grads per batch too
    fsdp = ParallelLayout(dp=2)
    assert comm_calls(model, fsdp) == {
        "dp.all_gather": 2 * 2 + 1,
        "dp.all_reduce": 2,
        "dp.broadcast": 1,
        "dp.reduce_scatter": 2,
    }
    piped = ParallelLayout(pp=2, dp=2, micro_batches=3, micro_batch_size=1)
    zero, one = comm_calls(model, piped, 0), comm_calls(model, piped, 1)
    assert zero["dp.all_gather"] == 2 * 3 + 1 and zero["dp.reduce_scatter"] == 1
    assert zero["world.all_gather"] == 1  # the guard: no single dimension spans the 4 ranks
    assert zero["pp.send"] == one["pp.recv"] == 2 * 3 * 2  # 2 tensors, 3 micro-batches, 2 passes
    assert zero["pp.recv"] == one["pp.send"] == 3  # the float tensor's gradient
    for lay in (ddp, fsdp, piped):
        assert comm_calls(model, lay).keys() == comm_bytes(model, lay).keys()


def test_host_call_cost_and_shared_cores() -> None:
    """``DeviceSpec.call_overhead`` adds host seconds per call issued through DTensor / FSDP2
    (``dispatched_calls``: here FSDP's two all-gathers and one reduce-scatter of the one unit;
    the plain loss / guard calls pay only the link's latency) to the rank's critical path;
    ``shared`` (ranks per core) bounds the step by ``shared x mean busy + comm``."""
    from dataclasses import replace

    from lightning_mmpar.layout.comm import comm_calls, dispatched_calls
    from lightning_mmpar.layout.cost import predict
    from lightning_mmpar.layout.model import ModelSpec, ParamSpec

    model = ModelSpec(blocks=blocks(2).blocks, params=(ParamSpec("w", (64, 64), 0, None, True),))
    lay, cpu = ParallelLayout(dp=2), replace(DEVICES["cpu"], call_overhead=0.0)
    assert dispatched_calls(model, lay) == 3 < sum(comm_calls(model, lay).values())
    assert dispatched_calls(model, ParallelLayout(dp=2, data_parallel="ddp")) == 0
    base = predict(model, lay, cpu)
    costly = predict(model, lay, replace(cpu, call_overhead=1e-3))
    assert costly.step_seconds - base.step_seconds == pytest.approx(3e-3)
    shared = predict(model, lay, replace(cpu, call_overhead=1e-3, shared=2.0))
    wire = sum(costly.comm_seconds.values())
    busy = costly.step_seconds - wire
    assert shared.step_seconds == pytest.approx(2 * busy + wire)


@pytest.mark.parametrize(
    "kw",
    [
        {"dp": 2},
        {"tp": 2, "dp": 1},
        {"pp": 2, "dp": 1, "micro_batches": 4, "micro_batch_size": 2},
        {"pp": 2, "dp": 2, "micro_batches": 2, "data_parallel": "ddp"},
    ],
    ids=["dp2", "tp2", "pp2", "pp2 dp2 ddp"],
)
@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_breakdown_adds_up_to_the_step(kw: dict[str, Any], device: str) -> None:
    """``Prediction.breakdown``: compute, launch overhead, blocking tp / ep / pp communication,
    the bubble, exposed dp communication (and on time-shared cores the sharing) sum to the
    predicted step; the bubble part is zero without a pipeline."""
    from lightning_mmpar.layout.cost import predict
    from lightning_mmpar.layout.model import Boundary, ModelSpec, ParamSpec

    model = ModelSpec(
        blocks=blocks(4).blocks,
        params=tuple(ParamSpec(f"w{i}", (64, 64), i, 0, True) for i in range(4)),
        boundaries=tuple((Boundary(600, True), Boundary(40, False)) for _ in range(4)),
    )
    got = predict(model, ParallelLayout(**kw), DEVICES[device])
    assert sum(got.breakdown.values()) == pytest.approx(got.step_seconds, rel=1e-9)
    assert all(v >= 0 for v in got.breakdown.values()), got.breakdown
    assert (got.breakdown["pipeline bubble"] > 0) == (kw.get("pp", 1) > 1)
    assert got.breakdown["compute"] == pytest.approx(got.compute_seconds)
