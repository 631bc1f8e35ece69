"""The shipped Qwen2-VL fine-tuning YAML (``recipes/qwen_sft_cpu.yaml``) on the tiny Qwen2-VL
directory of :mod:`lightning_mmpar.examples.tiny_qwen`: the example writes a directory
``from_hf`` loads; the YAML trains it 2 steps at one process (its tp2 layout's gradients equal
one process's: tests/recipes/test_qwen_vl_parity.py) with the checkpoint's tokenizer and image
processor, the loss transformers' cross-entropy over the assistant tokens only, the ViT frozen
and the merger at its own rate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_mmpar.data.tokenizer import IGNORE_INDEX
from lightning_mmpar.examples.tiny_qwen import RECORDS, write_tiny_qwen
from lightning_mmpar.models import from_hf
from lightning_mmpar.models.hf.qwen2_vl import QwenVLModel
from lightning_mmpar.recipes.cli import run_cli
from lightning_mmpar.recipes.qwen_module import QwenVLRecipeModule
from tests.recipes.test_llava_sft import FirstStep

pytestmark = pytest.mark.filterwarnings("ignore")
YAML = Path(__file__).resolve().parents[2] / "recipes" / "qwen_sft_cpu.yaml"


def _samples(batch: dict[str, torch.Tensor], start: int) -> list[dict[str, torch.Tensor]]:
    """The packed rows' samples, each with its own tokens, labels, patches and grids (a
    sample's images are the next ``k`` of its row, ``k`` its ``<|vision_start|>`` count)."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        grids = batch["image_grid_thw"][r][batch["image_mask"][r]]
        img = patch = 0
        for s in batch["sample_ids"][r].unique().tolist():
            if s < 0:
                continue
            ids = batch["input_ids"][r][batch["sample_ids"][r] == s]
            k = int((ids == start).sum())
            n = int(grids[img : img + k].prod(-1).sum())
            labels = batch["labels"][r][batch["sample_ids"][r] == s]
            pixels = batch["pixel_values"][r][patch : patch + n]
            out.append({"input_ids": ids, "labels": labels, "pixels": pixels})
            out[-1]["grids"] = grids[img : img + k]
            img, patch = img + k, patch + n
    return out


