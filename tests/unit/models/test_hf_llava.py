"""transformers' LLaVA through the package's blocks (issue 29): loading, logits parity with
``LlavaForConditionalGeneration`` at one process (unpacked and packed ragged batches mixing
text-only, one-image and two-image samples), refused config values, lossless export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_mmpar.data import MultimodalCollator
from lightning_mmpar.models import FusionModel
from lightning_mmpar.models.hf import FAMILIES, from_hf, hf_fusion_config, save_hf
from tests.builders import LLAVA_IMAGE_TOKEN, llava_samples, tiny_llava_dir

RTOL = 1e-5
VARIANTS = {
    # LLaVA-1.5's choices: feature layer -2, class token dropped, quick_gelu ViT, gelu projector
    "llava-1.5": {},
    # the other branches: every ViT layer, class token kept, gelu ViT, tanh-gelu projector,
    # tied embeddings, a projector without biases
    "full, tied": {
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "vision__hidden_act": "gelu",
        "projector_hidden_act": "gelu_pytorch_tanh",
        "multimodal_projector_bias": False,
        "tie_word_embeddings": True,
        "text__tie_word_embeddings": True,
    },
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: Any, tmp_path_factory: Any) -> Path:
    return tiny_llava_dir(tmp_path_factory.mktemp("llava"), **VARIANTS[request.param])


def _oracle(path: Path) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(str(path), local_files_only=True).eval()


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _check_rows(model: FusionModel, oracle: Any, samples: list[Any], pack: bool) -> float:
    """Our logits on the collated batch against transformers' per sample (its own format:
    each marker expanded to the image's tokens, ``pixel_values [n_img, 3, H, W]``)."""
    n = model.config.vision.tokens
    collate = MultimodalCollator(
        max_tokens=64, image_token_id=LLAVA_IMAGE_TOKEN, image_seq_length=n, pack=pack
    )
    batch = collate(samples)
    worst, seen = 0.0, set()
    with torch.no_grad():
        logits = model.forward_ragged(batch).logits
        for row in range(batch["input_ids"].shape[0]):
            for sid in range(int(batch["sample_ids"][row].max()) + 1):
                where = batch["sample_ids"][row] == sid
                ids = batch["input_ids"][row][where]
                index = _which(samples, ids, n)
                pixels = samples[index]["pixel_values"]
                want = oracle(input_ids=ids[None], pixel_values=pixels if len(pixels) else None)
                worst = max(worst, _rel(logits[row][where], want.logits[0]))
                seen.add(index)
    assert seen == set(range(len(samples)))
    return worst


def _which(samples: list[Any], ids: Tensor, n: int) -> int:
    """The sample whose ids, each marker expanded to ``n`` image tokens, are ``ids``."""
    for i, s in enumerate(samples):
        expanded = torch.cat([x.repeat(n if x == LLAVA_IMAGE_TOKEN else 1) for x in s["input_ids"]])
        if torch.equal(expanded, ids):
            return i
    raise AssertionError("a packed segment matches no sample")


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_logits_match_transformers(checkpoint: Path, pack: bool) -> None:
    model, oracle = from_hf(checkpoint).eval(), _oracle(checkpoint)
    samples = llava_samples((0, 1, 2, 1, 0))
    worst = _check_rows(model, oracle, samples, pack)
    print(f"llava logits vs transformers ({'packed' if pack else 'unpacked'}): {worst:.1e}")
    assert worst <= RTOL


def test_config_maps_the_math(checkpoint: Path) -> None:
    cfg = hf_fusion_config(checkpoint)
    full = cfg.vision.keep_class_token
    assert cfg.vision.layers == (3 if full else 2)  # -1: every layer; -2: one dropped
    assert cfg.vision.tokens == 16 + full and cfg.vision.act == ("gelu" if full else "quick_gelu")
    assert (cfg.fusion, cfg.image_token_id, cfg.adapter.num_blocks) == ("spliced", 63, 0)
    assert cfg.language.rope_theta == 5000.0 and cfg.language.num_key_value_heads == 2
    assert cfg.projector == "mlp2x" and cfg.projector_bias is not full


def test_export_is_lossless(checkpoint: Path, tmp_path: Path) -> None:
    """Exported weights load into transformers bit-identical to the original, the ViT layers
    the model never runs included; a trained (changed) model exports its own values."""
    model = from_hf(checkpoint)
    save_hf(model, checkpoint, tmp_path / "same")
    want = _oracle(checkpoint).state_dict()
    got = _oracle(tmp_path / "same").state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "same" / "preprocessor_config.json").is_file()
    with torch.no_grad():
        model.language.lm_head.weight.add_(1.0)
        model.vision.transformer.resblocks[0].attn.in_proj.weight[1].add_(1.0)  # the k rows
    save_hf(model, checkpoint, tmp_path / "trained")
    got = _oracle(tmp_path / "trained").state_dict()
    key = "model.vision_tower.encoder.layers.0.self_attn."
    assert torch.equal(got[key + "k_proj.weight"], want[key + "k_proj.weight"] + 1.0)
    assert torch.equal(got[key + "q_proj.weight"], want[key + "q_proj.weight"])
    assert torch.equal(got["lm_head.weight"], model.language.lm_head.weight)
    assert torch.equal(
        got["model.language_model.embed_tokens.weight"],
        want["model.language_model.embed_tokens.weight"],
    )


