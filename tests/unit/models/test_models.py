"""Fusion model parity against the open_clip / transformers oracles (one process, tiny configs)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from open_clip.transformer import QuickGELU, VisionTransformer
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lightning_mmpar.models.adapter import AdapterConfig, CrossModalAdapter
from lightning_mmpar.models.block_cost import BlockCost
from lightning_mmpar.models.convert import (
    build_fusion_model,
    export_llama,
    export_open_clip_visual,
    import_llama,
    save_llama_pretrained,
)
from lightning_mmpar.models.fusion import FusionModel, freeze_for_finetuning
from lightning_mmpar.models.language import LanguageConfig, LlamaAttention
from lightning_mmpar.models.vision import (
    FusedQKV,
    VisionConfig,
    VisionTower,
    open_clip_shape,
)
from tests.builders import tiny_fusion_model

TOL = 1e-5


def tiny_open_clip(**kw: object) -> VisionTransformer:
    args: dict = dict(image_size=16, patch_size=4, width=32, layers=2, heads=4, mlp_ratio=2.0)
    args.update(output_dim=24, output_tokens=True)
    args.update(kw)
    torch.manual_seed(0)
    return VisionTransformer(**args).eval()


def tiny_llama(**kw: object) -> LlamaForCausalLM:
    args: dict = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    args.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args.update(kw)
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(**args)).eval()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pool_type": "avg", "final_ln_after_pool": True},
        {"act_layer": QuickGELU, "ls_init_value": 0.5, "no_ln_pre": True},
    ],
)
def test_vision_matches_open_clip(options: dict) -> None:
    ref = tiny_open_clip(**options)
    for p in ref.parameters():  # LayerScale/LN start at constants; make every weight distinct
        p.data.add_(0.01 * torch.randn_like(p))
    from lightning_mmpar.models.convert import vision_config_from_open_clip

    ours = VisionTower(vision_config_from_open_clip(ref)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    images = torch.randn(3, 3, 16, 16)
    pooled, tokens = ours(images)
    ref_pooled, ref_tokens = ref(images)
    assert tokens.shape == (3, 16, 32)
    torch.testing.assert_close(pooled, ref_pooled, atol=TOL, rtol=0)
    torch.testing.assert_close(tokens, ref_tokens, atol=TOL, rtol=0)
    assert set(ours.state_dict()) == set(ref.state_dict())
    for key, value in ref.state_dict().items():  # same values; fused in_proj as [3, D, D]
        assert torch.equal(open_clip_shape(key, ours.state_dict()[key]), value), key


def test_fused_qkv_is_open_clip_viewed_by_q_k_v() -> None:
    ref = tiny_open_clip()
    from lightning_mmpar.models.convert import vision_config_from_open_clip

    ours = VisionTower(vision_config_from_open_clip(ref))
    ours.load_state_dict(ref.state_dict(), strict=True)
    proj, ref_state = ours.get_submodule("transformer.resblocks.0.attn.in_proj"), ref.state_dict()
    assert isinstance(proj, FusedQKV)
    assert proj.weight.shape == (3, 32, 32) and proj.bias.shape == (3, 32)
    assert torch.equal(
        proj.weight.flatten(0, 1), ref_state["transformer.resblocks.0.attn.in_proj_weight"]
    )
    assert torch.equal(proj.bias.flatten(), ref_state["transformer.resblocks.0.attn.in_proj_bias"])
    state = ours.state_dict()  # our own [3, D, D] layout loads back too
    assert state["transformer.resblocks.0.attn.in_proj_weight"].shape == (3, 32, 32)
    again = VisionTower(ours.config)
    again.load_state_dict(state, strict=True)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state.items())
    fresh = VisionTower(ours.config).get_submodule("transformer.resblocks.0.attn.in_proj")
    assert isinstance(fresh, FusedQKV)  # nn.Linear(D, 3 D)'s init range
    for p in (fresh.weight, fresh.bias):
        assert 0.8 * 32**-0.5 < float(p.detach().abs().max()) <= 32**-0.5


def test_language_matches_llama() -> None:
    ref = tiny_llama()
    config, state = import_llama(ref)
    from lightning_mmpar.models.language import LanguageModel

    ours = LanguageModel(config).eval()
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(ours(ids), ref(ids).logits, atol=TOL, rtol=0)


def test_fusion_with_closed_gates_is_llama_and_open_clip() -> None:
    ref_v, ref_l = tiny_open_clip(), tiny_llama()
    model = build_fusion_model(ref_v, ref_l, adapter=AdapterConfig(heads=2, width=16, ffn_width=24))
    model.eval()
    for adapter in model.adapters:
        assert isinstance(adapter, CrossModalAdapter)
        adapter.attn_gate.alpha.data.zero_()
        adapter.ffn_gate.alpha.data.zero_()
    images, ids = torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 7))
    out = model(images, ids)
    torch.testing.assert_close(out.logits, ref_l(ids).logits, atol=TOL, rtol=0)
    img = torch.nn.functional.normalize(model.image_head(ref_v(images)[0]), dim=-1)
    torch.testing.assert_close(out.image_features, img, atol=TOL, rtol=0)
    assert torch.allclose(out.text_features.norm(dim=-1), torch.ones(2))


@pytest.mark.parametrize("gate_init", [0.0, 0.1])
def test_adapter_gradients_cross_the_boundary_at_step_one(gate_init: float) -> None:
    adapter = AdapterConfig(dropout=0.0, gate_init=gate_init)
    model = build_fusion_model(tiny_open_clip(), tiny_llama(), adapter=adapter)
    out = model(torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 5)))
    out.logits.square().mean().backward()
    params = dict(model.named_parameters())
    for name in ("projector.weight", "adapters.0.attn.k_proj.weight", "vision.conv1.weight"):
        grad = params[name].grad
        assert grad is not None
        assert (grad.abs().sum() > 0) == (gate_init != 0.0), name  # Flamingo's 0 blocks them


def hand_joint_attention(attn: LlamaAttention, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
    """Loop reference: logit_ij = q_i . k_j / sqrt(d) * t[m(j)], image keys + causal text keys."""
    n_img, n_txt, hd = img.shape[1], x.shape[1], attn.head_dim
    t_img, t_txt = attn.temperature.temperature.tolist()  # type: ignore[union-attr]
    cfg = LlamaConfig(
        hidden_size=32, num_attention_heads=4, head_dim=hd, max_position_embeddings=64
    )
    rope = LlamaRotaryEmbedding(cfg)
    seq = torch.cat([img, x], dim=1)
    pos = torch.arange(n_img + n_txt)[None]
    cos, sin = rope(seq, pos)
    heads = lambda t: t.unflatten(-1, (-1, hd)).transpose(1, 2)  # noqa: E731
    q = heads(attn.q_proj(seq))
    k, v = heads(attn.k_proj(seq)), heads(attn.v_proj(seq))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(x.shape[0], q.shape[1], n_txt, hd)
    for b in range(x.shape[0]):
        for h in range(q.shape[1]):
            for i in range(n_txt):
                qi = q[b, h, n_img + i]
                keys = [j for j in range(n_img + n_txt) if j < n_img or j - n_img <= i]
                logits = [
                    float(qi @ k[b, h // groups, j])
                    / math.sqrt(hd)
                    * (t_img if j < n_img else t_txt)
                    for j in keys
                ]
                top = max(logits)
                weights = [math.exp(s - top) for s in logits]
                for j, w in zip(keys, weights, strict=True):
                    out[b, h, i] += w / sum(weights) * v[b, h // groups, j]
    return attn.o_proj(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("temps", [(1.0, 0.7), (0.5, 1.3)])
def test_modality_temperature_matches_hand_reference(temps: tuple[float, float]) -> None:
    config = LanguageConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        joint_attention=True,
        image_temperature=temps[0],
        text_temperature=temps[1],
        learnable_temperature=True,
    )
    torch.manual_seed(0)
    attn = LlamaAttention(config)
    x, img = torch.randn(2, 3, 32), torch.randn(2, 2, 32)  # 3 text tokens, 2 image tokens
    with torch.no_grad():
        expected = hand_joint_attention(attn, x, img)
    got = attn(x, img)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    got.sum().backward()
    grad = attn.temperature.temperature.grad  # type: ignore[union-attr]
    assert grad is not None and bool((grad != 0).all())


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    ref_v, ref_l = tiny_open_clip(), tiny_llama()
    model = build_fusion_model(ref_v, ref_l, joint_attention=True)
    visual, llama = export_open_clip_visual(model), export_llama(model)
    for exported, original in ((visual, ref_v.state_dict()), (llama, ref_l.state_dict())):
        assert set(exported) == set(original)
        for key, value in original.items():
            assert torch.equal(exported[key], value), key
    save_llama_pretrained(model, model.config.language, tmp_path / "llama")
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "llama"), local_files_only=True)
    for key, value in ref_l.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    again = build_fusion_model(ref_v, tmp_path / "llama")
    for key, value in export_llama(again).items():
        assert torch.equal(value, llama[key]), key


def test_pipeline_blocks_cover_every_parameter_once() -> None:
    model = build_fusion_model(tiny_open_clip(), tiny_llama(), joint_attention=True).eval()
    blocks = model.pipeline_blocks()
    kinds = [b.kind for b in blocks]
    assert kinds == sorted(kinds, key=["vision", "aligner", "language", "head"].index)
    names = [n for m in model.block_parameter_names(blocks) for n in m.values()]
    expected = {n for n, _ in model.named_parameters()}
    assert sorted(names) == sorted(expected)
    images, ids = torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 5))
    state: tuple = model.pipeline_inputs(images, ids)
    for block in blocks:
        state = block(*state)
    torch.testing.assert_close(state[0], model(images, ids).logits, atol=0, rtol=0)


def test_freeze_policy_and_config_errors() -> None:
    model = build_fusion_model(tiny_open_clip(), tiny_llama(num_hidden_layers=3))
    freeze_for_finetuning(model, train_decoder_layers=2)
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "projector",
        "adapters",
        "language",
        "image_head",
        "text_head",
        "logit_scale",
    }
    assert not any(p.requires_grad for p in model.language.layers[2].parameters())
    with pytest.raises(
        ValueError, match=r"VisionConfig.width \(30\) must be divisible by heads \(4\)"
    ):
        VisionConfig(width=30, heads=4)
    assert isinstance(model, FusionModel)


def tiny_fusion(vocab_size: int = 16) -> FusionModel:
    """ViT 8x8 px / 4 px patches (N = 4 patches, 5 tokens), width 8, FFN 16; adapter width 8,
    FFN 12; LLaMA D = 8, FFN 12, 2 query heads / 1 kv head of 4 (q 8, k/v 4), joint attention
    (the ``hand`` preset of :func:`tests.builders.tiny_fusion_model`)."""
    return tiny_fusion_model("hand", language__vocab_size=vocab_size)


def test_block_costs_match_a_hand_count() -> None:
    """N = 4 patch tokens (5 ViT tokens), T = 3 text tokens, fp32 (4 bytes)."""
    model = tiny_fusion()
    blocks = {type(b).__name__: b for b in model.pipeline_blocks()}
    # ViT block, V = 5 tokens of width 8, FFN 16. FLOPs: 2*rows*in*out per product, x3 trained.
    #   qkv 2*5*8*24*3 = 5760, attention (q k^T and p v, 2*5*5*8 each) 3*2*400 = 2400,
    #   out 2*5*8*8*3 = 1920, fc 2*5*8*16*3 = 3840, proj 2*5*16*8*3 = 3840      -> 17760
    # kept: ln_1 40, qkv in 40, q/k/v/out 160, out in 40, ln_2 40, fc in 40, GELU 80,
    #   proj in 80                                                            -> 520 * 4 bytes
    vit = blocks["VisionLayer"].cost(4, 3)
    assert vit == BlockCost(flops=17760, activation_bytes=520 * 4)
    model.vision.requires_grad_(False)  # frozen: x2, no product inputs kept
    frozen = blocks["VisionLayer"].cost(4, 3)
    assert frozen == BlockCost(flops=3840 + 2400 + 1280 + 2560 + 2560, activation_bytes=320 * 4)
    # Decoder layer, D = 8, q 8, k/v 4, FFN 12, T = 3; fused stream with joint attention over
    #   N = 4 image tokens: q 1152, k 576, v 576, image k 768, image v 768,
    #   attention 3*2*(2*3*7*8) = 2016, o 1152, gate/up/down 1728 each       -> 12192
    #   kept: norm 24, q/k/v in 72, image norm 32, image k/v in 64, q/k/v/out (6+14)*8 = 160,
    #   o in 24, post norm 24, gate/up in 48, SiLU + up 72, down in 36        -> 556
    # text-only stream: the same without image tokens, attention 3*2*(2*3*3*8) = 864 -> 9504
    #   kept: 24 + 72 + (6+6)*8 + 24 + 24 + 48 + 72 + 36                       -> 396
    decoder = blocks["DecoderLayer"].cost(4, 3)
    assert decoder == BlockCost(flops=12192 + 9504, activation_bytes=(556 + 396) * 4)
    # Head: norm of h and ht kept (2*3*8), lm_head 2*3*8*16*3 = 2304 (keeps 24), image head
    #   2*6*4*3 = 144 (keeps 6), text head 2*8*4*3 = 192 (keeps 8), EMA heads forward 48 + 64
    head = blocks["Head"].cost(4, 3, bytes_per_element=2)
    assert head == BlockCost(flops=2304 + 144 + 192 + 48 + 64, activation_bytes=(48 + 38) * 2)


def test_block_kinds_and_costs_are_sane() -> None:
    model = tiny_fusion()
    blocks = model.pipeline_blocks()
    assert [b.kind for b in blocks] == [
        "vision",
        "vision",
        "vision",
        "aligner",
        "aligner",
        "language",
        "head",
    ]
    costs = [b.cost(4, 3) for b in blocks]
    assert all(c.flops > 0 and c.activation_bytes > 0 for c in costs)
    longer = [b.cost(4, 6) for b in blocks]
    for block, short, long in zip(blocks, costs, longer, strict=True):
        if block.kind == "vision":
            assert long == short  # the ViT does not see the text
        elif block.kind in ("language", "head"):
            assert long.flops > short.flops and long.activation_bytes > short.activation_bytes
    freeze_for_finetuning(model, train_decoder_layers=0)
    frozen = [b.cost(4, 3) for b in blocks]
    for block, trained, cut in zip(blocks, costs, frozen, strict=True):
        assert cut.flops <= trained.flops and cut.activation_bytes <= trained.activation_bytes
        if block.kind in ("vision", "language"):
            assert cut.flops < trained.flops  # no weight gradients
    assert sum(c.flops for c in costs) == pytest.approx(
        sum(b.cost(4, 3).flops for b in tiny_fusion().pipeline_blocks())
    )


def test_forward_runs_the_blocks_and_every_stream() -> None:
    model = tiny_fusion()
    images, ids = torch.randn(3, 3, 8, 8), torch.randint(0, 16, (3, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    prompts, prompt_mask = torch.randint(0, 16, (5, 4)), torch.ones(5, 4, dtype=torch.long)
    out = model(images, ids, mask, prompts, prompt_mask)
    assert out.logits.shape == (3, 4, 16) and out.logit_scale.shape == (3,)
    assert out.class_features.shape == (5, 4) and not out.class_features.any()  # training
    torch.testing.assert_close(out.momentum_image, out.image_features.detach())  # fresh copies
    torch.testing.assert_close(out.momentum_text, out.text_features.detach())
    model.eval()
    assert not any(b.training for b in model.pipeline_blocks())
    state: tuple = model.pipeline_inputs(images, ids, mask, prompts, prompt_mask)
    for block in model.pipeline_blocks():
        state = block(*state)
    evaluated = model(images, ids, mask, prompts, prompt_mask)
    for got, want in zip(state, evaluated, strict=True):
        assert torch.equal(got, want)
    # class prompts go through the text-only stream: prompt k equals a caption of the same ids
    as_captions = model(images[:1].expand(5, -1, -1, -1), prompts, prompt_mask)
    torch.testing.assert_close(evaluated.class_features, as_captions.text_features)
    torch.testing.assert_close(evaluated.logit_scale, torch.full((3,), 1 / 0.07))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(200.0))
    scale = model(images, ids).logit_scale  # exp(t): the parameter is clamped, not the output
    torch.testing.assert_close(scale, torch.full((3,), 200.0))
    model.after_optimizer_step()  # CLIP / open_clip: t.clamp_(0, ln 100) after the step
    torch.testing.assert_close(model(images, ids).logit_scale, torch.full((3,), 100.0))


def test_logit_scale_has_a_gradient_at_its_cap() -> None:
    """At the cap the scale keeps its gradient, so the data can bring it back down (issue 9,
    item 4: ``min(exp(t), 100)`` gave exactly zero there)."""
    model = tiny_fusion()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    out = model(torch.randn(3, 3, 8, 8), torch.randint(0, 16, (3, 4)))
    out.logit_scale.sum().backward()
    assert model.logit_scale.grad is not None
    torch.testing.assert_close(model.logit_scale.grad, torch.tensor(300.0))


def test_spatial_merge_folds_each_neighbourhood_into_one_token() -> None:
    """``spatial_merge=2``: a 4 x 4 grid's 16 patch tokens become 4 tokens of 4 x the width,
    each the row-major concatenation of one 2 x 2 neighbourhood (Qwen2-VL's merger); the
    projector reads the merged width; a merge that does not divide the grid is refused."""
    from lightning_mmpar.models.fusion import FusionConfig
    from lightning_mmpar.models.vision import merge_tokens

    grid = torch.arange(16.0).reshape(1, 16, 1)  # patch (r, c) holds 4 r + c
    merged = merge_tokens(grid, 2)
    assert merged.shape == (1, 4, 4)
    assert merged[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    config = VisionConfig(image_size=16, patch_size=4, width=8, layers=1, heads=2, output_dim=8)
    merging = VisionConfig(**{**vars(config), "spatial_merge": 2})
    assert (config.tokens, merging.tokens, merging.token_width) == (16, 4, 32)
    tower = VisionTower(merging)
    pooled, tokens = tower(torch.randn(3, 3, 16, 16))
    assert pooled.shape == (3, 8) and tokens.shape == (3, 4, 32)
    language = LanguageConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = FusionModel(FusionConfig(vision=merging, language=language))
    assert model.projector.in_features == 32
    with pytest.raises(ValueError, match="spatial_merge"):
        VisionConfig(**{**vars(config), "spatial_merge": 3})