def _transformers_loss(path: Path, batch: dict[str, torch.Tensor]) -> float:
    """transformers' token-mean cross-entropy of the batch's samples (each on its own)."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(path), local_files_only=True)
    image, start = model.config.image_token_id, model.config.vision_start_token_id
    total, count = 0.0, 0
    with torch.no_grad():
        for s in _samples(batch, start):
            ids = s["input_ids"][None]
            images = {"pixel_values": s["pixels"], "image_grid_thw": s["grids"]}
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == image).int(),
                **(images if len(s["grids"]) else {}),
            ).logits[0]
            target = s["labels"][1:]
            ce = torch.nn.functional.cross_entropy(
                logits[:-1], target, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total, count = total + float(ce), count + int((target != IGNORE_INDEX).sum())
    return total / count


def _scored(batch: dict[str, torch.Tensor], tokenizer: Any) -> list[str]:
    """The decoded runs of labelled tokens of every row."""
    runs = []
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        scored, start = [*(labels != IGNORE_INDEX).tolist(), False], None
        for t, on in enumerate(scored):
            if on and start is None:
                start = t
            elif not on and start is not None:
                runs.append(tokenizer.decode(ids[start:t]))
                start = None
    return runs


def _one_process_config(
    tmp_path: Path, paths: dict[str, Path], config: dict[str, Any], **trainer: Any
) -> Path:
    """``config`` (the shipped YAML's) at one process and tp 1 on the example's directory and
    data, ``trainer`` options over it, written to ``tmp_path/c.yaml`` (its path)."""
    config["trainer"] |= {"devices": 1, "logger": False, **trainer}
    config["trainer"] |= {"enable_progress_bar": False, "default_root_dir": str(tmp_path / "run")}
    config["trainer"]["strategy"]["init_args"]["tensor_parallel"] = 1
    config["model"]["pretrained"]["hf"] = str(paths["model"])
    config["data"]["init_args"] |= {
        "train_file": str(paths["train_file"]),
        "image_root": str(paths["image_root"]),
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_qwen_sft_yaml_trains_the_example_on_assistant_tokens(tmp_path: Path) -> None:
    paths = write_tiny_qwen(tmp_path / "tiny")
    assert isinstance(from_hf(paths["model"]), QwenVLModel)
    images = [r.get("image", []) for r in RECORDS]
    assert {len(i) if isinstance(i, list) else 1 for i in images} == {0, 1, 2}
    config = yaml.safe_load(YAML.read_text())
    assert config["trainer"]["devices"] == 2
    assert config["trainer"]["strategy"]["init_args"]["tensor_parallel"] == 2
    first_step = [{"class_path": "tests.recipes.test_llava_sft.FirstStep"}]
    path = _one_process_config(tmp_path, paths, config, max_steps=2, callbacks=first_step)
    cli = run_cli(["fit", "--config", str(path)])
    assert type(cli.model) is QwenVLRecipeModule and cli.trainer.global_step == 2
    data, rec = cli.datamodule, cli.trainer.callbacks[0]
    assert isinstance(rec, FirstStep)
    # the checkpoint's tokenizer (chat template) and image processor
    assert data.tokenizer.path == str(paths["model"]) and data.images is not None
    # labels: exactly the assistant answers with their end-of-turn token, nothing else
    runs = _scored(rec.batch, data.tokenizer.tokenizer)
    answers = {t["value"] for r in RECORDS for t in r["conversations"] if t["from"] == "gpt"}
    assert runs and {r.removesuffix("<|im_end|>").strip() for r in runs} <= answers
    assert all(r.endswith("<|im_end|>") for r in runs)
    # the step-0 loss is transformers' cross-entropy over those tokens (before any update)
    ours, theirs = rec.losses[0], _transformers_loss(paths["model"], rec.batch)
    assert math.isclose(ours, theirs, rel_tol=1e-5), (ours, theirs)
    # frozen ViT; the merger and the decoder at their own peak rates
    names = {name: lr for name, lr, _ in rec.groups}
    assert "vision" not in names and names["adapter"] == 1e-3 and names["language"] == 2e-4
    vision = cli.model.qwen_model.vision
    merger = {id(p) for p in vision.merger.parameters()}
    assert not any(p.requires_grad for p in vision.parameters() if id(p) not in merger)


def test_a_cut_vit_tensor_is_refused_not_zero_padded(tmp_path: Path) -> None:
    """A checkpoint tensor with fewer rows than the model's parameter is refused by the
    recipe's per-rank loader naming it and both shapes; only the vocabulary parameters
    (``recipes.pretrained.VOCAB_PARAMS``) are padded with zero rows (before: the ViT's fused
    ``attn.qkv`` cut by 3 rows loaded as q / k / v with a zero last row, silently)."""
    from safetensors.torch import load_file, save_file

    paths = write_tiny_qwen(tmp_path / "tiny")
    (weights,) = Path(paths["model"]).glob("*.safetensors")
    state = load_file(str(weights))
    key = "visual.blocks.0.attn.qkv.weight"  # the Qwen2-VL checkpoint naming the example writes
    state[key] = state[key][:-3].contiguous()
    save_file(state, str(weights), metadata={"format": "pt"})
    path = _one_process_config(tmp_path, paths, yaml.safe_load(YAML.read_text()), max_steps=1)
    with pytest.raises(
        ValueError, match=r"'blocks\.0\.attn\.q_proj\.weight' has shape \[\d+, \d+\]"
    ):
        run_cli(["fit", "--config", str(path)])


class Returned(FirstStep):
    """:class:`FirstStep` plus the loss each training step back-propagates (Lightning's
    ``outputs["loss"]``: the step's returned loss divided by ``accumulate_grad_batches``)."""

    def __init__(self) -> None:
        super().__init__()
        self.returned: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        super().on_train_batch_end(trainer, module, out, batch, i)
        self.returned.append(float(out["loss"] if isinstance(out, dict) else out))


def test_a_one_batch_accumulation_window_trains_and_logs_the_batch_mean(tmp_path: Path) -> None:
    """``accumulate_grad_batches=2`` over an epoch of one batch (a window of one batch): the
    loss back-propagated and the logged ``train_loss`` are the batch's token mean, equal to
    transformers' cross-entropy (the window's token mean, as for the recipe's fusion module;
    before: the Qwen module ignored the window, so both were half of it)."""
    paths = write_tiny_qwen(tmp_path / "tiny")
    config = yaml.safe_load(YAML.read_text())
    config["data"]["init_args"]["batch_size"] = 6  # the example's 6 conversations: one batch
    returned = [{"class_path": f"{__name__}.Returned"}]
    path = _one_process_config(
        tmp_path, paths, config, max_steps=1, accumulate_grad_batches=2, callbacks=returned
    )
    cli = run_cli(["fit", "--config", str(path)])
    rec = cli.trainer.callbacks[0]
    assert isinstance(rec, Returned) and len(rec.losses) == 1 == cli.trainer.global_step
    theirs = _transformers_loss(paths["model"], rec.batch)
    assert math.isclose(rec.losses[0], theirs, rel_tol=1e-5), (rec.losses, theirs)
    assert math.isclose(rec.returned[0], theirs, rel_tol=1e-5), (rec.returned, theirs)
