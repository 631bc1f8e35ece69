"""Qwen3-VL-MoE through this package's blocks against transformers' own forward: a tiny model
built offline from ``Qwen3VLMoeConfig`` (DeepStack, interpolated position grid, q/k norms,
interleaved M-RoPE, top-2 of 4 experts, one dense layer); a batch with a text-only sample, a
one-image sample and a sample with two images of different resolutions; unpacked and packed
rows; logits, loss and gradients within 1e-5 relative; export refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mmpar.losses import caption_loss
from lightning_mmpar.models import save_hf
from lightning_mmpar.models.hf.qwen3_convert import (
    check_export,
    export_qwen3_moe_vl_state,
    qwen3_moe_vl_config,
    qwen3_moe_vl_from_hf,
    qwen3_moe_vl_from_transformers,
    save_qwen3_moe_vl_hf,
)
from lightning_mmpar.models.hf.qwen3_vl_moe import Qwen3MoeVLModel
from lightning_mmpar.models.moe import MoEFeedForward
from tests.unit.models import qwen3_moe_cases as mc
from tests.unit.models import qwen_vl_cases as qc

RTOL = 1e-5


@pytest.fixture(scope="module")
def pair() -> tuple[object, object]:
    hf = mc.hf_model()
    return hf, qwen3_moe_vl_from_transformers(hf).eval()


def test_blocks_are_moe_with_one_dense_layer(pair: tuple[object, object]) -> None:
    _, ours = pair
    kinds = [isinstance(x.mlp, MoEFeedForward) for x in ours.language.layers]  # type: ignore[attr-defined]
    assert kinds == [True, False, True]
    assert ours.moe_layers() == ("language.layers.0.mlp", "language.layers.2.mlp")  # type: ignore[attr-defined]


def test_positions_match_transformers_get_rope_index(pair: tuple[object, object]) -> None:
    hf, _ = pair
    inputs = qc.hf_inputs()
    want, _ = hf.model.get_rope_index(  # type: ignore[attr-defined]
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    got = qc.collate(pack=False)["position_ids"]
    mask = inputs["attention_mask"].bool()
    assert torch.equal(got.transpose(0, 1)[:, mask], want[:, mask])


@pytest.mark.parametrize("pack", [False, True], ids=["one sample per row", "packed rows"])
def test_logits_match_transformers(pair: tuple[object, object], pack: bool) -> None:
    hf, ours = pair
    want = mc.hf_logits(hf)
    batch = qc.collate(pack=pack)
    assert (batch["input_ids"].shape[0] < 3) == pack
    with torch.no_grad():
        got = ours(batch)  # type: ignore[operator]
    unpacked = qc.collate(pack=False)
    flat_got, flat_want = got[batch["sample_ids"] >= 0], want[unpacked["sample_ids"] >= 0]
    assert qc.relative(flat_got, flat_want) <= RTOL


def test_deepstack_and_position_grid_reach_the_logits(pair: tuple[object, object]) -> None:
    """The parity above is not blind to the Qwen3-VL parts: zeroing a DeepStack merger or the
    position grid changes the image samples' logits."""
    _, ours = pair
    batch = qc.collate(pack=False)
    with torch.no_grad():
        base = ours(batch)  # type: ignore[operator]
        for param in (
            ours.vision.deepstack_merger_list[1].mlp[2].weight,  # type: ignore[attr-defined]
            ours.vision.patch_embed.pos_embed.weight,  # type: ignore[attr-defined]
        ):
            saved = param.clone()
            param.zero_()
            changed = ours(batch)  # type: ignore[operator]
            param.copy_(saved)
            assert qc.relative(changed[1:], base[1:]) > 1e-3
            assert torch.equal(changed[0], base[0])  # the text-only row sees no image


