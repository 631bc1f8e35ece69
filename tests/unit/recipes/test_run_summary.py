"""``RunSummary``: ``caption_batches`` validated at construction, and the greedy caption
accuracy measured on exactly that many validation batches (the slowest part of a short run);
the summary and the evaluation on every data module (digits, caption CSV with and without labels
or a validation file, WebDataset shards) and precision (fp32, bf16-mixed, DeepSpeed's bf16
engine), one process; a summary that fails is a warning, not a failed run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_mmpar.recipes.summary import NOT_DECODED, RunSummary, _format
from tests.builders import fake_trainer


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_caption_batches_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="caption_batches"):
        RunSummary(caption_batches=bad)


class _Module:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def generate_accuracy(self, batches: Any) -> float:
        self.seen = list(batches)
        return 0.5


@pytest.mark.parametrize(("limit", "seen"), [(None, [0, 1, 2, 3]), (2, [0, 1]), (0, None)])
def test_caption_batches_limits_the_measurement(
    tmp_path: Path, limit: int | None, seen: list[int] | None
) -> None:
    trainer: Any = fake_trainer(
        tmp_path,
        datamodule=SimpleNamespace(val_dataloader=lambda: iter(range(4))),
    )
    module = _Module()
    summary = RunSummary(plots=False, caption_batches=limit)
    summary.on_fit_start(trainer, module)  # type: ignore[arg-type]
    summary.on_fit_end(trainer, module)  # type: ignore[arg-type]
    if seen is None:
        assert module.seen == []
    else:
        assert module.seen == seen


def test_skipped_steps_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Steps skipped by ``on_nonfinite="skip"`` are in the summary and its printed line."""
    trainer: Any = fake_trainer(
        tmp_path,
        strategy=SimpleNamespace(nonfinite=SimpleNamespace(skipped=2)),
    )
    summary = RunSummary(plots=False)
    summary.on_fit_start(trainer, _Module())  # type: ignore[arg-type]
    summary.on_fit_end(trainer, _Module())  # type: ignore[arg-type]
    assert summary.summary["skipped_steps"] == 2
    trainer.strategy = SimpleNamespace()  # no guard (other strategies): 0
    summary.on_fit_end(trainer, _Module())  # type: ignore[arg-type]
    assert summary.summary["skipped_steps"] == 0


def test_no_greedy_decoding_with_the_tower_on_its_own_ranks(tmp_path: Path) -> None:
    """Under ``vision_ranks`` the language ranks hold no tower: the summary does not decode
    (that raised ``'VisionStem' object has no attribute 'class_embedding'`` on every such run)
    and says why; the checkpoint named is the callback's newest (its best without
    ``save_last``)."""
    trainer: Any = fake_trainer(
        tmp_path,
        datamodule=SimpleNamespace(val_dataloader=lambda: iter(range(4))),
        strategy=SimpleNamespace(config=SimpleNamespace(vision_ranks=1)),
        checkpoint_callback=SimpleNamespace(last_model_path="", best_model_path="e0-s3.ckpt"),
    )
    module = _Module()
    summary = RunSummary(plots=False)
    summary.on_fit_start(trainer, module)  # type: ignore[arg-type]
    summary.on_fit_end(trainer, module)  # type: ignore[arg-type]
    assert module.seen == [] and summary.summary["caption_acc_greedy"] is None
    assert summary.summary["greedy_decoding"] == NOT_DECODED
    assert summary.summary["checkpoint"] == "e0-s3.ckpt"
    printed = _format(summary.summary, tmp_path / "summary.json", [])
    assert "greedy decoding  not run: the vision tower is on ranks of its own" in printed
    # the header counts every process: the language world plus the tower's own ranks
    world = summary.summary["layout"]["world"]
    header = f"world {world + 1} = tp 1 x pp 1 x dp {world} + 1 vision rank, virtual"
    assert header in printed, printed
    assert json.loads((tmp_path / "summary.json").read_text())["greedy_decoding"] == NOT_DECODED
    trainer.strategy = SimpleNamespace(config=SimpleNamespace(vision_ranks=0))  # colocated
    summary.on_fit_end(trainer, module)  # type: ignore[arg-type]
    assert module.seen and "greedy_decoding" not in summary.summary


# ------------------------------------------------------------ every data module and precision
NAMES = ["red", "green", "blue"]


def _png(path: Path, i: int) -> None:
    from PIL import Image

    Image.new("RGB", (20, 16), (40 + 60 * (i % 3), 30, (7 * i) % 256)).save(path)


