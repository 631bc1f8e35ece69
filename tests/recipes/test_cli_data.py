"""The recipe CLI with any LightningDataModule: caption files (with labels, and without: the run
summary still ends the run) and WebDataset shards, 2 steps."""

from __future__ import annotations

import io
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
import yaml
from PIL import Image

from lightning_mmpar.recipes.cli import main, run_cli

NAMES = ["red", "green", "blue"]
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
TINY = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 2,
        "val_check_interval": 2,
        "limit_val_batches": 1,
        "check_val_every_n_epoch": None,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "strategy": {"class_path": "lightning_mmpar.strategy.MultimodalParallelStrategy"},
    },
    "model": {
        "fusion": {
            "vision": {
                "image_size": 16,
                "patch_size": 8,
                "width": 32,
                "layers": 1,
                "heads": 2,
                "mlp_ratio": 2.0,
                "output_dim": 32,
                "pool_type": "tok",
            },
            "language": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            },
            "adapter": {"num_blocks": 1, "heads": 2, "width": 32, "ffn_width": 64, "dropout": 0.0},
            "contrastive_dim": 32,
        },
    },
}


def _image(label: int, i: int) -> Image.Image:
    r, g, b = COLOURS[label]
    return Image.new("RGB", (20, 16), (r, g, (b + 7 * i) % 256))


def _run(tmp_path: Path, data: dict[str, Any]) -> Any:
    config = {**TINY, "data": data}
    config["trainer"] = {**TINY["trainer"], "default_root_dir": str(tmp_path / "run")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2
    assert cli.model.vocab_size == cli.datamodule.vocab_size == cli.datamodule.tokenizer.vocab_size
    metrics = cli.trainer.callback_metrics
    assert math.isfinite(float(metrics["train/caption"]))
    assert 0.0 <= float(metrics["val/zero_shot_acc"]) <= 1.0  # class prompts and labels used
    return cli


def test_fit_with_caption_files(tmp_path: Path) -> None:
    rows = []
    for i in range(12):
        label = i % 3
        _image(label, i).save(tmp_path / f"{i}.png")
        rows.append({"filepath": f"{i}.png", "title": f"a {NAMES[label]} square", "label": label})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "train.jsonl").write_text(text)
    (tmp_path / "val.jsonl").write_text(text)
    data = {
        "class_path": "lightning_mmpar.data.captions.CaptionsDataModule",
        "init_args": {
            "train_file": str(tmp_path / "train.jsonl"),
            "val_file": str(tmp_path / "val.jsonl"),
            "image_size": 16,
            "batch_size": 4,
            "max_length": 8,
            "label_column": "label",
            "class_names": NAMES,
            "prompt_template": "a {name} square",
            "preprocess": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
        },
    }
    cli = _run(tmp_path, data)
    assert cli.datamodule.preprocess.mean == (0.5, 0.5, 0.5)
    assert cli.datamodule.class_prompts()["input_ids"].shape == (3, 8)


def test_fit_with_webdataset_shards(tmp_path: Path) -> None:
    for s in range(2):
        with wds.TarWriter(str(tmp_path / f"{s:06d}.tar")) as sink:
            for j in range(8):
                i, buf = s * 8 + j, io.BytesIO()
                _image(i % 3, i).save(buf, format="PNG")
                sample = {"__key__": f"{i:06d}", "png": buf.getvalue(), "cls": str(i % 3)}
                sample["txt"] = "" if i == 3 else f"a {NAMES[i % 3]} square"
                sink.write(sample)
    data = {
        "class_path": "lightning_mmpar.data.webdataset.WebDatasetCaptions",
        "init_args": {
            "train_shards": str(tmp_path / "{000000..000001}.tar"),
            "val_shards": str(tmp_path / "000001.tar"),
            "image_size": 16,
            "batch_size": 4,
            "max_length": 8,
            "on_error": "skip",
            "shuffle": False,
            "class_names": NAMES,
            "prompt_template": "a {name} square",
        },
    }
    cli = _run(tmp_path, data)
    assert cli.datamodule.num_skipped["train"] == 1  # the empty caption of sample 3


def test_bare_data_section_is_the_digits_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch import Trainer

    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: None)
    cli = run_cli(
        [
            "fit",
            "--config",
            "recipes/clip_llama_cpu.yaml",
            "--trainer.devices",
            "1",
            "--trainer.strategy",
            "auto",
            "--data.batch_size",
            "36",
        ]
    )
    assert type(cli.datamodule).__name__ == "RecipeDigitsCaptions"
    assert cli.datamodule.batch_size == 36 and cli.model.vocab_size == cli.datamodule.vocab_size


