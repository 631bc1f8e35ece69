"""Tensor-parallel fusion model vs the unsharded model, in real gloo worlds (TP=2 and TP=4).

One world per size runs every variant (vision tp / replicate / dp, all-reduce / all-gather combine,
sequence parallel on / off, joint attention with a learnable temperature, activation
checkpointing after TP) and compares the loss, the logits, both feature sets and the gradient of
every parameter with the single-process model.
Both worlds check that ``get_model_state_dict`` holds canonical (TP-size-independent) DTensors;
the 4-rank world also saves DCP checkpoints at tp2 (on a dp2 x tp2 mesh) and tp4 and loads each
into the other layout and into an unsharded model.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from open_clip.transformer import VisionTransformer
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.convert import build_fusion_model, export_llama, export_open_clip_visual
from lightning_mmpar.models.fusion import FusionModel
from lightning_mmpar.parallel.data import partial_over_tp_parameters, sync_gradients
from lightning_mmpar.parallel.numerics import vocab_parallel_cross_entropy
from lightning_mmpar.parallel.tensor import full_gradients, full_state_dict
from lightning_mmpar.plans import checkpoint_activations
from lightning_mmpar.plans.fusion import apply_tensor_parallel, checkpoint_units
from lightning_mmpar.testing import spawn

pytestmark = pytest.mark.distributed

ATOL, RTOL = 1e-5, 1e-5
VARIANTS: list[dict[str, Any]] = [
    dict(vision_parallel="tp", sequence_parallel=False, vl_combine="all_reduce", joint=False),
    dict(vision_parallel="replicate", sequence_parallel=False, vl_combine="all_gather", joint=True),
    dict(vision_parallel="tp", sequence_parallel=True, vl_combine="all_gather", joint=True),
    dict(vision_parallel="replicate", sequence_parallel=True, vl_combine="all_reduce", joint=False),
    dict(
        vision_parallel="tp", sequence_parallel=True, vl_combine="all_reduce", joint=True, ac=True
    ),
    dict(  # images split over tp, ViT outputs gathered (tp2 only: the hooks do not depend on tp)
        vision_parallel="dp",
        sequence_parallel=True,
        vl_combine="all_gather",
        joint=True,
        ac=True,
        world=2,
    ),
]
B = 4  # images per batch: vision_parallel="dp" splits them over tp (2 or 4)


def towers() -> tuple[VisionTransformer, LlamaForCausalLM]:
    torch.manual_seed(0)
    visual = VisionTransformer(
        image_size=16, patch_size=4, width=32, layers=2, heads=4, mlp_ratio=2.0, output_dim=24
    )
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
    )
    return visual, llama


def build(joint: bool) -> FusionModel:
    visual, llama = towers()
    adapter = AdapterConfig(num_blocks=2, heads=4, width=16, ffn_width=24, dropout=0.0)
    options = dict(joint_attention=True, learnable_temperature=True) if joint else {}
    model = build_fusion_model(visual, llama, adapter=adapter, contrastive_dim=8, **options)
    for p in model.parameters():  # move gates, norms, temperatures off their constant inits
        p.data.add_(0.05 * torch.randn_like(p))
    return model


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly vocab-sharded) DTensor output (collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model: FusionModel, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Any]:
    images, ids, mask, labels, w_img, w_txt = batch
    out = model(images, ids, mask)
    loss = vocab_parallel_cross_entropy(out.logits, labels)
    loss = loss + (out.image_features * w_img).sum() + (out.text_features * w_txt).sum()
    loss = loss + out.logit_scale.mean() * 1e-3  # [B] copies of one scale (or a scalar)
    loss.backward()
    return loss, out


def max_diff(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")
    return float((a - b).detach().abs().max())


def check_variant(tp_mesh: Any, vl_group: Any, variant: dict[str, Any]) -> dict[str, float]:
    options = dict(variant)
    joint, ac = options.pop("joint"), options.pop("ac", False)
    options.pop("world", None)
    torch.manual_seed(1)
    ref = build(joint)
    model = apply_tensor_parallel(copy.deepcopy(ref), tp_mesh, vl_group=vl_group, **options)
    if ac:  # TP -> activation checkpointing, the plans' order: recomputation redoes collectives
        checkpoint_activations(model, checkpoint_units(model))
    rows: list[int] = []  # images each ViT block encodes on this rank
    for block in model.vision.transformer.resblocks:
        block.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    torch.manual_seed(2)
    labels = torch.randint(0, 64, (B, 8))
    labels[0, -2:] = -100
    mask = torch.ones(B, 8, dtype=torch.long)
    mask[0, -2:] = 0
    batch = (torch.randn(B, 3, 16, 16), torch.randint(0, 64, (B, 8)), mask, labels)
    batch += (torch.randn(B, 8), torch.randn(B, 8))
    ref_loss, ref_out = step(ref, batch)
    loss, out = step(model, batch)
    partial = partial_over_tp_parameters(model)
    tp = tp_mesh.size()
    if options["vision_parallel"] == "dp":  # the strategy's sum over tp of each rank's share
        sync_gradients(partial, tp_mesh.get_group(), "sum")
        stem = [model.vision.class_embedding, model.vision.positional_embedding]
        stem += [*model.vision.conv1.parameters(), *model.vision.ln_pre.parameters()]
        assert {id(p) for p in partial} == {
            id(p) for p in [*stem, *model.vision.transformer.resblocks.parameters()]
        }, "stem and ViT blocks partial over tp; ln_post and proj full"
    assert rows == [B // tp if options["vision_parallel"] == "dp" else B] * len(rows), rows
    assert options["vision_parallel"] == "dp" or not partial
    diffs = {"loss": max_diff(loss, ref_loss, "loss")}
    diffs["logits"] = max_diff(gathered(out.logits), ref_out.logits, "logits")
    diffs["features"] = max(
        max_diff(out.image_features, ref_out.image_features, "image features"),
        max_diff(out.text_features, ref_out.text_features, "text features"),
    )
    grads, ref_grads = full_gradients(model), dict(ref.named_parameters())
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    diffs["grads"] = max(max_diff(g, ref_grads[n].grad, n) for n, g in grads.items())
    q = model.adapters[0].attn.q_proj.weight
    assert q.device_mesh.get_group() is vl_group, "cross-attention must run on the vl group"
    assert q.to_local().shape[0] == 16 // tp_mesh.size()
    return diffs


def check_export(tp_mesh: Any) -> None:
    visual, llama = towers()
    model = apply_tensor_parallel(build_fusion_model(visual, llama), tp_mesh)
    weight = model.get_submodule("vision.transformer.resblocks.0.attn.in_proj").weight
    assert isinstance(weight, DTensor) and weight.to_local().shape == (3, 32 // tp_mesh.size(), 32)
    state = full_state_dict(model)
    for exported, original in (
        (export_open_clip_visual(state), visual.state_dict()),
        (export_llama(state), llama.state_dict()),
    ):
        assert set(exported) == set(original)
        for key, value in original.items():
            assert torch.equal(exported[key], value), f"{key} changed in the round trip"


def check_canonical_state_dict(tp_mesh: DeviceMesh) -> None:
    """The DCP view of a TP model is the unsharded model's, whatever the TP size."""
    torch.manual_seed(1)
    ref = build(False)
    model = apply_tensor_parallel(copy.deepcopy(ref), tp_mesh)
    state, ref_state = get_model_state_dict(model), ref.state_dict()
    for i in range(len(ref.vision.transformer.resblocks)):
        for suffix in ("weight", "bias"):
            key = f"vision.transformer.resblocks.{i}.attn.in_proj_{suffix}"
            value = state[key]
            assert isinstance(value, DTensor) and value.placements == (Shard(1),), key
            assert torch.equal(value.full_tensor(), ref_state[key]), key
    for key, value in full_state_dict(model).items():
        assert torch.equal(value, ref_state[key]), key