def test_training_step_matches_transformers(pair: tuple[object, object]) -> None:
    """Loss and every gradient of one step (ours mapped to transformers' names: q/k/v and
    the experts' gate/up fused) within 1e-5 relative."""
    hf, ours = pair
    inputs, batch = qc.hf_inputs(), qc.collate(pack=False)
    hf.zero_grad()  # type: ignore[attr-defined]
    want = hf(**inputs, labels=batch["labels"]).loss  # type: ignore[operator]
    want.backward()
    ours.zero_grad()  # type: ignore[attr-defined]
    got = caption_loss(ours(batch), batch["labels"])  # type: ignore[operator]
    got.backward()
    assert abs(got.item() - want.item()) <= RTOL * abs(want.item())
    want_grads = {n: p.grad for n, p in hf.named_parameters()}  # type: ignore[attr-defined]
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}  # type: ignore[attr-defined]
    got_grads = export_qwen3_moe_vl_state(ours_grads, ours.config)  # type: ignore[attr-defined]
    assert got_grads.keys() == want_grads.keys()
    floor = 1e-6 * max(float(g.abs().max()) for g in want_grads.values())
    worst = max(
        float((got_grads[n] - g).abs().max()) / max(float(g.abs().max()), floor)
        for n, g in want_grads.items()
    )
    assert worst <= RTOL, worst


def test_export_gives_back_transformers_state_dict(pair: tuple[object, object]) -> None:
    hf, ours = pair
    exported = export_qwen3_moe_vl_state(ours.state_dict(), ours.config)  # type: ignore[attr-defined]
    original = hf.state_dict()  # type: ignore[attr-defined]
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        (
            "rope_type",
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
        ),
        ("attention_dropout", {"attention_dropout": 0.1}),
        ("hidden_act", {"hidden_act": "gelu"}),
        ("output_router_logits", {"output_router_logits": True}),
        ("norm_topk_prob", {"norm_topk_prob": False}),
        ("num_experts", {"num_experts": 0}),
    ],
)
def test_unsupported_text_config_values_are_refused(field: str, change: dict[str, object]) -> None:
    config = mc.hf_config()
    for key, value in change.items():
        setattr(config.text_config, key, value)
    with pytest.raises(ValueError, match=field):
        qwen3_moe_vl_config(config)


def test_unsupported_vision_values_are_refused() -> None:
    config = mc.hf_config()
    config.vision_config.hidden_act = "relu"
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act"):
        qwen3_moe_vl_config(config)
    config = mc.hf_config()
    config.vision_config.deepstack_visual_indexes = [0, 5]
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes"):
        qwen3_moe_vl_config(config)


