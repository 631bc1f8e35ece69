"""MoE layer math (models/moe.py, models/moe_routing.py), one process.

Oracles nobody here wrote: DeepSpeed's ``top1gating`` / ``top2gating`` / ``topkgating`` and
Megatron-core's ``switch_load_balancing_loss_func`` / ``z_loss_func`` /
``topk_routing_with_score_function`` on the same logits; a per-token dense reference in float64
for outputs and gradients. Convention differences are pinned here and listed in docs/experts.md.
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from lightning_mmpar.models.moe import MoEFeedForward
from lightning_mmpar.models.moe_experts import grouped_mm_supported, swiglu_experts
from lightning_mmpar.models.moe_routing import (
    MoEConfig,
    RouteDecision,
    aligned_sequence_length,
    alignment_padding_mask,
    load_balancing_loss,
    route_tokens,
    router_z_loss,
)

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def deepspeed_moe() -> ModuleType:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.moe.sharded_moe")


@pytest.fixture(scope="module")
def megatron_moe() -> ModuleType:
    return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def logits_for(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2


def combine_tensor(d: RouteDecision, num_experts: int, capacity: int) -> torch.Tensor:
    """Our decision as DeepSpeed's ``combine_weights [S, E, C]``."""
    out = torch.zeros(d.experts.shape[0], num_experts, capacity)
    for t, j in zip(*torch.nonzero(d.kept, as_tuple=True), strict=True):
        out[t, d.experts[t, j], d.slots[t, j]] = d.gates[t, j]
    return out


def test_top1_matches_deepspeed_top1gating(deepspeed_moe: ModuleType) -> None:
    logits = logits_for(12, 4)
    cfg = MoEConfig(num_experts=4, top_k=1, capacity_factor=4.0)  # C = 12: nothing dropped
    ours = route_tokens(logits, cfg)
    l_aux, combine, _, counts = deepspeed_moe.top1gating(
        logits.clone(), 4.0, 0, use_rts=False, drop_tokens=True
    )
    assert ours.capacity == combine.shape[-1] == 12
    torch.testing.assert_close(combine_tensor(ours, 4, 12), combine, **TOL)
    torch.testing.assert_close(load_balancing_loss(ours.probs, ours.experts, 4), l_aux, **TOL)
    assert torch.equal(torch.bincount(ours.experts.flatten(), minlength=4), counts)


def test_top2_with_drops_matches_deepspeed_top2gating(deepspeed_moe: ModuleType) -> None:
    logits = logits_for(16, 4, seed=1)
    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5)  # C = ceil(2*16/4*0.5) = 4
    ours = route_tokens(logits, cfg)
    l_aux, combine, dispatch, counts = deepspeed_moe.top2gating(
        logits.clone(), 0.5, 0, drop_tokens=True, top2_2nd_expert_sampling=False
    )
    assert ours.capacity == combine.shape[-1] == 4 and not bool(ours.kept.all())
    mine = combine_tensor(ours, 4, 4)
    assert torch.equal(mine.bool(), dispatch)  # same slots, same drops (GShard priority order)
    assert torch.equal(torch.bincount(ours.experts.flatten(), minlength=4), counts)
    both = ours.kept.all(1)
    torch.testing.assert_close(mine[both], combine[both], **TOL)
    # DeepSpeed renormalises the gates after dropping: a lone surviving route weighs 1.
    # Ours keep the pre-drop normalisation p_e / (p_1 + p_2) (Megatron-core, Mixtral).
    lone = ours.kept.any(1) & ~both
    assert bool(lone.any())
    torch.testing.assert_close(combine[lone].sum((1, 2)), torch.ones(int(lone.sum())))
    torch.testing.assert_close(mine[lone].sum((1, 2)), (ours.gates * ours.kept)[lone].sum(1))
    # DeepSpeed's top2 l_aux counts first choices only: E * sum_i P_i f1_i.
    first = torch.bincount(ours.experts[:, 0], minlength=4) / 16
    torch.testing.assert_close(4 * (ours.probs.mean(0) * first).sum(), l_aux, **TOL)