def _csv_data(root: Path, *, labels: bool, val: bool) -> Any:
    """A caption CSV of 8 images (``label`` column and class names with ``labels``), its own
    validation file with ``val``."""
    from lightning_mmpar.data.captions import CaptionsDataModule

    root.mkdir(parents=True, exist_ok=True)
    lines = ["filepath,title" + (",label" if labels else "")]
    for i in range(8):
        _png(root / f"{i}.png", i)
        lines.append(f"{i}.png,a {NAMES[i % 3]} square" + (f",{i % 3}" if labels else ""))
    (root / "train.csv").write_text("\n".join(lines) + "\n")
    classes = {"label_column": "label", "class_names": NAMES} if labels else {}
    data = CaptionsDataModule(
        train_file=str(root / "train.csv"),
        val_file=str(root / "train.csv") if val else None,
        image_root=str(root),
        image_size=16,
        max_length=8,
        batch_size=4,
        prompt_template="a {name} square",
        **classes,
    )
    data.setup("fit")
    return data


def _shard_data(root: Path) -> Any:
    import io

    import webdataset as wds

    from lightning_mmpar.data.webdataset import WebDatasetCaptions

    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / "000000.tar")) as sink:
        for i in range(8):
            _png(root / "x.png", i)
            buf = io.BytesIO((root / "x.png").read_bytes())
            sample = {"__key__": f"{i:06d}", "png": buf.getvalue(), "cls": str(i % 3)}
            sink.write({**sample, "txt": f"a {NAMES[i % 3]} square"})
    shards = str(root / "000000.tar")
    data = WebDatasetCaptions(
        train_shards=shards,
        val_shards=shards,
        image_size=16,
        max_length=8,
        batch_size=4,
        shuffle=False,
        class_names=NAMES,
        prompt_template="a {name} square",
    )
    data.setup("fit")
    return data


DATA = ("digits", "csv", "csv_unlabelled", "csv_no_val", "webdataset")
PRECISIONS = ("32-true", "bf16-mixed", "deepspeed-bf16")


@pytest.fixture(scope="module")
def data_modules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.recipes import recipe_faults_worker as rw

    root = tmp_path_factory.mktemp("data")
    return {
        "digits": rw.digits(),
        "csv": _csv_data(root / "csv", labels=True, val=True),
        "csv_unlabelled": _csv_data(root / "plain", labels=False, val=True),
        "csv_no_val": _csv_data(root / "no_val", labels=True, val=False),
        "webdataset": _shard_data(root / "shards"),
    }


def _precision(name: str) -> Any:
    """Lightning's precision plugin of ``name``; ``deepspeed-bf16``: DeepSpeed's engine, whose
    module is bf16 and whose batches the plugin casts to bf16."""
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision, Precision

    if name == "deepspeed-bf16":
        return DeepSpeedPrecision("bf16-mixed")
    return MixedPrecision("bf16-mixed", "cpu") if name == "bf16-mixed" else Precision()