REFUSED = [
    ({"text__rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "text_config.rope_"),
    ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
    ({"vision_feature_layer": -14}, "vision_feature_layer"),
    ({"projector_hidden_act": "tanh"}, "projector_hidden_act"),
    ({"vision__layer_norm_eps": 1e-6}, "vision_config.layer_norm_eps"),
    ({"vision__hidden_act": "relu"}, "vision_config.hidden_act"),
    ({"text__attention_dropout": 0.1}, "text_config.attention_dropout"),
    ({"text__hidden_act": "gelu"}, "text_config.hidden_act"),
]


@pytest.mark.parametrize(("changes", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_config_values_are_refused(
    changes: dict[str, Any], field: str, tmp_path: Path
) -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    changes = dict(changes)
    sub: dict[str, dict[str, Any]] = {"vision": {}, "text": {}}
    for key in [k for k in changes if "__" in k]:
        part, name = key.split("__")
        sub[part][name] = changes.pop(key)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**sub["vision"]),
        text_config=LlamaConfig(**sub["text"]),
        **changes,
    )
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=field):
        hf_fusion_config(tmp_path)


def test_unknown_model_type_names_the_supported_ones(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"'llama' is not supported; supported: \['llava'"):
        from_hf(tmp_path)
    assert "llava" in FAMILIES


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "idefics2"}, r"model_type 'idefics2' is not supported; supported: \["),
        (
            {"model_type": "qwen2vl"},
            r"'qwen2vl' is not supported; supported: \['llava', 'qwen2_5_vl'",
        ),
        ({"architectures": ["X"]}, r"has no 'model_type' key; a string such as 'llava'"),
        ({"model_type": 3}, r"has 'model_type' 3; a string such as 'llava'"),
        (["llava"], r"holds a JSON list, not an object"),
        (None, r"has no config.json: pass a directory"),
    ],
    ids=["idefics2", "typo", "no model_type", "model_type 3", "a list", "no config.json"],
)
def test_unsupported_model_type_is_refused_before_transformers(
    config: dict[str, Any] | None, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_hf`` / ``save_hf`` / ``hf_fusion_config`` read ``model_type`` from the raw JSON
    and refuse it naming the path and the supported types, before transformers' ``AutoConfig``
    (which would raise its own error, or load an unsupported config) is asked."""
    import json

    from transformers import AutoConfig

    def asked(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transformers was asked before the model_type check")

    monkeypatch.setattr(AutoConfig, "from_pretrained", asked)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    for call in (from_hf, hf_fusion_config, lambda p: save_hf({}, p, p / "out")):
        with pytest.raises(ValueError, match=expected) as err:
            call(tmp_path)
        assert str(tmp_path) in str(err.value)


def test_a_config_file_instead_of_its_directory_names_the_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    with pytest.raises(ValueError, match=rf"has no config.json: pass its directory, '{tmp_path}'"):
        from_hf(tmp_path / "config.json")


def test_recipe_cli_refuses_an_unsupported_checkpoint_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model.pretrained.hf`` of a directory whose model_type the package does not load: the
    recipe CLI's one-line set-up error (exit 2) names it, before any link reads the directory
    (before: the image-size check or transformers' own error spoke first)."""
    from lightning_mmpar.recipes.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "qwen_sft_cpu.yaml"
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(recipe), "--model.pretrained.hf", str(tmp_path)])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'bert' is not supported" in err[0], err


def test_image_processor_is_read_from_the_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    """``data.preprocess.from_pretrained`` of a LLaVA directory (what ``model.pretrained.hf``
    links) reads its ``CLIPImageProcessor``: size, mean, std, bicubic; a crop smaller than the
    resized side (which open_clip's transform does not reproduce) is refused."""
    import json

    from jsonargparse import Namespace
    from transformers import CLIPImageProcessor

    from lightning_mmpar.data.transforms import ImagePreprocess
    from lightning_mmpar.recipes.cli import link_vision_preprocess

    cfg = ImagePreprocess(from_pretrained=str(checkpoint)).resolve(16)
    processor = CLIPImageProcessor.from_pretrained(str(checkpoint), local_files_only=True)
    assert tuple(cfg.mean) == tuple(processor.image_mean) != (0.5,) * 3
    assert tuple(cfg.std) == tuple(processor.image_std)
    assert (cfg.size, cfg.interpolation, cfg.resize_mode) == (16, "bicubic", "shortest")
    with pytest.raises(ValueError, match="16-pixel images but image_size is 32"):
        ImagePreprocess(from_pretrained=str(checkpoint)).resolve(32)
    config = json.loads((checkpoint / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, "crop_size": 12}))
    with pytest.raises(ValueError, match=r"size\.shortest_edge = 16 is not supported"):
        ImagePreprocess(from_pretrained=str(tmp_path)).resolve(12)
    parsed = Namespace(
        model=Namespace(pretrained=Namespace(vision=None, hf=str(checkpoint))),
        data=Namespace(init_args=Namespace(preprocess=None)),
    )
    assert link_vision_preprocess(parsed) == str(checkpoint)