def test_topk_loss_and_top1_drops_match_deepspeed_topkgating(deepspeed_moe: ModuleType) -> None:
    logits = logits_for(20, 5, seed=2)
    ours = route_tokens(logits, MoEConfig(num_experts=5, top_k=2, capacity_factor=10.0))
    l_aux, combine, _, counts = deepspeed_moe.topkgating(logits.clone(), 2, 10.0, 0)
    torch.testing.assert_close(load_balancing_loss(ours.probs, ours.experts, 5), l_aux, **TOL)
    assert torch.equal(torch.bincount(ours.experts.flatten(), minlength=5), counts)
    torch.testing.assert_close(combine_tensor(ours, 5, combine.shape[-1]).sum(2), combine.sum(2))
    # top-1 dropping "first come, first served" = topkgating(k=1, drop_policy="position");
    # top1gating(use_rts=False) instead keeps whichever rows torch.topk returns among ties.
    one = route_tokens(logits, MoEConfig(num_experts=5, top_k=1, capacity_factor=0.5))
    _, _, dispatch, _ = deepspeed_moe.topkgating(logits.clone(), 1, 0.5, 0, drop_policy="position")
    assert not bool(one.kept.all())
    assert torch.equal(combine_tensor(one, 5, one.capacity).bool(), dispatch)


@pytest.mark.parametrize("top_k", [1, 2])
def test_losses_and_probs_match_megatron(megatron_moe: ModuleType, top_k: int) -> None:
    logits = logits_for(24, 6, seed=3)
    ours = route_tokens(logits, MoEConfig(num_experts=6, top_k=top_k, capacity_factor=None))
    counts = torch.bincount(ours.experts.flatten(), minlength=6)
    aux = megatron_moe.switch_load_balancing_loss_func(ours.probs, counts, 24, top_k, 6, 1.0)
    torch.testing.assert_close(load_balancing_loss(ours.probs, ours.experts, 6), aux, **TOL)
    torch.testing.assert_close(router_z_loss(logits), megatron_moe.z_loss_func(logits, 1.0))
    # Megatron's top-1 weight is p_e with pre-softmax, top-k weights softmax(top-k logits)
    probs, routing_map = megatron_moe.topk_routing_with_score_function(
        logits, top_k, use_pre_softmax=top_k == 1
    )
    mine = torch.zeros(24, 6).scatter(1, ours.experts, ours.gates)
    torch.testing.assert_close(mine, probs, **TOL)
    assert torch.equal(mine > 0, routing_map)


def test_temperature_scales_logits_and_z_loss_sees_tempered_logits() -> None:
    logits = logits_for(8, 4, seed=4)
    hot = route_tokens(logits, MoEConfig(num_experts=4, top_k=2, temperature=0.5))
    plain = route_tokens(logits * 2, MoEConfig(num_experts=4, top_k=2))
    torch.testing.assert_close(hot.probs, plain.probs)
    torch.testing.assert_close(hot.gates, plain.gates)
    torch.testing.assert_close(hot.logits, logits * 2)


def make_layer(dtype: torch.dtype = torch.float32, **kw: object) -> MoEFeedForward:
    args: dict = dict(num_experts=4, top_k=2, ffn_width=32, router_dim=8, init_std=0.3)
    args.update(kw)
    torch.manual_seed(0)
    return MoEFeedForward(16, MoEConfig(**args)).to(dtype)


def inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 16, generator=g, dtype=dtype)
    modality = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 6:] = True
    return x, modality, pad


