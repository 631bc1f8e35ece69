"""The one parallelize path in one process: the strategy's activation-checkpointing option over a
plan's layers (the deprecated model-side option maps onto it), its agreement with the planner's
cost model, a plan applied once, and the strategy applying the module's own plan."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer, make_tokens
from lightning_mmpar.layout.cost import _NOT_RECOMPUTED
from lightning_mmpar.parallel.fsdp_options import MemoryOptions
from lightning_mmpar.parallel.parallelize import (
    ParallelPlan,
    applies_plans,
    apply_model_parallel,
    checkpoint_and_compile,
    module_plan,
)
from lightning_mmpar.plans import FusionPlanOptions, fusion_plan, toy_plan
from lightning_mmpar.plans.fusion import checkpoint_units
from lightning_mmpar.testing import quiet_trainer
from lightning_mmpar.topology import ParallelDims
from tests.unit.plans.test_plans import Counter, fusion_loss, fusion_model, grads

WRAPPED = "_mmpar_block_options"


def wrapped(modules: list[nn.Module]) -> list[int]:
    return [i for i, m in enumerate(modules) if getattr(m, WRAPPED, False)]


def test_layers_option_checkpoints_the_plans_layers_exactly() -> None:
    ref = fusion_model(dropout=0.2)  # dropout: the recomputation must replay the same masks
    model = copy.deepcopy(ref)
    plan = fusion_plan(model)
    checkpoint_and_compile(model, plan, MemoryOptions(activation_checkpointing="layers"))
    units = checkpoint_units(model)
    assert [u for u in units if getattr(model.get_submodule(u), WRAPPED, False)] == list(units)
    assert sum(getattr(m, WRAPPED, False) for m in model.modules()) == len(units)
    counters = [Counter(model.get_submodule(f"{u}.mlp")) for u in units]
    ref_loss, loss = fusion_loss(ref, 1), fusion_loss(model, 1)
    forward = [c.calls for c in counters]
    loss.backward()
    ref_loss.backward()
    assert [c.calls for c in counters] == [2 * n for n in forward], "not recomputed"
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    ref_grads = grads(ref)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_deprecated_model_option_maps_onto_the_strategy_option() -> None:
    with pytest.warns(DeprecationWarning):
        options = FusionPlanOptions(activation_checkpointing=True)
    old, new = fusion_model(), fusion_model()
    checkpoint_and_compile(old, fusion_plan(old, options))  # no strategy option: the plan's
    checkpoint_and_compile(new, fusion_plan(new), MemoryOptions(activation_checkpointing="layers"))
    names = [n for n, m in old.named_modules() if getattr(m, WRAPPED, False)]
    assert names == [n for n, m in new.named_modules() if getattr(m, WRAPPED, False)]
    assert names == list(checkpoint_units(old))


def test_strategy_option_wins_over_the_plans_choice() -> None:
    module = ToyTransformer(ToyConfig(layers=2))
    module.head.kind = "head"  # type: ignore[assignment]
    with pytest.warns(DeprecationWarning):
        plan = toy_plan(module, activation_checkpointing=True)  # "layers": the 2 blocks
    assert plan.checkpointing == "layers"
    checkpoint_and_compile(module, plan, MemoryOptions(activation_checkpointing=["head"]))
    assert wrapped(module.pipeline_blocks()) == [3]
    unset = ToyTransformer(ToyConfig(layers=2))  # the strategy's option unset: the plan's
    checkpoint_and_compile(unset, plan, MemoryOptions())
    assert wrapped(unset.pipeline_blocks()) == [1, 2]


def test_cost_model_recomputes_the_plans_layers() -> None:
    """``layout.cost`` counts every block but ``_NOT_RECOMPUTED`` as recomputed under
    checkpointing: those are the blocks wrapping the fusion plan's layers."""
    model = fusion_model()
    layers = {id(model.get_submodule(p)) for p in fusion_plan(model).layers}
    vl, de = len(model.vision.transformer.resblocks), len(model.language.layers)
    names = ["vision.stem", *(f"vision.layer{i}" for i in range(vl)), "vision.pool", "bridge"]
    names += [f"adapter{i}" for i in range(len(model.adapters))]
    names += [*(f"decoder{i}" for i in range(de)), "head"]
    blocks = model.pipeline_blocks()
    assert len(names) == len(blocks)
    recomputed = {
        n for n, b in zip(names, blocks, strict=True) if any(id(m) in layers for m in b.children())
    }
    assert set(names) - recomputed == set(_NOT_RECOMPUTED)
    assert len(recomputed) == len(layers)


def test_layers_inside_compiled_blocks_are_refused() -> None:
    model = fusion_model()
    memory = MemoryOptions(activation_checkpointing="layers", compile_blocks="aot_eager")
    with pytest.raises(ValueError, match=re.escape("compile_blocks='aot_eager' compiles those")):
        checkpoint_and_compile(model, fusion_plan(model), memory)
    toy = ToyTransformer(ToyConfig(layers=2))  # its layers are blocks: compiled + checkpointed
    checkpoint_and_compile(toy, toy_plan(toy), memory)
    assert wrapped(toy.pipeline_blocks()) == [0, 1, 2, 3]
    batch = make_tokens(2, toy.cfg)
    toy.pipeline_loss(toy(batch[:, :-1]), batch[:, 1:]).backward()


def test_a_plan_is_applied_once_and_read_from_the_module() -> None:
    toy = ToyTransformer(ToyConfig(layers=2))
    calls: list[int] = []
    plan = ParallelPlan(after_model_parallel=(lambda dims: calls.append(dims.tp),))
    one = ParallelDims(world_size=1)
    assert apply_model_parallel(toy, one, plan) is toy
    apply_model_parallel(toy, one, plan)
    assert calls == [1]
    assert module_plan(toy, one).layers == ("layers.0", "layers.1")  # type: ignore[union-attr]
    assert module_plan(nn.Linear(2, 2), one) is None
    assert not applies_plans(None)
    with pytest.raises(ValueError, match=r"ToyConfig.heads \(4\) must be divisible .* \(8\)"):
        module_plan(ToyTransformer(), ParallelDims(world_size=8, tp=8))


@pytest.fixture
def one_process_world() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_world")
def test_strategy_applies_the_modules_plan_in_setup(tmp_path: Path) -> None:
    """``mm_parallel`` calls ``parallel_plan(dims)`` once, in ``setup`` (after
    ``configure_model``), and applies it with its own options."""
    torch.manual_seed(0)
    model = ToyTransformer(ToyConfig(layers=2))
    seen: list[str] = []
    plan = model.parallel_plan

    def recorded(dims: ParallelDims) -> ParallelPlan:
        seen.append("plan")
        return plan(dims)

    model.parallel_plan = recorded  # type: ignore[method-assign]
    strategy = MultimodalParallelStrategy(activation_checkpointing="layers")
    trainer = quiet_trainer(
        strategy=strategy, devices=1, max_steps=2, default_root_dir=tmp_path, logger=False
    )
    assert applies_plans(trainer)
    data = make_tokens(8, model.cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(data, batch_size=4))
    assert seen == ["plan"] and trainer.global_step == 2
    assert wrapped(model.pipeline_blocks()) == [1, 2]  # the 2 layers, not embed and head
