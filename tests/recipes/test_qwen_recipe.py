"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL-MoE through the recipe's command line (issue 29): ``fit
--model.pretrained.hf <dir>`` on a tiny directory of each family written offline (model,
tokenizer with a chat template, image processor) and LLaVA-format conversations, 3 steps at
one process; the data side (assistant labels, the directory's image processor) and the
refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from lightning_mmpar.data import ConversationDataModule
from lightning_mmpar.data.conversations import QwenRowsCollator
from lightning_mmpar.data.tokenizer import IGNORE_INDEX
from lightning_mmpar.models.hf.qwen3_convert import QWEN3_MOE_FAMILIES
from lightning_mmpar.models.hf.qwen_convert import QWEN_FAMILIES
from lightning_mmpar.recipes.cli import link_vision_preprocess, run_cli
from lightning_mmpar.recipes.qwen3_module import Qwen3MoeVLRecipeModule
from lightning_mmpar.recipes.qwen_module import QwenVLRecipeModule
from tests.builders import tiny_qwen_vl_dir
from tests.recipes import qwen_recipe_worker as qr


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen")
    source = tiny_qwen_vl_dir(root / "qwen2_vl", qr.WORDS.split())
    return source, qr.write_data(root)


class Batches(Callback):
    """Every training batch and its logged loss (the test compares the first with
    transformers')."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *a: Any):
        self.seen.append((batch, float(trainer.callback_metrics["train_loss"])))


def test_data_labels_assistant_tokens_and_reads_the_image_processor(files: Any) -> None:
    """Each sample's labels are the assistant answers (and their end-of-turn token) only; each
    ``<image>`` becomes vision start / image pad / vision end; the patches and grids are
    transformers' ``Qwen2VLImageProcessor``'s own output for the image."""
    from PIL import Image
    from transformers import AutoImageProcessor

    source, data = files
    module = qr.data_module(source, data)
    tok = module.tokenizer.tokenizer  # type: ignore[union-attr]
    answers = []
    for i in range(len(qr.RECORDS)):
        sample = module.dataset()[i]
        labels = sample["labels"]
        words = tok.convert_ids_to_tokens(labels[labels != IGNORE_INDEX].tolist())
        answers.append(" ".join(words))
    assert answers == [
        "a red square <|im_end|>",
        "two shapes <|im_end|> yes <|im_end|>",
        "no <|im_end|>",
        "a blue circle <|im_end|>",
    ]
    two = module.dataset()[1]
    ids = two["input_ids"].tolist()
    assert ids.count(100) == 2 and ids[ids.index(100) - 1 : ids.index(100) + 2] == [101, 100, 102]
    processor = AutoImageProcessor.from_pretrained(str(source), local_files_only=True)
    with Image.open(data.parent / "b.png") as b, Image.open(data.parent / "c.png") as c:
        want = processor(images=[b.convert("RGB"), c.convert("RGB")], return_tensors="pt")
    assert torch.equal(two["pixel_values"], want["pixel_values"])
    assert (
        two["image_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 8, 4], [1, 4, 4]]
    )
    assert isinstance(module.collator(), QwenRowsCollator)


def test_data_refuses_what_a_qwen_processor_cannot_do(files: Any) -> None:
    source, data = files
    with pytest.raises(ValueError, match=r"data\.overflow \('truncate'\).*'drop' or 'error'"):
        qr.data_module(source, data, overflow="truncate")
    with pytest.raises(ValueError, match=r"data\.image_seq_length \(16\)"):
        qr.data_module(source, data, image_seq_length=16)
    with pytest.raises(ValueError, match=r"needs preprocessor_config\.json and config\.json"):
        ConversationDataModule(train_file=str(data), image_processor=str(data.parent))


RECIPE_MODULES = {
    "qwen2_vl": QwenVLRecipeModule,
    "qwen2_5_vl": QwenVLRecipeModule,
    "qwen3_vl_moe": Qwen3MoeVLRecipeModule,
}


@pytest.mark.parametrize("family", list(RECIPE_MODULES))
def test_recipe_fit_trains_a_qwen_directory(family: str, files: Any, tmp_path: Path) -> None:
    """``fit --model.pretrained.hf <dir>`` of each Qwen family with the conversation data
    module: the module is the family's recipe module, the data gets the directory's image
    processor linked, 3 steps run, and the first step's loss (assistant tokens only) equals
    transformers' loss of the same batch (1e-5); the frozen ViT does not move, the merger
    (and Qwen3-VL's DeepStack mergers) is the adapter's parameter group
    (``optim.lr_adapter``)."""
    import transformers

    _, data = files
    source = tiny_qwen_vl_dir(tmp_path / family, qr.WORDS.split(), family)
    cls = (QWEN_FAMILIES | QWEN3_MOE_FAMILIES)[family]
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 3,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp_path / "run"),
            "strategy": {"class_path": "lightning_mmpar.strategy.MultimodalParallelStrategy"},
            "callbacks": [{"class_path": f"{__name__}.Batches"}],
        },
        "model": {
            "pretrained": {"hf": str(source)},
            "loss": {"contrastive_weight": 0.0, "mml": {"weight": 0.0}},
            "finetune": {"train_decoder_layers": -1, "train_embeddings": True},
            "optim": {"lr": 1e-3, "lr_adapter": 2e-3, "warmup_steps": 1},
        },
        "data": {
            "class_path": "lightning_mmpar.data.ConversationDataModule",
            "init_args": {
                "train_file": str(data),
                "image_root": str(data.parent),
                "batch_size": 2,
                "max_tokens": 64,
                "overflow": "error",
            },
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(path)])
    assert type(cli.model) is RECIPE_MODULES[family]
    assert cli.datamodule.images is not None and cli.trainer.global_step == 3
    seen = next(c for c in cli.trainer.callbacks if isinstance(c, Batches)).seen
    assert len(seen) == 3 and all(torch.isfinite(torch.tensor(loss)) for _, loss in seen)
    batch, loss = seen[0]
    hf = getattr(transformers, cls).from_pretrained(str(source), local_files_only=True)
    with torch.no_grad():
        want = float(hf(**qr.hf_inputs(batch), labels=batch["labels"]).loss)
    diff = abs(loss - want) / abs(want)
    print(f"qwen recipe | {family} fit | step-1 loss {loss:.6f}, transformers' {diff:.1e} off")
    assert diff <= 1e-5
    groups = {g["name"]: g for g in cli.trainer.optimizers[0].param_groups}
    vision = cli.model.qwen_model.vision
    mergers = [vision.merger, *getattr(vision, "deepstack_merger_list", [])]
    merger = {id(p) for m in mergers for p in m.parameters()}
    assert {id(p) for n in ("adapter", "adapter.no_decay") for p in groups[n]["params"]} == merger
    assert "vision" not in groups  # train_vision: false (the merger still trains)
    original = hf.state_dict()["model.visual.blocks.0.attn.qkv.weight"]
    trained = cli.model.qwen_model.vision.blocks[0].attn.q_proj.weight
    assert torch.equal(trained.detach(), original[: trained.shape[0]])  # train_vision: false
    assert not torch.equal(cli.model.qwen_model.language.lm_head.weight.detach(), hf.lm_head.weight)


def test_cli_links_the_qwen_directory_to_the_image_processor(files: Any) -> None:
    from jsonargparse import Namespace

    source, _ = files
    parsed = Namespace(
        model=Namespace(pretrained=Namespace(vision=None, hf=str(source))),
        data=Namespace(init_args=Namespace(preprocess=None, image_processor=None)),
    )
    assert link_vision_preprocess(parsed) == str(source)
    assert parsed.data.init_args.image_processor == str(source)
    assert parsed.data.init_args.preprocess is None  # not the CLIP preprocessing
