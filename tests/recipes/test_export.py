"""``clip_llama export``: recipe checkpoints back to transformers, open_clip, safetensors and the
tokenizer's own form, against oracles nobody here wrote.

One 4-process gloo world trains the CPU recipe YAML (model shrunk) 2 steps at tp 2 x pp 2 and at
tp 2 x dp 2 (FSDP2) and writes ``last.ckpt`` for each (:mod:`export_worker`); each is exported
in this process, without a process group. The reference is the recipe's own module loaded from
the same checkpoint at one process (``instantiate_module`` from its hyper-parameters, as
``load_from_checkpoint`` builds it; ``dcp.load`` into its ``blocks.N.*`` state dict). Checks:
``LlamaForCausalLM.from_pretrained`` logits == the module's text-only language logits (true
vocabulary 39 of the 40 padded rows), open_clip's ``visual`` with the exported state dict ==
the module's image features, every adapter / head tensor equal, the tokenizer round trip.

Run with ``-s`` to print the measured round-trip differences (docs/checkpointing.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.cli import instantiate_module
from safetensors.torch import load_file

from lightning_mmpar.data.tokenizer import WordTokenizer
from lightning_mmpar.models.convert import export_llama, llama_config
from lightning_mmpar.recipes import clip_llama
from lightning_mmpar.recipes.export import export_checkpoint
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.testing import spawn
from tests.recipes import export_worker as ew

TOL = 1e-5  # measured: <= 4.8e-7 (logits), <= 3.6e-7 (features)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    results = spawn(ew.world, 4, str(root), timeout=900)
    assert [r["steps"] for r in results] == [dict.fromkeys(ew.LAYOUTS, ew.STEPS)] * 4
    return root


def reference(ckpt: Path) -> tuple[ClipLlamaModule, dict[str, Any]]:
    """The recipe module at one process with the checkpoint's weights, and ``meta.pt``."""
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    hparams = {k: v for k, v in meta["hyper_parameters"].items() if not k.startswith("_")}
    module = instantiate_module(ClipLlamaModule, hparams)
    module.configure_model()
    state = module.state_dict()
    dcp.load({"state_dict": state}, checkpoint_id=ckpt, no_dist=True)
    module.load_state_dict(state, strict=True)
    return module.eval(), meta


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(ew.LAYOUTS))
def test_export_matches_transformers_and_open_clip(
    checkpoints: Path, layout: str, tmp_path: Path
) -> None:
    ckpt, out = ew.checkpoint_dir(checkpoints, layout), tmp_path / "export"
    if layout == "tp2_pp2":  # the CLI path
        clip_llama.main(["export", "--ckpt", str(ckpt), "--out", str(out), "--verify"])
        manifest = json.loads((out / "export.json").read_text())
        diffs, vocab = manifest["max_abs_diff"], manifest["vocab_size"]
        assert manifest["padded_vocab_size"] == 40
    else:
        result = export_checkpoint(ckpt, out, verify=True)
        diffs, vocab = result.diffs, result.vocab_size
    module, meta = reference(ckpt)
    model = module.fusion_model
    assert vocab == module.vocab_size == 39 and model.language.lm_head.weight.shape[0] == 40
    assert diffs["llama_logits"] <= TOL and diffs["open_clip_features"] <= TOL, diffs
    assert diffs["adapter"] == 0.0 and diffs["heads"] == 0.0, diffs
    measured: dict[str, float] = {}

    # transformers: the true vocabulary, the text-only logits of our decoder
    from transformers import LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(str(out / "llama"), local_files_only=True).eval()
    assert llama.config.vocab_size == 39 and not llama.config.tie_word_embeddings
    tokenizer = WordTokenizer.from_dict(meta["RecipeDigitsCaptions"]["tokenizer"])
    ids = tokenizer(["a photo of the digit seven", "the number 3 drawn by hand"], 10)["input_ids"]
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([ids, torch.randint(0, 39, (2, 10), generator=g)])
    with torch.no_grad():
        ours = model.language(ids)
        measured["llama_logits"] = max_diff(llama(input_ids=ids).logits, ours[..., :39])
        # without folding the text temperature (0.7) into k_proj the logits differ
        unfolded = LlamaForCausalLM(llama_config(_language(model, 39)))
        unfolded.load_state_dict(export_llama(model, vocab_size=39), strict=True)
        assert max_diff(unfolded.eval()(input_ids=ids).logits, ours[..., :39]) > 1e-3
    assert measured["llama_logits"] <= TOL

    # open_clip: a CLIP from the exported config, the visual state dict loaded strictly
    import open_clip

    clip = open_clip.create_model(f"local-dir:{out / 'open_clip'}", load_weights=False)
    visual = clip.visual.eval()
    visual.load_state_dict(load_file(str(out / "open_clip_visual.safetensors")), strict=True)
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        measured["open_clip_features"] = max_diff(visual(images), model.vision(images)[0])
    assert measured["open_clip_features"] <= TOL

    # safetensors: adapter and heads equal the module's tensors, every tensor exported once
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state |= {f"momentum_heads.{k}": v for k, v in model.momentum_heads.state_dict().items()}
    adapter, heads = (load_file(str(out / f"{n}.safetensors")) for n in ("adapter", "heads"))
    assert {k.split(".")[0] for k in adapter} == {"projector", "adapters", "language"}
    assert {"logit_scale", "momentum_heads.image_head.weight"} <= set(heads)
    for key, value in {**adapter, **heads}.items():
        assert torch.equal(value, state[key]), key
    exported = {*adapter, *heads, *(f"vision.{k}" for k in visual.state_dict())}
    exported |= {f"language.{k.removeprefix('model.')}" for k in llama.state_dict()}
    assert exported == set(state), set(state) ^ exported

    # the tokenizer in its own saved form, the same ids as the checkpoint's
    saved = WordTokenizer.load(out / "tokenizer")
    assert saved.vocab == tokenizer.vocab and saved.vocab_size == llama.config.vocab_size
    text = "a blurry picture of the digit 7"
    assert saved.encode(text) == tokenizer.encode(text)
    assert saved.decode(saved.encode(text)) == text
    print(f"\n{layout} round trip (max abs): {measured}")