def dense_reference(layer: MoEFeedForward, x, modality, pad) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: router m, top-k, slots in (choice, token) order, capacity, SwiGLU sum."""
    cfg, y = layer.config, torch.zeros_like(x)
    aux = x.new_zeros(())
    for m in range(len(cfg.modalities)):
        pos = [
            (b, s)
            for b in range(x.shape[0])
            for s in range(x.shape[1])
            if not pad[b, s] and modality[b, s] == m
        ]
        if not pos:
            continue
        toks = torch.stack([x[b, s] for b, s in pos])
        logits = layer.router_proj(toks) @ layer.router_gate[m].t() / cfg.temperature
        probs = logits.softmax(-1)
        top = [
            sorted(range(cfg.num_experts), key=lambda e: -float(p[e].detach()))[: cfg.top_k]
            for p in probs
        ]
        cap = math.ceil(cfg.top_k * len(pos) / cfg.num_experts * (cfg.capacity_factor or 1e9))
        used = [0] * cfg.num_experts
        for j in range(cfg.top_k):
            for t, (b, s) in enumerate(pos):
                e = top[t][j]
                used[e] += 1
                if used[e] > cap:
                    continue
                gate = probs[t, e] / (probs[t, top[t]].sum() if cfg.top_k > 1 else 1)
                h = F.silu(x[b, s] @ layer.experts.w_gate[e]) * (x[b, s] @ layer.experts.w_up[e])
                y[b, s] = y[b, s] + gate * (h @ layer.experts.w_down[e])
        f = torch.tensor([sum(e in t for t in top) for e in range(cfg.num_experts)], dtype=x.dtype)
        lb = cfg.num_experts * (f / (cfg.top_k * len(pos)) * probs.mean(0)).sum()
        aux = (
            aux
            + cfg.aux_loss_weight * lb
            + cfg.z_loss_weight * logits.logsumexp(-1).square().mean()
        )
    return y, aux


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_layer_equals_dense_reference_float64_outputs_and_gradients(capacity_factor) -> None:
    layer = make_layer(torch.float64, capacity_factor=capacity_factor, aux_loss_weight=0.1)
    x, modality, pad = inputs(torch.float64)
    x.requires_grad_(True)
    y = layer(x, modality, pad)
    if capacity_factor is not None:
        assert any(float(s.dropped_fraction) > 0 for s in layer.last_stats.values())
    (y.square().sum() + layer.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x.grad = None
    y_ref, aux_ref = dense_reference(layer, x, modality, pad)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.aux_loss, aux_ref, rtol=1e-10, atol=1e-12)
    (y_ref.square().sum() + aux_ref).backward()
    for name, p in [*layer.named_parameters(), ("x", x)]:
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_gradcheck_input_and_router_float64() -> None:
    layer = make_layer(torch.float64, num_experts=3, ffn_width=4, router_dim=4, aux_loss_weight=1.0)
    x, modality, pad = (t[:1, :4] for t in inputs(torch.float64))

    def f(inp: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.func.functional_call(layer, {"router_gate": gate}, (inp, modality, pad))
        return out, layer.aux_loss

    gate = layer.router_gate.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x.clone().requires_grad_(True), gate), fast_mode=True)


def test_dropless_equals_infinite_capacity() -> None:
    x, modality, pad = inputs()
    dropless = make_layer(capacity_factor=None)
    huge = make_layer(capacity_factor=1e6)
    torch.testing.assert_close(dropless(x, modality, pad), huge(x, modality, pad), rtol=0, atol=0)
    for name, s in dropless.last_stats.items():
        assert float(s.dropped_fraction) == 0 and float(s.experts_per_token) == 2
        assert torch.equal(s.kept_per_expert, huge.last_stats[name].kept_per_expert)


def test_padding_is_never_routed_nor_counted() -> None:
    layer = make_layer(capacity_factor=1.0, num_shared_experts=1)
    x, modality, pad = inputs()
    plan = layer.route(x, modality, pad)
    assert not bool(pad.flatten()[plan.token_index].any())
    y = layer(x, modality, pad)
    stats, aux = layer.last_stats, layer.aux_loss
    assert bool((y[pad] == 0).all())
    assert int(stats["text"].tokens) + int(stats["vision"].tokens) == int((~pad).sum()) == 14
    assert int(stats["text"].tokens_per_expert.sum()) == 2 * 9
    noisy = x.clone()
    noisy[pad] = 1e3  # garbage in the padding changes nothing
    torch.testing.assert_close(layer(noisy, modality, pad), y, rtol=0, atol=0)
    torch.testing.assert_close(layer.aux_loss, aux, rtol=0, atol=0)
    for name, s in layer.last_stats.items():
        assert torch.equal(s.kept_per_expert, stats[name].kept_per_expert)


def test_channels_route_separately() -> None:
    layer = make_layer()
    x, modality, pad = inputs()
    y = layer(x, modality, pad)
    before = layer.route(x, modality, pad).decisions
    text = (modality == 0) & ~pad
    with torch.no_grad():
        layer.router_gate[1].mul_(-3.0)  # only the vision router changes
    y2 = layer(x, modality, pad)
    after = layer.route(x, modality, pad).decisions
    # The text tokens' routing is bitwise unchanged; their outputs equal to fp32 rounding (each
    # expert's matmul now sees a different number of vision rows, so the BLAS blocking and the
    # summation order may differ by an ulp).
    for field in ("experts", "gates", "kept", "probs"):
        torch.testing.assert_close(
            getattr(after["text"], field), getattr(before["text"], field), rtol=0, atol=0
        )
    assert not torch.equal(after["vision"].probs, before["vision"].probs)
    torch.testing.assert_close(y2[text], y[text], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y2[modality == 1], y[modality == 1])
    layer.zero_grad()
    layer(x, torch.zeros_like(modality), pad).sum().backward()  # text tokens only
    assert layer.router_gate.grad is not None
    assert float(layer.router_gate.grad[1].abs().sum()) == 0.0
    assert float(layer.router_gate.grad[0].abs().sum()) > 0.0 and set(layer.last_stats) == {"text"}


def test_aux_free_bias_changes_selection_not_gate_values() -> None:
    logits = logits_for(10, 4, seed=6)
    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=None, load_balancing="aux_free")
    plain = route_tokens(logits, cfg)
    biased = route_tokens(logits, cfg, bias=torch.tensor([0.0, 0.0, 0.0, 2.0]))
    assert bool((biased.experts == 3).any(1).all()) and not torch.equal(
        biased.experts, plain.experts
    )
    picked = plain.probs.gather(1, biased.experts)  # unbiased probabilities of the chosen experts
    torch.testing.assert_close(biased.gates, picked / picked.sum(1, keepdim=True))
    torch.testing.assert_close(biased.probs, plain.probs)

    layer = make_layer(load_balancing="aux_free", bias_update_rate=0.1, z_loss_weight=0.0)
    x, modality, pad = inputs()
    layer.train()
    layer(x, modality, pad)
    assert float(layer.aux_loss) == 0.0  # no balance loss in aux-free mode
    load = layer.pending_load.clone()
    assert torch.equal(load[0], layer.last_stats["text"].kept_per_expert.float())
    layer.update_expert_bias()
    expected = 0.1 * torch.sign(load.mean(1, keepdim=True) - load)
    torch.testing.assert_close(layer.expert_bias, expected)
    assert float(layer.pending_load.abs().sum()) == 0.0
    assert "expert_bias" in layer.state_dict() and "pending_load" not in layer.state_dict()


def test_grouped_mm_equals_loop_outputs_and_gradients() -> None:
    layer = make_layer()
    x, modality, pad = inputs()
    if not grouped_mm_supported(x, layer.experts.w_gate, layer.experts.w_down):
        pytest.skip("torch._grouped_mm unavailable for float32 on this build/device")
    results = []
    for grouped in (True, False):
        layer.zero_grad()
        layer.grouped_mm = grouped
        y = layer(x, modality, pad)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    empty = torch.zeros(0, 16)  # an empty batch and empty groups
    counts = torch.zeros(4, dtype=torch.long)
    assert swiglu_experts(
        empty, counts, layer.experts.w_gate, layer.experts.w_up, layer.experts.w_down
    ).shape == (0, 16)
    assert not grouped_mm_supported(x.double(), layer.experts.w_gate.double())


def test_stats_units_on_a_uniform_router() -> None:
    layer = make_layer(num_experts=4, top_k=1, capacity_factor=None)
    with torch.no_grad():
        layer.router_gate.zero_()  # p = 1/E for every token
    x, modality, pad = inputs()
    layer(x, modality, pad)
    s = layer.last_stats["text"]
    torch.testing.assert_close(s.routing_entropy_bits, torch.tensor(2.0))
    torch.testing.assert_close(s.top1_share, torch.tensor(0.25))
    torch.testing.assert_close(s.z_loss, torch.tensor(math.log(4) ** 2))
    assert float(s.experts_per_token) == 1.0 and int(s.tokens) == 9


def test_sequence_alignment_image_text_audio() -> None:
    lengths = [196, 512, 256]
    assert math.lcm(*lengths) == 25088  # padding to lcm(lengths): not what we do
    assert aligned_sequence_length(lengths, tp_size=2, num_experts=4) == 512
    assert aligned_sequence_length(lengths, tp_size=4, num_experts=6) == 516
    assert aligned_sequence_length(lengths, tp_size=8, num_experts=3) == 528
    mask = alignment_padding_mask(lengths, tp_size=4, num_experts=6)
    assert mask.shape == (3, 516) and (~mask).sum(1).tolist() == lengths
    assert not bool(mask[1, :512].any()) and bool(mask[0, 196:].all())
    with pytest.raises(ValueError, match=r"lengths \(\[\]\)"):
        aligned_sequence_length([], 2, 4)
    with pytest.raises(ValueError, match=r"tp_size \(0\) must be >= 1"):
        aligned_sequence_length([3], 0, 4)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_experts", 0, r"num_experts \(0\) must be a positive integer"),
        ("top_k", 5, r"top_k \(5\) must be <= num_experts \(4\); lower top_k"),
        ("top_k", 0, r"top_k \(0\) must be a positive integer"),
        ("capacity_factor", 0.0, r"capacity_factor \(0.0\) must be > 0.*None for dropless"),
        ("capacity_factor", -1.0, r"capacity_factor \(-1.0\) must be > 0"),
        ("temperature", 0.0, r"temperature \(0.0\) must be > 0; use e.g. 1.0"),
        ("load_balancing", "sinkhorn", r"load_balancing \('sinkhorn'\) must be 'aux_loss'"),
        ("aux_loss_weight", -0.1, r"aux_loss_weight \(-0.1\) must be >= 0"),
        ("z_loss_weight", float("nan"), r"z_loss_weight \(nan\) must be >= 0"),
        ("bias_update_rate", -1.0, r"bias_update_rate \(-1.0\) must be >= 0"),
        ("num_shared_experts", -1, r"num_shared_experts \(-1\) must be an integer >= 0"),
        ("ffn_width", 0, r"ffn_width \(0\) must be a positive integer"),
        ("min_capacity", -2, r"min_capacity \(-2\) must be an integer >= 0; use 0"),
        ("modalities", ("text", "text"), r"modalities \(\('text', 'text'\)\) must be non-empty"),
    ],
)
def test_config_errors_name_field_value_and_fix(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{field: value})  # type: ignore[arg-type]


def test_forward_input_errors() -> None:
    layer = make_layer()
    x, modality, pad = inputs()
    with pytest.raises(ValueError, match=r"modality shape \(2, 7\) must equal x's \[B, S\]"):
        layer(x, modality[:, :7], pad)
    with pytest.raises(ValueError, match=r"modality id 2 has no router.*add the modality"):
        layer(x, modality + 1, pad)
    with pytest.raises(ValueError, match=r"x must be \[B, S, D\]"):
        layer(x[0], None, None)


def test_fewer_routable_experts_than_top_k_is_refused() -> None:
    """Sparsity or locality masks must leave ``top_k`` experts: otherwise top-k would pick
    masked experts (probability 0) and send tokens where they may not go."""
    config = MoEConfig(num_experts=4, top_k=2, ffn_width=8, router_dim=4, capacity_factor=None)
    layer = MoEFeedForward(16, config)
    x = torch.randn(1, 4, 16)
    layer.expert_mask[1:] = False
    with pytest.raises(ValueError, match=r"allows 1 experts .* but top_k is 2; keep at least"):
        layer(x)
    layer.expert_mask[2] = True
    layer(x)
    kept = sum(s.kept_per_expert for s in layer.last_stats.values())
    assert kept[1].item() == 0 and kept[3].item() == 0 and int(kept.sum()) == 8


def test_aux_free_bias_steps_after_each_optimizer_step_in_the_recipe() -> None:
    """``update_expert_biases`` (the recipe calls it after every optimizer step with the
    data-parallel group): the summed pending load moves each layer's bias by
    ``rate * sign(mean - load)`` and is cleared; layers balanced by the aux loss are left alone."""
    from lightning_mmpar.parallel.moe_state import update_expert_biases

    free = MoEConfig(num_experts=4, top_k=1, ffn_width=8, router_dim=4, load_balancing="aux_free")
    layers = torch.nn.ModuleList(
        [MoEFeedForward(16, free), MoEFeedForward(16, MoEConfig(num_experts=4, top_k=1))]
    )
    layers[0].pending_load.copy_(torch.tensor([[3.0, 1.0, 0.0, 4.0], [0.0, 0.0, 0.0, 0.0]]))
    layers[1].pending_load.fill_(5.0)
    assert update_expert_biases(layers, None) == 1
    rate = free.bias_update_rate
    want = torch.tensor([[-rate, rate, rate, -rate], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(layers[0].expert_bias, want, rtol=0, atol=0)
    assert not layers[0].pending_load.any() and bool((layers[1].expert_bias == 0).all())


def test_llama_export_refuses_an_moe_decoder() -> None:
    from lightning_mmpar.models import LanguageConfig
    from lightning_mmpar.models.convert import llama_config

    with pytest.raises(ValueError, match=r"LanguageConfig.moe is set: .* no LlamaForCausalLM"):
        llama_config(LanguageConfig(moe=MoEConfig()))


def test_adapter_ffn_as_moe_routes_text_only_and_never_padding() -> None:
    """``AdapterConfig.moe``: the adapter's gated FFN is an MoE layer on the text stream; padded
    text positions are not routed and the modalities must include the text router."""
    from lightning_mmpar.models import AdapterConfig, CrossModalAdapter

    config = MoEConfig(num_experts=4, top_k=2, ffn_width=8, router_dim=4, capacity_factor=None)
    adapter = CrossModalAdapter(16, AdapterConfig(heads=2, width=16, ffn_width=32, moe=config))
    text, image = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    adapter(text, image, pad)
    assert adapter.moe is not None and list(adapter.moe.last_stats) == ["text"]
    assert int(adapter.moe.last_stats["text"].tokens) == 8
    with pytest.raises(ValueError, match=r"AdapterConfig.moe.modalities .*'vision'.* must include"):
        AdapterConfig(moe=MoEConfig(modalities=("vision",)))


def test_router_without_projection_is_a_plain_linear_router() -> None:
    """``router_dim=None``: no ``router_proj`` parameter, one head ``[E, D]`` read from ``x``
    (Mixtral / Qwen-MoE's router); the gates are the renormalised top-k softmax of ``x G^T``."""
    torch.manual_seed(0)
    config = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_width=8,
        router_dim=None,
        modalities=("text",),
        capacity_factor=None,
    )
    layer = MoEFeedForward(16, config)
    assert not any(n.startswith("router_proj") for n, _ in layer.named_parameters())
    assert layer.router_gate.shape == (1, 4, 16)
    x = torch.randn(2, 5, 16)
    plan = layer.route(x, None, None)
    probs = torch.softmax(x.reshape(-1, 16) @ layer.router_gate[0].t(), -1)
    top = probs.topk(2, -1)
    want = (top.values / top.values.sum(-1, keepdim=True)).t().reshape(-1)
    order = torch.sort(top.indices.t().reshape(-1), stable=True).indices
    assert torch.allclose(plan.gates, want[order])
    with pytest.raises(ValueError, match="router_dim"):
        MoEConfig(router_dim=0)
