"""Parallel plans as data (fusion and toy), their application order, the one parallelize path,
and activation checkpointing of a plan's layers (same loss and gradients, activations really
recomputed; the deprecated model-side option maps onto it), in one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer, make_tokens
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.models.vision import FusedQKV
from lightning_mmpar.parallel.tensor import StyleGroup, apply_styles
from lightning_mmpar.plans import (
    FusionPlanOptions,
    ParallelPlan,
    TensorParallelOptions,
    apply_plan,
    fusion_plan,
    parallelize_fusion,
    parallelize_toy,
    toy_plan,
)
from lightning_mmpar.plans.fusion import checkpoint_units
from lightning_mmpar.topology import ParallelDims
from tests.builders import tiny_fusion_config

TOWERS = ("vision.transformer.", "adapters.", "language.")
SHARDABLE = (nn.Linear, nn.Embedding, FusedQKV)


def fusion_model(dropout: float = 0.0) -> FusionModel:
    torch.manual_seed(0)
    cfg = tiny_fusion_config(
        "tp", vision__layers=2, language__num_hidden_layers=2, adapter__num_blocks=2
    )
    cfg.adapter.dropout = dropout
    model = FusionModel(cfg)
    with torch.no_grad():  # move gates and norms off their constant inits
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def styled(plan: ParallelPlan, mesh: str | None = None) -> set[str]:
    return {n for g in plan.tensor_parallel if mesh in (None, g.mesh) for n in g.names()}


@pytest.mark.parametrize("vision_parallel", ["tp", "replicate"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fusion_plan_names_every_linear_of_each_sharded_tower(
    vision_parallel: str, sequence_parallel: bool
) -> None:
    model = fusion_model()
    options = FusionPlanOptions(
        vision_parallel=vision_parallel,  # type: ignore[arg-type]
        sequence_parallel=sequence_parallel,
    )
    plan = fusion_plan(model, options)
    names = styled(plan)
    towers = TOWERS if vision_parallel == "tp" else TOWERS[1:]
    for name, module in model.named_modules():
        if not isinstance(module, SHARDABLE):
            continue
        sharded = name.startswith(towers)
        assert (name in names) == sharded, f"{name}: in plan {name in names}, tower {sharded}"
    for name in names:  # every path of the plan exists
        model.get_submodule(name)
    vl = styled(plan, "vl")
    assert vl and all(n.startswith("adapters.") and ".attn" in n for n in vl)
    assert ("text_head" in names) == sequence_parallel
    assert plan.checkpointing is None and plan.activation_checkpointing == ()
    assert plan.layers == checkpoint_units(model) and plan.root is model


def test_fusion_units_checkpoint_and_fsdp() -> None:
    model = fusion_model()
    units = checkpoint_units(model)
    assert units == (
        "vision.transformer.resblocks.0",
        "vision.transformer.resblocks.1",
        "adapters.0",
        "adapters.1",
        "language.layers.0",
        "language.layers.1",
    )
    with pytest.warns(DeprecationWarning, match="trainer.strategy.init_args.activation_ch"):
        options = FusionPlanOptions(activation_checkpointing=True)
    plan = fusion_plan(model, options)  # the deprecated option: the strategy's "layers"
    assert plan.layers == units and plan.checkpointing == "layers"
    blocks, fsdp = model.pipeline_blocks(), plan.fsdp_units()
    assert [type(b) for b in fsdp] == [type(b) for b in blocks]
    params = [{id(p) for p in b.parameters()} for b in blocks]
    assert [{id(p) for p in b.parameters()} for b in fsdp] == params
    assert ParallelPlan().fsdp_units() == []


def test_options_are_validated_at_construction() -> None:
    with pytest.raises(ValueError, match=r"vision_parallel \('sharded'\) must be 'tp' or"):
        FusionPlanOptions(vision_parallel="sharded")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vl_combine \('sum'\) must be 'all_reduce' or"):
        FusionPlanOptions(vl_combine="sum")  # type: ignore[arg-type]


def test_tensor_parallel_options_is_a_deprecated_name() -> None:
    with pytest.warns(DeprecationWarning, match="use FusionPlanOptions"):
        old = TensorParallelOptions(sequence_parallel=True, vl_combine="all_gather")
    assert isinstance(old, FusionPlanOptions)
    new = FusionPlanOptions(sequence_parallel=True, vl_combine="all_gather")
    model = fusion_model()
    plans = fusion_plan(model, old), fusion_plan(model, new)
    assert styled(plans[0]) == styled(plans[1]) and styled(plans[0], "vl") == styled(plans[1], "vl")
    assert plans[0].dropout_regions == plans[1].dropout_regions
    with pytest.raises(ValueError, match=r"vl_combine \('sum'\) must be"):
        TensorParallelOptions(vl_combine="sum")  # type: ignore[arg-type]


def test_apply_styles_names_a_missing_mesh() -> None:
    group = StyleGroup("layers.0", "vl", {"q": ColwiseParallel()})
    with pytest.raises(KeyError, match=r"style group 'layers.0' runs on mesh 'vl', which is not"):
        apply_styles(ToyTransformer(), [group], {"tp": None})  # type: ignore[dict-item]


def test_single_rank_without_checkpointing_is_a_no_op() -> None:
    model = fusion_model()
    before = {n: p for n, p in model.named_parameters()}
    parallelize_fusion(model, ParallelDims(world_size=1))
    assert dict(model.named_parameters()) == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def fusion_loss(model: FusionModel, seed: int) -> Tensor:
    torch.manual_seed(seed)
    images, ids = torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 8))
    out = model(images, ids)
    return sum((t.float().square().mean() for t in out if t.is_floating_point()), torch.zeros(()))


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class Counter:
    """Counts forward calls of a module (a recomputed forward runs it again in backward; the
    recomputation may stop early, once every saved tensor is back, so count call starts)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        module.register_forward_pre_hook(self)

    def __call__(self, *_: Any) -> None:
        self.calls += 1