def _language(model: Any, vocab: int) -> Any:
    return dataclasses.replace(model.config.language, vocab_size=vocab)


@pytest.mark.distributed
def test_cli_errors_and_a_transformers_tokenizer(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = ew.checkpoint_dir(checkpoints, "tp2_pp2")
    with pytest.raises(SystemExit) as err:
        clip_llama.main(["export", "--help"])
    assert err.value.code == 0 and "--ckpt CKPT" in capsys.readouterr().out
    missing = tmp_path / "nothing"
    with pytest.raises(SystemExit) as err:
        clip_llama.main(["export", "--ckpt", str(missing), "--out", str(tmp_path / "o")])
    assert err.value.code == 2 and f"'{missing}' does not exist" in capsys.readouterr().err
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    (partial / "__3_0.distcp").unlink()
    with pytest.raises(SystemExit) as err:
        clip_llama.main(["export", "--ckpt", str(partial), "--out", str(tmp_path / "o")])
    assert err.value.code == 2 and "__3_0.distcp" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:  # the run directory instead of a checkpoint in it
        clip_llama.main(["export", "--ckpt", str(checkpoints), "--out", str(tmp_path / "o")])
    text = capsys.readouterr().err
    assert err.value.code == 2 and "is not a checkpoint; it holds" in text and str(ckpt) in text
    # --tokenizer: a transformers tokenizer directory, copied with save_pretrained
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    def hf_tokenizer(words: list[str], path: Path) -> Path:
        raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(path)
        return path

    words = torch.load(ckpt / "meta.pt", weights_only=False)["RecipeDigitsCaptions"]
    vocab = words["tokenizer"]["vocab"]  # the digits vocabulary (39 tokens)
    out = tmp_path / "with_hf"
    export_checkpoint(ckpt, out, tokenizer=hf_tokenizer(vocab, tmp_path / "hf"))
    copied = AutoTokenizer.from_pretrained(str(out / "tokenizer"), local_files_only=True)
    want = [vocab.index(w) for w in ("a", "digit", "seven")]
    assert len(copied) == 39 and copied("a digit seven")["input_ids"] == want
    small = hf_tokenizer(["<unk>", "a", "digit"], tmp_path / "small")
    with pytest.raises(ValueError, match=r"has 3 tokens, the model's vocabulary .* is 39"):
        export_checkpoint(ckpt, tmp_path / "o", tokenizer=small)
    assert not (tmp_path / "o").exists()  # checked before anything is written
    with pytest.raises(ValueError, match=r"holds neither tokenizer\.json"):
        export_checkpoint(ckpt, tmp_path / "o", tokenizer=tmp_path)


def test_moe_decoder_exports_all_but_llama(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A decoder with mixture-of-experts FFNs has no LlamaForCausalLM form: its weights go to
    language.safetensors with a note; the other formats are written as for a dense one. The
    checkpoint is written in this process (dcp.save without a process group + meta.pt), with the
    hyper-parameters as dataclasses (a module built in Python) and no data module state."""
    from lightning_mmpar.models.moe_routing import MoEConfig

    moe = MoEConfig(num_experts=2, top_k=1, ffn_width=16, router_dim=8, capacity_factor=None)
    fusion = ew.tiny_fusion_config()
    fusion = dataclasses.replace(fusion, language=dataclasses.replace(fusion.language, moe=moe))
    module = ClipLlamaModule(fusion=fusion, vocab_size=21)
    torch.manual_seed(0)
    module.configure_model()
    ckpt = tmp_path / "last.ckpt"
    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=ckpt, no_dist=True)
    torch.save({"hyper_parameters": dict(module.hparams)}, ckpt / "meta.pt")
    with caplog.at_level(logging.WARNING):
        result = export_checkpoint(ckpt, tmp_path / "out", verify=True)
    # open_clip's "built without weights" warnings are not shown: the check loads them next
    assert not [r for r in caplog.records if "weights" in r.getMessage()], caplog.text
    assert "llama" not in result.files and "language.safetensors" in result.files
    assert any("mixture-of-experts" in n for n in result.notes), result.notes
    assert any("--tokenizer" in n for n in result.notes), result.notes
    assert set(result.diffs) == {"open_clip_features", "adapter", "heads"}
    assert result.diffs["open_clip_features"] <= TOL and result.padded_vocab_size == 24
    language = load_file(str(tmp_path / "out" / "language.safetensors"))
    state = module.fusion_model.state_dict()
    assert any(".experts." in k or ".moe" in k or "router" in k for k in language), sorted(language)
    for key, value in language.items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pool_type": "avg", "final_ln_after_pool": True},
        {"act": "quick_gelu", "ls_init_value": 0.5, "no_ln_pre": True, "mlp_ratio": 3.0},
    ],
)
def test_open_clip_config_rebuilds_every_vision_option(options: dict, tmp_path: Path) -> None:
    """open_clip builds, from ``open_clip_model_config``, a ``visual`` that takes our ViT's
    exported state dict strictly and gives its features (each VisionConfig option)."""
    import open_clip

    from lightning_mmpar.models.convert import export_open_clip_visual, open_clip_model_config
    from lightning_mmpar.models.vision import VisionConfig, VisionTower

    config = VisionConfig(
        image_size=16, patch_size=4, width=32, layers=2, heads=4, output_dim=24, **options
    )
    torch.manual_seed(0)
    ours = VisionTower(config).eval()
    (tmp_path / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": open_clip_model_config(config)})
    )
    clip = open_clip.create_model(f"local-dir:{tmp_path}", load_weights=False)
    visual = clip.visual.eval()
    visual.load_state_dict(
        export_open_clip_visual({f"vision.{k}": v for k, v in ours.state_dict().items()}),
        strict=True,
    )
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert max_diff(visual(images), ours(images)[0]) <= TOL