def forward(model: FusionModel, batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(*batch)
    return [gathered(out.logits), out.image_features, out.text_features]


def load_checkpoint(model: FusionModel, path: str) -> FusionModel:
    state = {"m": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["m"])
    return model


def check_checkpoint_reshards(rank: int) -> dict[str, float]:
    """Save at tp2 (dp2 x tp2 mesh) and tp4, load each into the other and into a plain model."""
    where = [tempfile.mkdtemp(prefix="mmpar-tp-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    meshes = {
        2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"],
        4: init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
    }
    torch.manual_seed(1)
    ref = build(True)
    torch.manual_seed(3)
    other = build(True)  # different weights, overwritten by every load
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 64, (2, 8)))
    ref_state, ref_out = ref.state_dict(), forward(ref, batch)
    worst = 0.0
    try:
        for src, dst in ((2, 4), (4, 2)):
            path = f"{where[0]}/tp{src}"
            saved = apply_tensor_parallel(copy.deepcopy(ref), meshes[src])
            dcp.save({"m": get_model_state_dict(saved)}, checkpoint_id=path)
            loaded = apply_tensor_parallel(copy.deepcopy(other), meshes[dst])
            direct = apply_tensor_parallel(copy.deepcopy(ref), meshes[dst])
            load_checkpoint(loaded, path)
            plain = load_checkpoint(copy.deepcopy(other), path)
            for what, state in (("tp", full_state_dict(loaded)), ("plain", plain.state_dict())):
                assert set(state) == set(ref_state), what
                for key, value in ref_state.items():
                    assert torch.equal(state[key], value), f"tp{src} -> {what}{dst}: {key}"
            for got, same_layout, want in zip(
                forward(loaded, batch), forward(direct, batch), ref_out, strict=True
            ):
                assert torch.equal(got, same_layout), f"tp{src} -> tp{dst} forward"
                worst = max(worst, max_diff(got, want, f"tp{src} -> tp{dst} vs unsharded"))
            for got, want in zip(forward(plain, batch), ref_out, strict=True):
                assert torch.equal(got, want), f"tp{src} -> unsharded forward"
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(str(where[0]), ignore_errors=True)
    return {"checkpoint": worst}