def test_fusion_activation_checkpointing_same_loss_and_gradients() -> None:
    ref = fusion_model(dropout=0.2)  # dropout: the recomputation must replay the same masks
    model = copy.deepcopy(ref)
    with pytest.warns(DeprecationWarning):
        options = FusionPlanOptions(activation_checkpointing=True)
    parallelize_fusion(model, ParallelDims(world_size=1), options)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    units = checkpoint_units(model)
    ref_counts = [Counter(ref.get_submodule(f"{u}.mlp")) for u in units]
    counters = [Counter(model.get_submodule(f"{u}.mlp")) for u in units]
    ref_loss, loss = fusion_loss(ref, 1), fusion_loss(model, 1)
    calls = [c.calls for c in ref_counts]  # decoder layers run once per text stream
    assert [c.calls for c in counters] == calls and min(calls) >= 1
    ref_loss.backward()
    loss.backward()
    assert [c.calls for c in ref_counts] == calls
    recomputed = [c.calls for c in counters]
    assert recomputed == [2 * n for n in calls], "activations were not recomputed"
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    ref_grads, got = grads(ref), grads(model)
    assert got.keys() == ref_grads.keys() and len(got) == len(list(ref.parameters()))
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_toy_plan_names_every_linear_of_its_blocks() -> None:
    model = ToyTransformer(ToyConfig(layers=2))
    plan = toy_plan(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert styled(plan) == {n for n in linears if n.startswith("layers.")}
    assert styled(plan) and "head.out" in linears
    assert [type(b) for b in plan.fsdp_units()] == [type(b) for b in model.pipeline_blocks()]
    assert toy_plan(model).layers == ("layers.0", "layers.1")
    with pytest.warns(DeprecationWarning, match="activation_checkpointing='layers'"):
        with_ac = toy_plan(model, activation_checkpointing=True)
    assert with_ac.layers == ("layers.0", "layers.1") and with_ac.checkpointing == "layers"


def test_toy_activation_checkpointing_same_loss_and_gradients() -> None:
    cfg = ToyConfig()
    torch.manual_seed(0)
    ref = ToyTransformer(cfg)
    model = copy.deepcopy(ref)
    with pytest.warns(DeprecationWarning):
        parallelize_toy(model, ParallelDims(world_size=1), activation_checkpointing=True)
    counter = Counter(model.layers[0].up)
    batch = make_tokens(4, cfg)
    losses = [m.pipeline_loss(m(batch[:, :-1]), batch[:, 1:]) for m in (ref, model)]
    for loss in losses:
        loss.backward()
    assert counter.calls == 2
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    ref_grads = grads(ref)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_toy_heads_must_divide_by_tp() -> None:
    with pytest.raises(ValueError, match=r"ToyConfig.heads \(4\) must be divisible by .* \(8\)"):
        parallelize_toy(ToyTransformer(), ParallelDims(world_size=8, tp=8))


def test_apply_plan_without_meshes_only_checkpoints() -> None:
    model = ToyTransformer(ToyConfig(layers=1))
    apply_plan(model, toy_plan(model), {})
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
