"""The bytes above the ideal by cause (lightning_mmpar.layout.memory_ideal): exact on hand-built
specs, and on the CPU recipe's fusion model under the three layouts docs/results.md breaks
down (benchmarks/bench_memory_comm.py measures the same state bytes on every rank and
tests/recipes/test_parity_matrix.py checks state_bytes against the real local shards)."""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_mmpar.layout.memory import local_shape, stage_blocks, state_bytes
from lightning_mmpar.layout.memory_ideal import memory_excess, replicated_kind
from lightning_mmpar.layout.model import ModelSpec, ParamSpec
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.value import ParallelLayout

CPU_YAML = Path(__file__).resolve().parents[3] / "recipes" / "clip_llama_cpu.yaml"
LAYOUTS = {
    "tp2 dp2": ParallelLayout(tp=2, dp=2, micro_batch_size=12),
    "pp2 dp2": ParallelLayout(pp=2, dp=2, micro_batches=2, micro_batch_size=6),
    "tp2 pp2": ParallelLayout(tp=2, pp=2, dp=1, micro_batches=2, micro_batch_size=12),
}
"""benchmarks/bench_memory_comm.py's layouts of 4 ranks (global batch 24)."""


def _coords(layout: ParallelLayout) -> list[dict[str, int]]:
    """Every rank's ``pp`` / ``dp`` coordinates (the tp coordinate changes no state bytes)."""
    return [
        {"pp": pp, "dp": dp, "edp": dp // layout.ep}
        for pp in range(layout.pp)
        for dp in range(layout.dp_size)
    ]


def _full(model: ModelSpec) -> int:
    """State bytes of the one-process model: ``state_bytes`` of the trivial layout."""
    return state_bytes(model, ParallelLayout(), {}).total


@functools.cache
def _recipe_model(name: str) -> ModelSpec:
    from lightning_mmpar.plans.fusion_cost import fusion_model_spec
    from lightning_mmpar.recipes.partition import build_module

    config = yaml.safe_load(CPU_YAML.read_text())
    module, data = build_module(config)
    data.setup()
    prompts = tuple(data.class_prompts()["input_ids"].shape)
    return fusion_model_spec(module, LAYOUTS[name], int(data.max_length), prompts)  # type: ignore[arg-type]


def _assert_adds_up(model: ModelSpec, layout: ParallelLayout) -> list[Any]:
    shard = layout.dp_size if layout.data_parallel == "fsdp" else 1
    out = []
    for coords in _coords(layout):
        e = memory_excess(model, layout, coords)
        assert e.held == state_bytes(model, layout, coords).total
        assert e.ideal == Fraction(_full(model), layout.tp * layout.pp * shard)
        assert sum(e.causes.values()) == e.held - e.ideal  # exactly, in Fraction bytes
        out.append(e)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recipe_breakdown_adds_up_and_honest_ideal_within_2pct(name: str) -> None:
    model, layout = _recipe_model(name), LAYOUTS[name]
    for e in _assert_adds_up(model, layout):
        assert abs(e.held / e.honest_ideal - 1) <= 0.02, (name, e.causes)
        assert (layout.pp > 1) == ("stage imbalance" in e.causes)
        assert (layout.tp > 1) == any(k.startswith("replicated over tp") for k in e.causes)


def test_fsdp_shards_tp_replicated_parameters_over_dp() -> None:
    """tp2 dp2: every non-scalar parameter tensor parallelism leaves whole is held 1 / dp by
    FSDP2, so the replicated excess is ``R / dp - R / (tp dp)``, not ``R - R / (tp dp)``."""
    model, layout = _recipe_model("tp2 dp2"), LAYOUTS["tp2 dp2"]
    whole = [p for p in model.params if p.tp_dim is None and p.shape]
    assert whole
    for p in whole:
        pieces = [math.prod(local_shape(p, layout, c)) for c in _coords(layout)]
        assert sum(pieces) == p.numel and max(pieces) < p.numel, p.name
    size = sum(p.numel * p.element_size * (4 if p.trainable else 1) for p in whole)
    e = memory_excess(model, layout, {"dp": 0})
    replicated = sum(v for k, v in e.causes.items() if k.startswith("replicated over tp"))
    assert replicated == Fraction(size, 2) - Fraction(size, 4)


@pytest.mark.parametrize("name", ["pp2 dp2", "tp2 pp2"])
def test_equal_partition_is_the_best_contiguous_cut_for_state(name: str) -> None:
    """The largest rank's stage imbalance cannot be cut further: no explicit boundary gives
    a smaller largest rank (pipeline blocks are indivisible)."""
    model, layout = _recipe_model(name), LAYOUTS[name]

    def largest(lay: ParallelLayout) -> int:
        return max(state_bytes(model, lay, c).total for c in _coords(lay))

    cuts = [dataclasses.replace(layout, partition=[b]) for b in range(1, len(model.blocks))]
    assert largest(layout) == min(largest(lay) for lay in cuts)


def _param(name: str, shape: tuple[int, ...], block: int, tp_dim: int | None, **kw: Any) -> Any:
    return ParamSpec(name, shape, block, tp_dim, kw.pop("trainable", True), **kw)


def test_hand_spec_every_cause() -> None:
    """One spec that has every cause: stage imbalance, replicated norm / frozen head, a 0-dim
    gate, a vocab-parallel gradient left whole, experts, uneven FSDP shards."""
    blocks = tuple(BlockSpec(f"b{i}", "language", 1.0, 1.0, 1.0, 1.0) for i in range(3))
    model = ModelSpec(
        blocks=blocks,
        params=(
            _param("blocks.0.embed.weight", (8, 4), 0, 0, full_grad=True),
            _param("blocks.0.norm.weight", (4,), 0, None),
            _param("blocks.1.fc.weight", (6, 4), 1, 0),
            _param("blocks.1.fc.bias", (5,), 1, None),
            _param("blocks.1.attn_gate.alpha", (), 1, None),
            _param("blocks.2.moe.experts.w", (4, 3, 2), 2, None, expert=True),
            _param("blocks.2.head.weight", (3, 4), 2, None, trainable=False),
        ),
    )
    seen: set[str] = set()
    for layout in (
        ParallelLayout(tp=2, pp=2, dp=1),
        ParallelLayout(tp=2, pp=2, dp=3),
        ParallelLayout(tp=2, dp=2, ep=2),
        ParallelLayout(tp=2, dp=2, data_parallel="ddp"),
    ):
        for e in _assert_adds_up(model, layout):
            seen |= set(e.causes)
    assert seen >= {
        "stage imbalance",
        "replicated over tp: norms",
        "replicated over tp: biases",
        "replicated over tp: frozen",
        "0-dim (whole on every rank)",
        "experts (split by ep, not tp)",
        "AdamW step",
        "vocab-parallel gradient whole",
        "FSDP uneven shards",
    }


@pytest.mark.parametrize(
    ("name", "trainable", "kind"),
    [
        ("blocks.0.conv1.weight", True, "vision stem"),
        ("blocks.0.positional_embedding", True, "vision stem"),
        ("blocks.1.block.ln_1.weight", True, "norms"),
        ("blocks.6.layer.post_attention_layernorm.weight", True, "norms"),
        ("blocks.1.block.attn.out_proj.bias", True, "biases"),
        ("blocks.5.adapter.attn.o_proj.bias", True, "biases"),
        ("blocks.5.adapter.attn_gate.alpha", True, "gates"),
        ("blocks.6.layer.mlp.router.gate.weight", True, "router"),
        ("blocks.6.layer.mlp.experts.gate_proj", True, "MoE experts"),
        ("blocks.4.embed_tokens.weight", True, "embeddings"),
        ("blocks.15.adapter.attn.o_proj.weight", True, "attention output (vl_combine all_gather)"),
        ("blocks.4.projector.weight", True, "projections and heads"),
        ("blocks.8.momentum.image_head.weight", False, "frozen"),
    ],
)
def test_replicated_kind(name: str, trainable: bool, kind: str) -> None:
    assert replicated_kind(_param(name, (2,), 0, None, trainable=trainable)) == kind


def test_stage_imbalance_is_the_largest_stage_share() -> None:
    """pp2 dp2: (stage_full - full / 2) / dp on each rank, opposite signs on the two stages."""
    model, layout = _recipe_model("pp2 dp2"), LAYOUTS["pp2 dp2"]
    first, last = (memory_excess(model, layout, {"pp": s, "dp": 0}) for s in (0, 1))
    assert first.causes["stage imbalance"] == -last.causes["stage imbalance"] != 0
    total = _full(model)
    stage = sum(
        p.numel * p.element_size * 4 + 4 if p.trainable else p.numel * p.element_size
        for p in model.params
        if p.block in stage_blocks(model, layout, 1)
    )
    assert last.causes["stage imbalance"] == Fraction(stage, 2) - Fraction(total, 4)


def test_cost_model_cuts_memory_partition_as_the_strategy() -> None:
    """``partition="memory"`` weighs activations by the micro-batch size and the schedule's
    in-flight micro-batches in the strategy (``module_stage_plan``); the cost model's stages
    (``stage_blocks``, hence ``state_bytes`` and ``comm_bytes``) follow the same cut (tp2 pp2 at
    12 samples per micro-batch: boundary 4, not the one-sample cut 5)."""
    from lightning_mmpar.layout import in_flight, plan_stages, stage_ranks
    from lightning_mmpar.layout.memory import layout_stage_plan

    model = _recipe_model("tp2 pp2")
    layout = dataclasses.replace(LAYOUTS["tp2 pp2"], partition="memory")
    strategy = plan_stages(
        model.blocks,
        2,
        1,
        "memory",
        micro_batch_size=12,
        stage_ranks=stage_ranks("1f1b", 2, 1),
        in_flight=in_flight("1f1b", 2, 1, 2),
    )
    assert layout_stage_plan(model, layout).boundaries == strategy.boundaries == [4]
    assert stage_blocks(model, layout, 1) == list(range(4, len(model.blocks)))
    for e in _assert_adds_up(model, layout):
        assert abs(e.held / e.honest_ideal - 1) <= 0.02