def test_recipe_option_model_pretrained_hf(checkpoint: Path, tmp_path: Path) -> None:
    """``--model.pretrained.hf <dir>``: the recipe's model takes the checkpoint's architecture
    (its YAML sizes replaced), the data its image processor; ``hf`` excludes the towers'
    own options."""
    import json

    from lightning.pytorch import LightningDataModule
    from PIL import Image

    from lightning_mmpar.recipes.cli import ClipLlamaCLI
    from lightning_mmpar.recipes.module import ClipLlamaModule
    from lightning_mmpar.recipes.options import PretrainedConfig

    Image.new("RGB", (16, 16), (40, 90, 200)).save(tmp_path / "0.png")
    (tmp_path / "train.jsonl").write_text(json.dumps({"filepath": "0.png", "title": "a"}) + "\n")
    data = "lightning_mmpar.data.captions.CaptionsDataModule"
    cli = ClipLlamaCLI(
        ClipLlamaModule,
        LightningDataModule,
        subclass_mode_data=True,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.logger=false",
            f"--model.pretrained.hf={checkpoint}",
            "--model.fusion.vision.layers=7",
            f"--data={data}",
            f"--data.train_file={tmp_path / 'train.jsonl'}",
            "--data.image_size=16",
        ],
    )
    want = hf_fusion_config(checkpoint)
    got = cli.model.fusion_config
    assert (got.vision, got.language, got.projector) == (want.vision, want.language, "mlp2x")
    assert cli.datamodule.preprocess.from_pretrained == str(checkpoint)
    with pytest.raises(ValueError, match=r"model\.pretrained\.hf"):
        PretrainedConfig(hf=str(checkpoint), vision="/towers/clip")


def test_llava_15_7b_config_maps_without_weights(tmp_path: Path) -> None:
    """LLaVA-1.5-7B's config.json alone (CLIP ViT-L/14 at 336 px, Vicuna-7B): the ViT runs 23
    of its 24 layers, 576 tokens per image, and the decoder is Llama-7B's."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    )
    text = LlamaConfig(vocab_size=32064, max_position_embeddings=4096)
    LlavaConfig(vision_config=vision, text_config=text, image_token_index=32000).save_pretrained(
        str(tmp_path)
    )
    cfg = hf_fusion_config(tmp_path)
    assert (cfg.vision.layers, cfg.vision.tokens, cfg.vision.width) == (23, 576, 1024)
    assert (cfg.language.num_hidden_layers, cfg.language.hidden_size) == (32, 4096)
    assert (cfg.language.vocab_size, cfg.image_token_id) == (32064, 32000)


def test_incomplete_state_or_checkpoint_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    """Export of a state missing a tensor names it and writes nothing; a checkpoint missing
    one names it too."""
    from safetensors.torch import load_file, save_file

    state = from_hf(checkpoint).state_dict()
    del state["language.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        save_hf(state, checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["multi_modal_projector.linear_2.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model\.multi_modal_projector\.linear_2"):
        from_hf(broken)


def test_text_stream_off_keeps_logits_and_gradients(checkpoint: Path) -> None:
    """``FusionModel.text_stream = False`` (the recipe's caption-only objective on a dense
    decoder) skips the text-only stream: the same logits and caption-loss gradients, the
    decoder blocks' counted work halved; the recipe turns it off only without a contrastive
    or MML term."""
    from lightning_mmpar.losses.mml import MMLConfig
    from lightning_mmpar.models.blocks import DecoderLayer
    from lightning_mmpar.recipes.module import ClipLlamaModule
    from lightning_mmpar.recipes.options import LossConfig

    tokens = hf_fusion_config(checkpoint).vision.tokens
    batch = MultimodalCollator(
        max_tokens=80, image_token_id=LLAVA_IMAGE_TOKEN, image_seq_length=tokens, pack=True
    )(llava_samples((1, 0, 2)))
    grads, logits, flops = [], [], []
    for text_stream in (True, False):
        model = from_hf(checkpoint)
        model.text_stream = text_stream
        out = model.forward_ragged(batch).logits
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            out[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100
        )
        loss.backward()
        logits.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        decoder = [b for b in model.pipeline_blocks() if isinstance(b, DecoderLayer)]
        assert decoder and all(b.text_stream is text_stream for b in decoder)
        flops.append(sum(b.cost(16, 40).flops for b in decoder))
    assert torch.equal(logits[0], logits[1])
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][k], grads[1][k], rtol=1e-6, atol=1e-7) for k in grads[0])
    assert flops[1] * 2 == flops[0]
    caption_only = LossConfig(contrastive_weight=0.0, mml=MMLConfig(weight=0.0))
    module = ClipLlamaModule(loss=caption_only)
    assert not module.text_stream
    assert ClipLlamaModule(loss=LossConfig(mml=MMLConfig(weight=0.0))).text_stream