def test_planner_builds_any_data_module(tmp_path: Path) -> None:
    from lightning_mmpar.recipes.partition import build_module, data_args

    rows = [{"filepath": "0.png", "title": "a red square"}]
    _image(0, 0).save(tmp_path / "0.png")
    (tmp_path / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    data = {
        "class_path": "lightning_mmpar.data.captions.CaptionsDataModule",
        "init_args": {"train_file": str(tmp_path / "train.jsonl"), "image_size": 16},
        "batch_size": 6,  # a layout fragment merged beside class_path (plan --write-yaml)
    }
    config = {"model": TINY["model"], "data": data}
    assert data_args(config) == {**data["init_args"], "batch_size": 6}
    module, dm = build_module(config)
    assert type(dm).__name__ == "CaptionsDataModule" and dm.batch_size == 6
    assert module.vocab_size == dm.vocab_size
    digits = build_module({"model": TINY["model"], "data": {"image_size": 16}})[1]
    assert type(digits).__name__ == "RecipeDigitsCaptions" and digits.image_size == 16


def test_data_module_without_vocab_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch import Trainer

    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: None)
    boring = "lightning.pytorch.demos.boring_classes.BoringDataModule"
    with pytest.raises(ValueError, match=r"data \(BoringDataModule\) has no vocab_size"):
        run_cli(
            [
                "fit",
                "--config",
                "recipes/clip_llama_cpu.yaml",
                "--trainer.devices",
                "1",
                "--trainer.strategy",
                "auto",
                "--data.class_path",
                boring,
            ]
        )


def test_precision_fp8_section_trains_in_fp8(tmp_path: Path) -> None:
    """The YAML's top-level ``precision.fp8:`` adds FP8Training with its policy (CPU: FP8
    emulation), and the recipe trains with the converted layers."""
    from lightning_mmpar.callbacks import FP8Training

    config = {
        **TINY,
        "trainer": {**TINY["trainer"], "default_root_dir": str(tmp_path / "run")},
        "data": {"image_size": 16, "batch_size": 8},
        "precision": {"fp8": {"policy": {"keep_high_precision": ["*head*"]}}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = run_cli(["fit", "--config", str(path)])
    fp8 = [c for c in cli.trainer.callbacks if isinstance(c, FP8Training)]
    assert len(fp8) == 1 and cli.trainer.global_step == 2
    assert fp8[0].policy.keep_high_precision == ("*head*",)
    assert fp8[0].converted and not any("head" in n for n in fp8[0].converted), fp8[0].converted
    assert math.isfinite(float(cli.trainer.callback_metrics["train/caption"]))
    config.pop("precision")
    path.write_text(yaml.safe_dump(config))
    plain = run_cli(["fit", "--config", str(path), "--trainer.max_steps", "1"])
    assert not any(isinstance(c, FP8Training) for c in plain.trainer.callbacks)


def test_fit_with_unlabelled_caption_csv_ends_with_its_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A caption CSV without labels (no ``label_column``: the docs' optional labels) trains,
    validates, checkpoints and ends with its run summary, greedy and zero-shot accuracy
    ``n/a`` (they need labels), not a ``KeyError`` after the checkpoint."""
    lines = ["filepath,title"]
    for i in range(12):
        _image(i % 3, i).save(tmp_path / f"{i}.png")
        lines.append(f"{i}.png,a {NAMES[i % 3]} square")
    (tmp_path / "captions.csv").write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    trainer = {
        **TINY["trainer"],
        "default_root_dir": str(run),
        "enable_checkpointing": True,
        "callbacks": [
            {
                "class_path": "lightning_mmpar.recipes.summary.RunSummary",
                "init_args": {"plots": False},
            },
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"save_last": True, "save_top_k": 0},
            },
        ],
    }
    data = {
        "class_path": "lightning_mmpar.data.captions.CaptionsDataModule",
        "init_args": {
            "train_file": str(tmp_path / "captions.csv"),
            "val_file": str(tmp_path / "captions.csv"),
            "image_root": str(tmp_path),
            "image_size": 16,
            "batch_size": 4,
            "max_length": 8,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**TINY, "trainer": trainer, "data": data}))
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["fit", "--config", str(path)])  # returns: the command exits 0
    assert not [w for w in caught if "RunSummary" in str(w.message)]
    printed = caplog.text
    assert "caption names the digit: greedy n/a, teacher-forced n/a" in printed, printed
    assert "retrieval per pair (own caption)  n/a" in printed, printed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and Path(summary["checkpoint"]).is_dir(), summary
    assert summary["caption_acc_greedy"] is None and summary["zero_shot_acc"] is None
    assert math.isfinite(summary["history"]["val"][-1]["val_loss"])


def test_a_named_data_class_gets_its_own_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The digits default's init arguments never reach another data class (jsonargparse #460:
    ``CaptionsDataModule`` got the digits' ``image_size=32``, not its own 224); a value the
    command gives is kept, and a bare ``data:`` section still configures the digits demo."""

    def printed(*args: str) -> dict[str, Any]:
        with pytest.raises(SystemExit) as done:
            main(["fit", *args, "--print_config"])
        assert done.value.code in (0, None)
        return yaml.safe_load(capsys.readouterr().out)["data"]

    captions = ["--data.class_path", "lightning_mmpar.data.CaptionsDataModule"]
    train = ["--data.init_args.train_file", str(tmp_path / "train.csv")]
    assert printed(*captions, *train)["init_args"]["image_size"] == 224
    given = printed(*captions, *train, "--data.init_args.image_size", "32")
    assert given["init_args"]["image_size"] == 32
    digits = printed("--data.image_size", "16")
    assert digits["class_path"].endswith("RecipeDigitsCaptions")
    assert digits["init_args"]["image_size"] == 16