def _trained(data: Any, precision: str, root: Path) -> tuple[Any, Any]:
    """The recipe module (tiny) at the end of a fit on ``data`` under ``precision``, with a
    stand-in Trainer (one process: nothing is combined)."""
    import torch

    from tests.recipes import recipe_faults_worker as rw

    trainer: Any = SimpleNamespace(
        datamodule=data,
        precision_plugin=_precision(precision),
        checkpoint_callback=SimpleNamespace(last_model_path=str(root / "last.ckpt")),
        logger=None,
        default_root_dir=str(root),
        global_step=2,
        world_size=1,
        is_global_zero=True,
        strategy=SimpleNamespace(),
        sanity_checking=False,
        callback_metrics={},
    )
    module = rw.tiny_module(data.vocab_size)
    module._trainer = trainer
    module.configure_model()
    module.setup("fit")
    if precision == "deepspeed-bf16":  # DeepSpeed's bf16 engine holds the module in bf16
        module.to(torch.bfloat16)
    return module, trainer


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", DATA)
def test_summary_and_evaluation_run_on_every_data_module_and_precision(
    data_modules: dict[str, Any], tmp_path: Path, kind: str, precision: str
) -> None:
    """Validation metrics (a batch through the precision plugin, as Lightning runs a step)
    and the end-of-fit summary with its greedy caption accuracy: scored where the data has
    labels and a validation split, ``None`` (not a ``KeyError``, not a dtype mismatch, not a
    missing-split error) where it has not; the summary never fails."""
    import math
    import warnings

    import torch

    from lightning_mmpar.recipes.evaluation import EVAL_METRICS

    data = data_modules[kind]
    module, trainer = _trained(data, precision, tmp_path)
    plugin = trainer.precision_plugin
    module.eval()
    loader = data.val_dataloader() if kind != "csv_no_val" else data.train_dataloader()
    batch = plugin.convert_input(next(iter(loader)))
    with torch.no_grad(), plugin.forward_context():
        inputs, target = module.pipeline_inputs(batch)
        loss = module.pipeline_loss(tuple(module._run(inputs)), target)
    assert math.isfinite(float(loss))
    if kind != "csv_unlabelled":  # labels and class prompts: every metric is scored
        values = module._metrics.compute()
        assert set(values) == set(EVAL_METRICS)
        assert all(0.0 <= v <= 1.0 for v in values.values()), values
    summary = RunSummary(plots=False, caption_batches=1)
    summary.on_fit_start(trainer, module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary.on_fit_end(trainer, module)
    assert not [str(w.message) for w in caught if "RunSummary" in str(w.message)]
    greedy = summary.summary["caption_acc_greedy"]
    if kind in ("csv_unlabelled", "csv_no_val"):
        assert greedy is None
    else:
        assert isinstance(greedy, float) and 0.0 <= greedy <= 1.0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"] == 2 and saved["checkpoint"] == str(tmp_path / "last.ckpt")


class _Failing(_Module):
    def generate_accuracy(self, batches: Any) -> float:
        raise RuntimeError("decoding broke")


def test_a_failing_summary_is_a_warning_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A summary that raises after the training finished warns (the cause, the steps, the
    checkpoint kept) and ``fit`` goes on to return; ``LIGHTNING_MMPAR_TRACEBACK=1`` raises."""
    trainer: Any = fake_trainer(
        tmp_path,
        datamodule=SimpleNamespace(val_dataloader=lambda: iter(range(4))),
        checkpoint_callback=SimpleNamespace(last_model_path="runs/x/last.ckpt"),
        global_step=7,
    )
    summary = RunSummary(plots=False)
    summary.on_fit_start(trainer, _Failing())  # type: ignore[arg-type]
    monkeypatch.delenv("LIGHTNING_MMPAR_TRACEBACK", raising=False)
    message = (
        "RunSummary: the end-of-run summary failed (RuntimeError: decoding broke). Training "
        "finished (7 steps) and its last checkpoint is runs/x/last.ckpt; only the summary "
        "(summary.json, plots, greedy caption accuracy) is missing. LIGHTNING_MMPAR_TRACEBACK=1 "
        "re-raises it with its traceback."
    )
    with pytest.warns(UserWarning, match="^" + re.escape(message) + "$"):
        summary.on_fit_end(trainer, _Failing())  # type: ignore[arg-type]
    assert not (tmp_path / "summary.json").exists()
    monkeypatch.setenv("LIGHTNING_MMPAR_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="decoding broke"):
        summary.on_fit_end(trainer, _Failing())  # type: ignore[arg-type]


def test_question_task_reports_answer_accuracy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data module with ``prompts`` (a question task): the answers' exact match is measured
    and printed instead of the caption accuracy (whose batches a ragged module lacks)."""

    class _Answering(_Module):
        def answer_accuracy(self, data: Any) -> float:
            return 0.75

    trainer: Any = fake_trainer(
        tmp_path,
        datamodule=SimpleNamespace(prompts=lambda split="val": [], val_dataloader=lambda: []),
    )
    module = _Answering()
    printed: list[str] = []
    monkeypatch.setattr("lightning_mmpar.recipes.summary.rank_zero_info", printed.append)
    summary = RunSummary(plots=False)
    summary.on_fit_start(trainer, module)  # type: ignore[arg-type]
    summary.on_fit_end(trainer, module)  # type: ignore[arg-type]
    assert summary.summary["answer_acc_greedy"] == 0.75
    assert summary.summary["caption_acc_greedy"] is None and module.seen == []
    assert "answer exact match (held-out questions, greedy)  75.0%" in printed[0]


def test_truncated_and_dropped_samples_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe module's cumulative ``data/truncated`` / ``data/dropped`` (issue 28 item 7)
    are in the summary and its printed line when non-zero; no line when both are 0."""
    printed: list[str] = []
    monkeypatch.setattr("lightning_mmpar.recipes.summary.rank_zero_info", printed.append)
    for counts, line in (((3.0, 1.0), True), ((0.0, 0.0), False)):
        metrics = {"train_loss": 1.0, "data/truncated": counts[0], "data/dropped": counts[1]}
        trainer: Any = fake_trainer(tmp_path, callback_metrics=metrics)
        summary = RunSummary(plots=False)
        summary.on_fit_start(trainer, _Module())  # type: ignore[arg-type]
        summary.on_train_batch_end(trainer)
        summary.on_fit_end(trainer, _Module())  # type: ignore[arg-type]
        assert summary.summary["data"] == {"truncated": int(counts[0]), "dropped": int(counts[1])}
        assert ("data  3 sample(s) truncated, 1 dropped" in printed[-1]) is line
        assert ("sample(s) truncated" in printed[-1]) is line


def test_plots_without_validation_warn_nothing(tmp_path: Path) -> None:
    """A run without validation metrics draws an empty accuracy plot without matplotlib's "No
    artists with labels found to put in legend" (printed at the end of every such run)."""
    import warnings

    trainer: Any = fake_trainer(tmp_path, callback_metrics={"train_loss": 1.0})
    summary = RunSummary(plots=True)
    summary.on_fit_start(trainer, _Module())  # type: ignore[arg-type]
    summary.on_train_batch_end(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary.on_fit_end(trainer, _Module())  # type: ignore[arg-type]
    legend = [str(w.message) for w in caught if "legend" in str(w.message)]
    assert not legend, legend  # (other tests' unclosed files may warn here when collected)
    assert (tmp_path / "loss.png").exists() and (tmp_path / "accuracy.png").exists()
