"""The shipped LLaVA fine-tuning YAML (``recipes/llava_sft_cpu.yaml``) on the tiny LLaVA
directory of :mod:`lightning_mmpar.examples.tiny_llava`: 2 steps at one process (the shipped
tp2 layout's logits equal one process's: tests/recipes/test_ragged_parity.py). The data module
gets the checkpoint's tokenizer, image size, tokens per image and image processor; the loss is
transformers' cross-entropy over the assistant tokens only; the ViT is frozen and the
projector / decoder train at their own rates."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback, Trainer

from lightning_mmpar.data.tokenizer import IGNORE_INDEX
from lightning_mmpar.examples.tiny_llava import RECORDS, write_tiny_llava
from lightning_mmpar.recipes.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")
YAML = Path(__file__).resolve().parents[2] / "recipes" / "llava_sft_cpu.yaml"


class FirstStep(Callback):
    """The first training batch, the logged loss of step 0 and the optimizer's groups."""

    def __init__(self) -> None:
        self.batch: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []
        self.groups: list[tuple[str, float, int]] = []

    def on_train_batch_end(
        self, trainer: Trainer, module: Any, out: Any, batch: Any, i: int
    ) -> None:
        if not self.batch:
            self.batch = {k: v.clone() for k, v in batch.items()}
            opt = trainer.optimizers[0]
            self.groups = [(g["name"], g["initial_lr"], len(g["params"])) for g in opt.param_groups]
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _samples(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The packed rows' samples, each with its own tokens, labels and images."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        for s in batch["sample_ids"][r].unique().tolist():
            if s < 0:
                continue
            where = batch["sample_ids"][r] == s
            images = batch["image_mask"][r] & (batch["image_sample"][r] == s)
            out.append(
                {
                    "input_ids": batch["input_ids"][r][where],
                    "labels": batch["labels"][r][where],
                    "pixel_values": batch["pixel_values"][r][images],
                }
            )
    return out


def _transformers_loss(path: Path, batch: dict[str, torch.Tensor]) -> float:
    """transformers' token-mean cross-entropy of the batch's samples (each on its own)."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(path), local_files_only=True)
    total, count = 0.0, 0
    with torch.no_grad():
        for s in _samples(batch):
            pixels = s["pixel_values"] if len(s["pixel_values"]) else None
            logits = model(input_ids=s["input_ids"][None], pixel_values=pixels).logits[0]
            target = s["labels"][1:]
            ce = torch.nn.functional.cross_entropy(
                logits[:-1], target, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total, count = total + float(ce), count + int((target != IGNORE_INDEX).sum())
    return total / count


def test_llava_sft_yaml_trains_on_assistant_tokens(tmp_path: Path) -> None:
    paths = write_tiny_llava(tmp_path / "tiny")
    config = yaml.safe_load(YAML.read_text())
    config["trainer"] |= {"devices": 1, "max_steps": 2, "logger": False}
    config["trainer"] |= {"enable_progress_bar": False, "default_root_dir": str(tmp_path / "run")}
    config["trainer"]["strategy"]["init_args"]["tensor_parallel"] = 1
    config["trainer"]["callbacks"] = [{"class_path": f"{__name__}.FirstStep"}]
    config["model"]["pretrained"]["hf"] = str(paths["model"])
    config["data"]["init_args"] |= {
        "train_file": str(paths["train_file"]),
        "image_root": str(paths["image_root"]),
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(tmp_path / "c.yaml")])
    assert cli.trainer.global_step == 2
    data, rec = cli.datamodule, cli.trainer.callbacks[0]
    assert isinstance(rec, FirstStep)
    # the checkpoint's tokenizer (chat template), image size, tokens per image and processor
    assert data.tokenizer.path == str(paths["model"])
    assert data.collate_args["image_seq_length"] == 16 and data.image_size == 16
    assert data.image_token_id == cli.model.fusion_config.image_token_id
    pre = config["data"]["init_args"].get("preprocess")
    assert pre is None and cli.config["fit"]["data"]["init_args"]["preprocess"]["from_pretrained"]
    # labels: exactly the assistant answers with their end-of-turn token, nothing else
    hf = data.tokenizer.tokenizer
    answers = {t["value"] for r in RECORDS for t in r["conversations"] if t["from"] == "gpt"}
    runs = []
    for ids, labels in zip(rec.batch["input_ids"], rec.batch["labels"], strict=True):
        scored = [*(labels != IGNORE_INDEX).tolist(), False]
        start = None
        for t, on in enumerate(scored):
            if on and start is None:
                start = t
            elif not on and start is not None:
                runs.append(hf.decode(ids[start:t]))
                start = None
    assert runs and {r.removesuffix(" <|end|>") for r in runs} <= answers
    assert all(r.endswith("<|end|>") for r in runs)
    # the step-0 loss is transformers' cross-entropy over those tokens (before any update)
    ours, theirs = rec.losses[0], _transformers_loss(paths["model"], rec.batch)
    assert math.isclose(ours, theirs, rel_tol=1e-5), (ours, theirs)
    # frozen ViT; projector and decoder at their own peak rates (optim.lr_projector)
    names = {name: (lr, n) for name, lr, n in rec.groups}
    assert not any(n.startswith("vision") for n in names)
    assert names["projector"][0] == 1e-3 and names["language"][0] == 2e-4
    vision = cli.model.fusion_model.vision
    assert not any(p.requires_grad for p in vision.parameters())
    assert all(p.requires_grad for p in cli.model.fusion_model.projector.parameters())