def check_sequence_error(tp_mesh: Any) -> None:
    model = apply_tensor_parallel(build(False), tp_mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"text length \(7\) divisible by .* pad input_ids to 8"):
        model(torch.randn(1, 3, 16, 16), torch.randint(0, 64, (1, 7)))
    model = apply_tensor_parallel(build(False), tp_mesh, vision_parallel="dp")
    message = r"its size \(3\) must be divisible by tensor_parallel \(2\); .*\(e.g. 2: "
    with pytest.raises(ValueError, match=message):
        model(torch.randn(3, 3, 16, 16), torch.randint(0, 64, (3, 8)))


def tp_world(rank: int, world: int) -> list[dict[str, float]]:
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    vl_group, _ = dist.new_subgroups_by_enumeration([list(range(world))])
    results = [
        check_variant(tp_mesh, vl_group, v) for v in VARIANTS if v.get("world", world) == world
    ]
    check_export(tp_mesh)
    check_canonical_state_dict(tp_mesh)
    if world == 2:
        check_sequence_error(tp_mesh)
    if world == 4:
        results.append(check_checkpoint_reshards(rank))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_unsharded(world: int) -> None:
    results = spawn(tp_world, world)
    worst = {k: max(r[k] for rank in results for r in rank if k in r) for k in results[0][0]}
    if world == 4:
        worst["checkpoint"] = max(rank[-1]["checkpoint"] for rank in results)
    print(f"tp={world} worst |diff|: {worst}")
    assert all(v <= ATOL for v in worst.values())