def test_export_check_refuses_one_ep_ranks_experts_and_missing_tensors(
    pair: tuple[object, object],
) -> None:
    """An expert tensor holding one ep rank's block ([E / 2, ...]) or a layer's experts left
    out is refused with the tensor names and the byte totals (Megatron-Bridge #2300)."""
    hf, ours = pair
    expected = {k: (v.shape, v.dtype) for k, v in hf.state_dict().items()}  # type: ignore[attr-defined]
    full = export_qwen3_moe_vl_state(ours.state_dict(), ours.config)  # type: ignore[attr-defined]
    total = check_export(full, expected)
    assert total == sum(v.numel() * v.element_size() for v in full.values())
    key = "model.language_model.layers.2.mlp.experts.down_proj"
    short = {**full, key: full[key][: mc.EXPERTS // 2]}
    half = full[key].nbytes // 2
    with pytest.raises(ValueError, match=rf"{total - half} of {total} bytes.*{key} \[2, 64, 48\]"):
        check_export(short, expected)
    gone = {k: v for k, v in full.items() if ".layers.0.mlp.experts." not in k}
    with pytest.raises(ValueError, match=r"missing \[.*layers\.0\.mlp\.experts\.down_proj"):
        check_export(gone, expected)


def test_directory_round_trip_is_lossless(tmp_path: Path) -> None:
    """save_pretrained -> from_hf (the dispatcher) -> save_qwen3_moe_vl_hf -> from_pretrained:
    the same tensor names, shapes, bytes and values (every expert), and the same logits."""
    from lightning_mmpar.models import from_hf

    hf = mc.hf_model()
    hf.save_pretrained(tmp_path / "original")
    (tmp_path / "original" / "tokenizer_config.json").write_text("{}")
    ours = from_hf(tmp_path / "original").eval()
    assert isinstance(ours, Qwen3MoeVLModel)
    batch = qc.collate(pack=False)
    keep = batch["sample_ids"] >= 0
    with torch.no_grad():
        assert qc.relative(ours(batch)[keep], mc.hf_logits(hf)[keep]) <= RTOL
    written = save_qwen3_moe_vl_hf(ours, tmp_path / "original", tmp_path / "exported")
    save_hf(ours, tmp_path / "original", tmp_path / "dispatched")
    assert (tmp_path / "dispatched" / "config.json").is_file()
    back = type(hf).from_pretrained(tmp_path / "exported").eval()
    original, exported = hf.state_dict(), back.state_dict()
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
    assert sum(v.nbytes for v in written.values()) == sum(v.nbytes for v in original.values())
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert (tmp_path / "exported" / "tokenizer_config.json").is_file()
    assert torch.equal(mc.hf_logits(back), mc.hf_logits(hf))


def test_hub_layout_experts_are_read_transposed(pair: tuple[object, object]) -> None:
    """Hub checkpoints store ``gate_up_proj [E, D, 2F]`` / ``down_proj [E, F, D]``: read to the
    same weights as transformers' in-memory layout."""
    from lightning_mmpar.models.hf.qwen3_convert import import_qwen3_moe_vl_state

    hf, ours = pair
    state = dict(hf.state_dict())  # type: ignore[attr-defined]
    hub = {k: v.transpose(1, 2) if ".experts." in k else v for k, v in state.items()}
    a = import_qwen3_moe_vl_state(state, ours.config)  # type: ignore[attr-defined]
    b = import_qwen3_moe_vl_state(hub, ours.config)  # type: ignore[attr-defined]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("hub", [False, True], ids=["in-memory layout", "hub layout"])
def test_the_recipe_loader_reads_one_ranks_experts_only(
    pair: tuple[object, object], tmp_path: Path, hub: bool
) -> None:
    """The recipe's per-rank views of a directory (``transformers_qwen_vl``) give every tensor
    of :func:`import_qwen3_moe_vl_state`; a slice of experts ``1:3`` (an ep rank's) of
    ``w_gate`` / ``w_up`` / ``w_down`` reads exactly those experts' bytes, in either stored
    expert layout; the router reads as ``[1, E, D]``."""
    from safetensors.torch import save_file

    from lightning_mmpar.models.hf.qwen3_convert import import_qwen3_moe_vl_state
    from lightning_mmpar.recipes.pretrained_files import transformers_qwen_vl

    hf, ours = pair
    hf.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # type: ignore[attr-defined]
    if hub:
        state = {
            k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in state.items()
        }
    save_file(state, str(tmp_path / "model.safetensors"))
    want = import_qwen3_moe_vl_state(state, ours.config)  # type: ignore[attr-defined]
    files = transformers_qwen_vl(tmp_path)
    got = {f"{part}.{k}": f for part, f in files.items() for k in f.shapes}
    assert got.keys() == {k for k in want if not k.endswith(("expert_bias", "expert_mask"))}
    for key in got:
        assert got[key].shapes[key.partition(".")[2]] == tuple(want[key].shape), key
    layer = files["language"]
    for name in ("w_gate", "w_up", "w_down"):
        key = f"layers.0.mlp.experts.{name}"
        _, a, b = layer.shapes[key]
        before = layer.bytes_read
        part = layer.read(key, (slice(1, 3), slice(0, a), slice(0, b)))
        assert torch.equal(part, want[f"language.{key}"][1:3]), name
        assert layer.bytes_read - before == 2 * a * b * 4 == part.nbytes
    router = layer.read("layers.0.mlp.router_gate", (slice(0, 1), slice(1, 3), slice(0, 64)))
    assert torch.equal(router, want["language.layers.0.mlp.router_gate"][:, 1:3])


@pytest.mark.parametrize(
    ("name", "cut"),
    [("gate_up_proj", (4, 95, 64)), ("gate_up_proj", (3, 96, 64)), ("down_proj", (4, 64, 47))],
    ids=["gate_up_proj one row short", "gate_up_proj one expert short", "down_proj cut"],
)
def test_a_cut_expert_tensor_is_named_before_it_is_split(
    pair: tuple[object, object], tmp_path: Path, name: str, cut: tuple[int, ...]
) -> None:
    """A directory whose one expert tensor is cut (the others whole) is refused by ``from_hf``
    and by the recipe's per-rank views naming that tensor, its shape and the config's shapes,
    before it is split into ``w_gate`` / ``w_up`` (before: a truncated ``[4, 95, 64]`` was
    taken for the transposed layout and split into wrong halves, the views read short slices
    silently); an exported state whose ``w_gate`` alone is cut is refused naming both halves
    before they are fused (before: torch.cat's raw size mismatch)."""
    from safetensors.torch import save_file

    from lightning_mmpar.models import from_hf
    from lightning_mmpar.recipes.pretrained_files import transformers_qwen_vl

    hf, ours = pair
    hf.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # type: ignore[attr-defined]
    key = f"model.language_model.layers.2.mlp.experts.{name}"
    state[key] = state[key][tuple(slice(0, n) for n in cut)].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    whole = list(hf.state_dict()[key].shape)  # type: ignore[attr-defined]
    expected = rf"{key} has shape {list(cut)}; .* expects {whole}".replace("[", r"\[")
    with pytest.raises(ValueError, match=expected):
        from_hf(tmp_path)
    with pytest.raises(ValueError, match=expected):
        transformers_qwen_vl(tmp_path)
    gate = "language.layers.0.mlp.experts.w_gate"
    cut_gate = {**ours.state_dict(), gate: ours.state_dict()[gate][:2]}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=rf"{gate} has shape \[2, 64, 48\], .*w_up \[4, 64, 48\]"):
        save_qwen3_moe_vl_hf(cut_gate, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no config\.json"):
        qwen3_moe_vl_from_hf(tmp_path)


def test_interleaved_flag_is_accepted_and_unknown_rope_keys_refused() -> None:
    config = mc.hf_config()
    assert config.text_config.rope_parameters["mrope_interleaved"] is True
    qwen3_moe_vl_config(config)  # accepted: transformers always interleaves for Qwen3-VL
    config.text_config.rope_parameters["factor"] = 4.0
    with pytest.raises(ValueError, match=r"rope_parameters \['factor'\]"):
        qwen3_moe_vl_config(config)


def test_block_costs_grow_with_the_tokens_they_run_on(pair: tuple[object, object]) -> None:
    """The partitioner's per-block FLOPs: vision blocks scale with the image tokens (a
    DeepStack block costs more than a plain one), decoder layers and the head with the text,
    the bridge costs nothing."""
    _, ours = pair
    blocks = ours.pipeline_blocks()  # type: ignore[attr-defined]
    for block in blocks:
        base = block.cost(8, 16).flops
        more_images, more_text = block.cost(16, 16).flops, block.cost(8, 32).flops
        if block.kind == "vision":
            assert more_images > base > 0 and more_text == base
        elif block.kind == "aligner":
            assert base == more_images == more_text == 0
        else:
            assert more_text > base > 0 and more_images == base
    deep, plain = blocks[1].cost(8, 16).flops, blocks[3].cost(8, 16).flops  # ViT blocks 0, 2
    assert deep > plain


def test_the_fusion_path_refuses_a_qwen3_moe_directory_by_name(tmp_path: Path) -> None:
    from lightning_mmpar.models.hf import hf_fusion_config

    mc.hf_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'qwen3_vl_moe' is a Qwen-VL model"):
        hf_fusion_config(tmp_path)
