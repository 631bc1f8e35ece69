"""Bring your own towers: open_clip and transformers checkpoints loaded by the recipe.

Tiny towers written offline (``pretrained_worker.write_towers``) are loaded through
``ClipLlamaModule(pretrained=...)`` and compared with the libraries that wrote them: the fusion
model's ViT features equal open_clip's ``encode_image``, its language logits equal
``LlamaForCausalLM``'s. One 4-process world loads them at tp 2 x pp 2 and at dp 2 (FSDP) x tp 2:
every shard a rank holds equals its slice of the checkpoint tensor, a rank reads only its own
shards (bytes read = bytes of the tower parameters it holds after the pipeline cut; under FSDP
its dp shard of its tp slice, half of what tp2pp2's two stages read, gathered weights equal to
the checkpoint's), and the first two training steps' losses equal one process's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from lightning_mmpar.data.digits import DigitsCaptions
from lightning_mmpar.data.hf_tokenizer import HFTokenizer, load_tokenizer, tokenizer_from_dict
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.models.moe_routing import MoEConfig
from lightning_mmpar.recipes.optim import parameter_groups
from lightning_mmpar.recipes.options import OptimConfig, PretrainedConfig
from lightning_mmpar.recipes.pretrained import resolve_fusion_config
from lightning_mmpar.testing import spawn
from tests.recipes import pretrained_worker as pw
from tests.recipes import recipe_faults_worker as rw

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return pw.write_towers(tmp_path_factory.mktemp("towers"))


@pytest.fixture(scope="module")
def loaded(towers: dict[str, str]) -> Any:
    """The module configured at one process (no strategy), shard errors recorded."""
    digits = pw.data(towers)
    net = pw.module(towers, digits.vocab_size)
    net.full = pw.references(towers)
    net._trainer = SimpleNamespace()  # type: ignore[assignment]
    net.configure_model()
    return net


def test_towers_equal_open_clip_and_transformers(towers: dict[str, str], loaded: Any) -> None:
    import open_clip
    from transformers import LlamaForCausalLM

    clip = open_clip.create_model(f"local-dir:{towers['vision']}", load_weights=True).eval()
    llama = LlamaForCausalLM.from_pretrained(towers["language"], local_files_only=True).eval()
    model = loaded.fusion_model.eval()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(3, 3, 16, 16, generator=g)
    ids = torch.randint(0, pw.VOCAB, (2, 9), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model.vision(images)[0], clip.encode_image(images))
        torch.testing.assert_close(model.language(ids), llama(ids).logits, rtol=0, atol=1e-6)
    # the files' sizes replaced the YAML's defaults (224 px, 4096 wide, 32 layers)
    assert loaded.fusion_config.vision.layers == 2 and loaded.fusion_config.vision.width == 32
    lang = loaded.fusion_config.language
    assert (lang.hidden_size, lang.num_hidden_layers, lang.rms_norm_eps, lang.rope_theta) == (
        32,
        2,
        1e-5,
        500.0,
    )
    assert lang.joint_attention  # an option the checkpoint does not hold stays the YAML's
    report = loaded.load_report
    assert max(loaded.shard_errors.values()) == 0.0 and not report.placeholders
    assert sorted(report.fresh) == sorted(
        f"language.layers.{i}.{n}"
        for i in (0, 1)
        for n in ("image_norm.weight", "self_attn.temperature.temperature")
    )
    towers_bytes = sum(
        p.numel() * p.element_size()
        for t in (model.vision, model.language)
        for n, p in t.named_parameters()
        if "image_norm" not in n and "temperature" not in n
    )
    assert report.bytes_read == towers_bytes


def test_freezing_policy_and_learning_rate_per_tower(loaded: Any) -> None:
    model = loaded.fusion_model
    assert not any(p.requires_grad for p in model.vision.parameters())  # frozen ViT
    lang = model.language
    assert all(p.requires_grad for layer in lang.layers[:2] for p in layer.parameters())
    assert not any(
        p.requires_grad
        for m in (lang.embed_tokens, lang.norm, lang.lm_head)
        for p in m.parameters()
    )
    assert all(p.requires_grad for p in model.adapters.parameters())
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, lr_language=1e-4, lr_adapter=5e-3)
    groups = {g["name"]: g for g in parameter_groups(loaded, model, optim)}
    assert set(groups) == {"language", "language.no_decay", "adapter", "adapter.no_decay"}
    assert [groups[n]["lr"] for n in sorted(groups)] == [5e-3, 5e-3, 1e-4, 1e-4]
    assert groups["language"]["weight_decay"] == 0.1
    assert groups["language.no_decay"]["weight_decay"] == 0.0
    ids = {id(p) for g in groups.values() for p in g["params"]}
    trainable = {id(p) for p in loaded.parameters() if p.requires_grad}
    assert ids == trainable
    layer0 = lang.layers[0]
    assert any(p is layer0.input_layernorm.weight for p in groups["language.no_decay"]["params"])
    assert any(p is layer0.mlp.up_proj.weight for p in groups["language"]["params"])
    assert any(p is model.logit_scale for p in groups["adapter.no_decay"]["params"])
    with pytest.raises(ValueError, match=r"optim\.lr_vision"):
        OptimConfig(lr_vision=-1.0)


def test_vision_state_dict_file_and_errors(towers: dict[str, str], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    clip_state = load_file(str(Path(towers["vision"]) / "open_clip_model.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v for k, v in clip_state.items()}}, tmp_path / "c.pt")
    fusion = pw.module(towers, 8).fusion_config
    bare = resolve_fusion_config(
        dataclasses.replace(fusion, vision=rw.tiny_fusion().vision),
        PretrainedConfig(vision=str(tmp_path / "c.pt")),
    )  # no config in a state-dict file: the YAML's sizes stay, checked when loading
    assert bare.vision == rw.tiny_fusion().vision
    net = rw.SeededModule(fusion=bare, pretrained=PretrainedConfig(vision=str(tmp_path / "c.pt")))
    net._trainer = SimpleNamespace()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"has shape .* the model's parameter"):
        net.configure_model()  # the tiny recipe ViT has 1 layer of another width
    good = dataclasses.replace(bare, vision=pw.module(towers, 8).fusion_config.vision)
    net = rw.SeededModule(fusion=good, pretrained=PretrainedConfig(vision=str(tmp_path / "c.pt")))
    net._trainer = SimpleNamespace()  # type: ignore[assignment]
    net.configure_model()
    want = clip_state["visual.transformer.resblocks.1.attn.in_proj_weight"]
    got = net.fusion_model.vision.transformer.resblocks[1].attn.in_proj.weight
    assert torch.equal(got.flatten(0, 1), want)
    with pytest.raises(ValueError, match=r"model.pretrained.vision \('/nonexistent'\)"):
        resolve_fusion_config(fusion, PretrainedConfig(vision="/nonexistent"))
    moe = MoEConfig(num_experts=2, top_k=1, ffn_width=8, router_dim=4)
    with pytest.raises(ValueError, match=r"moe is set with model\.pretrained\.language"):
        resolve_fusion_config(
            dataclasses.replace(fusion, language=LanguageConfig(moe=moe)),
            PretrainedConfig(language=towers["language"]),
        )


def test_transformers_tokenizer_in_the_data(towers: dict[str, str]) -> None:
    tok = HFTokenizer(towers["language"])
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    ids = tok.encode("a handwritten 7")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5 and tok.unk_id not in ids
    assert tok.decode(ids) == "a handwritten 7"
    enc = tok(["a handwritten 7", "the digit seven written by hand"], max_length=6)
    assert enc["input_ids"][0].tolist() == [*ids, 0]
    assert enc["attention_mask"].tolist() == [[1] * 5 + [0], [1] * 6]
    assert enc["input_ids"][1, -1] == 2 and enc["target_ids"][0, -1] == -100
    digits = DigitsCaptions(image_size=16, tokenizer=towers["language"])
    prompts = digits.class_prompts()
    assert tok.decode(prompts["input_ids"][3].tolist()) == digits.prompt_template.format(
        name="three", digit=3
    )
    assert digits.vocab_size == len(tok.tokenizer)
    restored = tokenizer_from_dict(digits.state_dict()["tokenizer"])
    assert isinstance(restored, HFTokenizer) and restored.encode("seven") == tok.encode("seven")
    assert isinstance(load_tokenizer(towers["language"]), HFTokenizer)
    with pytest.raises(ValueError, match="not both"):
        DigitsCaptions(tokenizer=towers["language"], tokenizer_dir=towers["language"])


def test_four_processes_read_their_shards_and_train_like_one(towers: dict[str, str]) -> None:
    results = spawn(pw.world, 4, towers, timeout=600)
    digits = pw.data(towers)
    want = rw.fit(pw.module(towers, digits.vocab_size), rw.batches(digits, pw.STEPS)).losses
    full = pw.references(towers)
    full_bytes = sum(v.numel() * v.element_size() for v in full.values())
    for layout in ("tp2pp2", "dp2tp2", "pp2dp2"):
        read: set[str] = set()
        for r in results:
            out = r[layout]
            assert max(out["errors"].values()) == 0.0, (layout, r["rank"])
            assert out["trainable_vision"] == 0
            torch.testing.assert_close(out["losses"], want, rtol=1e-5, atol=0)
            read |= set(out["read"])
        assert read == pw_names(full), layout
    tp2pp2 = [r["tp2pp2"] for r in results]
    assert all(o["placeholders"] and o["stages"] is not None for o in tp2pp2)
    # a rank reads exactly what it holds after the cut (its stage, its tp slice) ...
    assert all(o["bytes_read"] == o["held"] - fresh_bytes(o) for o in tp2pp2)
    assert all(o["bytes_read"] < full_bytes / 2 for o in tp2pp2)
    # ... and under FSDP only its dp shard of its tp slice of both stages (read after sharding)
    for rank, r in enumerate(results):
        out, tp = r["dp2tp2"], rank % 2
        assert set(out["deferred"]) == set(out["read"]) - set(out["fresh"])
        slice_bytes = tp2pp2[tp]["bytes_read"] + tp2pp2[tp + 2]["bytes_read"]
        assert out["bytes_read"] <= slice_bytes / 2 + 1024  # uneven shards: dp rank 0 more
        assert 0 < out["bytes_read"] <= out["held"] <= out["bytes_read"] + fresh_bytes(out)
    # pp 2 x dp 2 (FSDP): a rank reads only its dp shard of its own stage's tensors, after the
    # cut and the sharding (stage = rank // 2; the two dp ranks of a stage read it once together)
    for stage in range(2):
        pair = [results[2 * stage + d]["pp2dp2"] for d in range(2)]
        assert all(o["stages"] is not None and o["deferred"] for o in pair), stage
        assert all(set(o["deferred"]) == set(o["read"]) - set(o["fresh"]) for o in pair)
        stage_reads = [set(o["read"]) for o in pair]
        assert stage_reads[0] == stage_reads[1], stage
        whole_stage = sum(o["bytes_read"] for o in pair)
        assert all(o["bytes_read"] <= whole_stage / 2 + 1024 for o in pair), stage
    assert not set(results[0]["pp2dp2"]["read"]) & set(results[2]["pp2dp2"]["read"])
    # together the 4 ranks read every checkpoint byte exactly once (no full copy anywhere)
    assert sum(r["pp2dp2"]["bytes_read"] for r in results) == full_bytes


def pw_names(full: dict[str, Any]) -> set[str]:
    """Parameter names of the checkpoint tensors (fused q/k/v under the module's name)."""
    return {
        k.replace("attn.in_proj_weight", "attn.in_proj.weight").replace(
            "attn.in_proj_bias", "attn.in_proj.bias"
        )
        for k in full
    }


def fresh_bytes(out: dict[str, Any]) -> int:
    """Bytes of the fresh joint-attention extras a rank holds (tp 2: not sharded, fp32)."""
    return sum(
        4 * (32 if n.endswith("image_norm.weight") else 2)
        for n in out["fresh"]
        if n not in out["placeholders"]
    )


def test_checkpoint_of_pretrained_towers_exports(
    towers: dict[str, str], loaded: Any, tmp_path: Path
) -> None:
    """A checkpoint of pretrained towers names the sizes the files gave (``hparams.fusion`` is
    the resolved config, not the YAML's defaults), so ``export`` rebuilds the model without the
    tower files' configs; the transformers tokenizer named by the data state is written back."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from lightning_mmpar.recipes.export import export_checkpoint

    assert loaded.hparams["fusion"] == loaded.fusion_config
    assert loaded.hparams["fusion"].vision.width == 32  # the YAML default is 768
    digits = pw.data(towers)
    ckpt = tmp_path / "last.ckpt"
    dcp.save({"state_dict": loaded.state_dict()}, checkpoint_id=ckpt, no_dist=True)
    meta = {"hyper_parameters": dict(loaded.hparams), "DigitsCaptions": digits.state_dict()}
    torch.save(meta, ckpt / "meta.pt")
    result = export_checkpoint(ckpt, tmp_path / "out", verify=True)
    assert max(result.diffs.values()) <= 1e-5, result.diffs
    assert {"llama", "tokenizer"} <= set(result.files), result.files
    llama = LlamaForCausalLM.from_pretrained(str(tmp_path / "out" / "llama"))
    assert llama.config.hidden_size == 32
    assert llama.config.vocab_size == len(HFTokenizer(towers["language"]).tokenizer)
    assert load_tokenizer(tmp_path / "out" / "tokenizer").encode("seven") == HFTokenizer(
        towers["language"]
    ).encode("seven")


@pytest.mark.parametrize("explicit", [None, {"mean": [0.1, 0.2, 0.3]}])
def test_pretrained_vision_sets_the_data_preprocessing(
    towers: dict[str, str], tmp_path: Path, explicit: dict[str, Any] | None
) -> None:
    """``model.pretrained.vision`` alone: a caption data module normalises images with the
    tower's ``preprocess_cfg`` (mean 0.5, std 0.25 here, not CLIP's); explicit fields win."""
    from lightning.pytorch import LightningDataModule
    from PIL import Image

    from lightning_mmpar.recipes.cli import ClipLlamaCLI
    from lightning_mmpar.recipes.module import ClipLlamaModule

    rows = []
    for i in range(4):
        Image.new("RGB", (16, 16), (40 * i, 90, 200)).save(tmp_path / f"{i}.png")
        rows.append(json.dumps({"filepath": f"{i}.png", "title": f"digit {i}"}) + "\n")
    (tmp_path / "train.jsonl").write_text("".join(rows))
    init = {"train_file": str(tmp_path / "train.jsonl"), "image_size": 16, "batch_size": 2}
    if explicit is not None:
        init["preprocess"] = explicit
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False},
        "model": {"pretrained": {"vision": towers["vision"]}},
        "data": {
            "class_path": "lightning_mmpar.data.captions.CaptionsDataModule",
            "init_args": init,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = ClipLlamaCLI(
        ClipLlamaModule,
        LightningDataModule,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(path)],
    )
    data = cli.datamodule
    assert data.preprocess.from_pretrained == towers["vision"]
    cfg = data.preprocess.resolve(16)
    want_mean = (0.5,) * 3 if explicit is None else (0.1, 0.2, 0.3)
    assert tuple(cfg.mean) == pytest.approx(want_mean) and tuple(cfg.std) == (0.25,) * 3
    image = Image.new("RGB", (16, 16), (255, 255, 255))
    pixels = data.transform(image)  # white: (1 - mean) / std
    assert pixels[:, 0, 0].tolist() == pytest.approx([(1 - m) / 0.25 for m in want_mean])


def test_link_vision_preprocess_on_parsed_configs() -> None:
    """The link on parsed configs: ``preprocess`` unset, a Namespace, or an ``ImagePreprocess``
    instance (a data module's own default) gets ``from_pretrained``; an explicit path, a data
    module without ``preprocess`` or no pretrained vision tower are left alone."""
    from jsonargparse import Namespace

    from lightning_mmpar.data.transforms import ImagePreprocess
    from lightning_mmpar.recipes.cli import link_vision_preprocess

    def cfg(preprocess: Any, vision: str | None = "/towers/clip") -> Namespace:
        init = (
            Namespace(batch_size=2) if preprocess == "absent" else Namespace(preprocess=preprocess)
        )
        return Namespace(
            model=Namespace(pretrained=Namespace(vision=vision)), data=Namespace(init_args=init)
        )

    for given in (
        None,
        Namespace(from_pretrained=None, mean=[0.1, 0.2, 0.3]),
        ImagePreprocess(mean=(0.1, 0.2, 0.3)),
    ):
        c = cfg(given)
        assert link_vision_preprocess(c) == "/towers/clip"
        pre = c.data.init_args.preprocess
        assert isinstance(pre, Namespace) and pre.from_pretrained == "/towers/clip"
        if given is not None:
            assert list(pre.mean) == [0.1, 0.2, 0.3]  # explicit fields kept
    explicit = cfg(Namespace(from_pretrained="/other"))
    assert link_vision_preprocess(explicit) is None
    assert explicit.data.init_args.preprocess.from_pretrained == "/other"
    assert link_vision_preprocess(cfg("absent")) is None
    assert link_vision_preprocess(cfg(None, vision=None)) is None
