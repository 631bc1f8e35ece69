"""End-of-run summary: layout, steps, time, accuracy, checkpoint; JSON and plots next to the logs.

Collects every logged scalar per step (training terms) and per validation, and at the end of
``fit`` (rank 0): prints a summary, writes ``summary.json`` and, when matplotlib is installed,
``loss.png`` and ``accuracy.png`` into the logger's directory (or ``default_root_dir``). When the
module can generate (``generate_accuracy(dataloader)``, any layout: KV-cached greedy decoding,
through the pipeline stages under pipeline parallelism), the greedy caption accuracy over the
validation set is measured first (a collective over all ranks); with a question task (a data
module with ``prompts``, e.g. ``DigitsVQA``) the exact match of the greedy answers to the
held-out questions instead (``answer_accuracy``, every rank decoding in step). Retrieval is
printed per pair (the image's own caption) and by class (a caption naming the same digit,
``i2t_class_recall@1``: comparable with zero-shot accuracy). Data without ``labels`` or without
a validation split gives ``n/a`` where a measure needs them. The summary runs after the training
and its checkpoints: an error in it is one warning on rank 0 with the cause
(:func:`summary_failure`), not a failed ``fit``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["RunSummary", "summary_failure"]


class RunSummary(Callback):
    """Print and save a run summary (``summary.json``) and loss/accuracy plots.

    Args:
        filename: name of the JSON file written next to the logs.
        plots: draw ``loss.png`` and ``accuracy.png`` (matplotlib).
        caption_batches: validation batches the greedy caption accuracy is measured on (``None``:
            all; ``0``: not measured). Greedy decoding runs one forward per token, through the
            pipeline schedule under pipeline parallelism: the slowest part of a short run.

    Raises:
        ValueError: ``caption_batches`` not None and not an int >= 0.
    """

    def __init__(
        self, filename: str = "summary.json", plots: bool = True, caption_batches: int | None = None
    ) -> None:
        valid = isinstance(caption_batches, int) and not isinstance(caption_batches, bool)
        if caption_batches is not None and (not valid or caption_batches < 0):
            raise ValueError(
                f"caption_batches ({caption_batches!r}) must be an int >= 0 or None (every "
                "validation "
                "batch); use 0 to skip the greedy caption accuracy."
            )
        self.filename = filename
        self.plots = plots
        self.caption_batches = caption_batches
        self.train: list[dict[str, float]] = []
        self.val: list[dict[str, float]] = []
        self._start = 0.0
        self.summary: dict[str, Any] = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    @staticmethod
    def _scalars(trainer: Trainer, prefixes: tuple[str, ...]) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith(prefixes) and getattr(v, "numel", lambda: 1)() == 1
        }

    @override
    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        row = self._scalars(trainer, ("train", "nonfinite", "data/"))
        self.train.append({"step": trainer.global_step, **row})

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            row = self._scalars(trainer, ("val",))
            self.val.append({"step": trainer.global_step, **row})

    def _out_dir(self, trainer: Trainer) -> Path:
        log_dir = trainer.log_dir if trainer.logger is not None else None
        return Path(log_dir or trainer.default_root_dir)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Measure, print and save the summary. Training and its checkpoints are finished by
        now: an error here is a warning naming its cause (rank 0), and ``fit`` returns
        normally (``LIGHTNING_MMPAR_TRACEBACK=1`` re-raises it instead)."""
        try:
            self._summarize(trainer, pl_module)
        except Exception as err:  # a finished run is not failed by its summary
            if os.environ.get("LIGHTNING_MMPAR_TRACEBACK", "") not in ("", "0"):
                raise
            rank_zero_warn(summary_failure(err, trainer.global_step, last_checkpoint(trainer)))

    def _caption_accuracy(self, trainer: Trainer, pl_module: LightningModule) -> float | None:
        """Greedy caption accuracy on ``caption_batches`` validation batches; ``None`` when the
        module cannot generate, there is no validation data or ``caption_batches`` is 0."""
        measure = getattr(pl_module, "generate_accuracy", None)
        data = getattr(trainer, "datamodule", None)
        if measure is None or data is None or self.caption_batches == 0:
            return None
        batches: Any = _val_batches(data)
        if batches is None:
            return None
        if self.caption_batches is not None:
            batches = itertools.islice(batches, self.caption_batches)
        return measure(batches)

    def _summarize(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wall = time.perf_counter() - self._start
        caption = answer = None
        answers = getattr(pl_module, "answer_accuracy", None)
        data = getattr(trainer, "datamodule", None)
        decodes = not _tower_on_own_ranks(trainer)  # else no tower on the language ranks
        if decodes and callable(getattr(data, "prompts", None)):  # a question task: answers
            answer = answers(data) if answers else None
        elif decodes:
            caption = self._caption_accuracy(trainer, pl_module)
        last_val = self.val[-1] if self.val else {}
        ckpt = last_checkpoint(trainer)
        self.summary = {
            "layout": {
                **TrainerTopology.of(trainer).as_dict(),
                "vision_ranks": int(getattr(trainer.strategy.config, "vision_ranks", 0))
                if hasattr(trainer.strategy, "config")
                else 0,
            },
            "steps": trainer.global_step,
            "skipped_steps": getattr(getattr(trainer.strategy, "nonfinite", None), "skipped", 0),
            "wall_time_s": round(wall, 1),
            "zero_shot_acc": last_val.get("val/zero_shot_acc"),
            "caption_acc_greedy": caption,
            "answer_acc_greedy": answer,
            "caption_acc_teacher_forced": last_val.get("val/caption_acc_tf"),
            "retrieval": {k.removeprefix("val/"): v for k, v in last_val.items() if "recall" in k},
            "final_train": self.train[-1] if self.train else {},
            "data": _overflow(self.train),
            "checkpoint": ckpt,
            **_router(trainer),
        }
        if not decodes:
            self.summary["greedy_decoding"] = NOT_DECODED
        out = self._out_dir(trainer)  # collective (trainer.log_dir broadcasts)
        if not trainer.is_global_zero:
            return
        out.mkdir(parents=True, exist_ok=True)
        path = out / self.filename
        path.write_text(
            json.dumps(
                {**self.summary, "history": {"train": self.train, "val": self.val}}, indent=2
            )
        )
        plots = self._plot(out) if self.plots else []
        rank_zero_info(_format(self.summary, path, plots))

    def _plot(self, out: Path) -> list[Path]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return []
        written = []
        for name, rows, keys in (
            (
                "loss.png",
                self.train,
                ("train_loss", "train/contrastive", "train/caption", "train/mml"),
            ),
            (
                "accuracy.png",
                self.val,
                (
                    "val/zero_shot_acc",
                    "val/caption_acc_tf",
                    "val/i2t_recall@1",
                    "val/i2t_class_recall@1",
                ),
            ),
        ):
            fig, ax = plt.subplots(figsize=(6, 4))
            for key in keys:
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True), label=key, marker="." if rows is self.val else None
                    )
            ax.set_xlabel("step")
            if ax.get_legend_handles_labels()[1]:  # no validation yet: no lines, no legend
                ax.legend()
            fig.tight_layout()
            fig.savefig(out / name)
            plt.close(fig)
            written.append(out / name)
        return written


def _format(s: dict[str, Any], path: Path, plots: list[Path]) -> str:
    lay = s["layout"]
    vision = lay.get("vision_ranks", 0)  # the tower's own ranks, beside the language world
    lines = [
        "=" * 72,
        f"run summary  ({lay['strategy']}: world {lay['world'] + vision} = tp {lay['tp']} x pp "
        f"{lay['pp']} x dp {lay['dp']}"
        + (f" (ep {lay['ep']})" if lay.get("ep", 1) > 1 else "")
        + (f" + {vision} vision rank{'s' if vision > 1 else ''}" if vision else "")
        + f", virtual stages {lay['virtual']})",
        f"  steps {s['steps']}"
        + (f" ({s['skipped_steps']} skipped: non-finite)" if s.get("skipped_steps") else "")
        + f"   wall time {s['wall_time_s']} s",
        f"  zero-shot accuracy (held-out digits)  {_pct(s['zero_shot_acc'])}",
        f"  caption names the digit: greedy {_pct(s['caption_acc_greedy'])}, "
        f"teacher-forced {_pct(s['caption_acc_teacher_forced'])}",
        *(
            [f"  answer exact match (held-out questions, greedy)  {_pct(s['answer_acc_greedy'])}"]
            if s.get("answer_acc_greedy") is not None
            else []
        ),
        *([f"  greedy decoding  {s['greedy_decoding']}"] if s.get("greedy_decoding") else []),
        "  retrieval per pair (own caption)  "
        + _recalls({k: v for k, v in s["retrieval"].items() if "class" not in k}),
        "  retrieval by class (same digit)   "
        + _recalls({k: v for k, v in s["retrieval"].items() if "class" in k}),
        *(
            f"  router ({m:6s})  top-1 share {_pct(r['top1_share'])}, entropy "
            f"{r['routing_entropy_bits']:.2f} bits, {r['experts_per_token']:.2f} experts/token, "
            f"dropped {_pct(r['dropped_fraction'])}"
            for m, r in s.get("router", {}).items()
        ),
        *([f"  expert load {s['expert_load_heatmap']}"] if s.get("expert_load_heatmap") else []),
        *(
            [
                f"  data  {s['data']['truncated']} sample(s) truncated, "
                f"{s['data']['dropped']} dropped"
            ]
            if any(s.get("data", {}).values())
            else []
        ),
        f"  checkpoint  {s['checkpoint']}",
        f"  summary     {path}" + "".join(f"\n  plot        {p}" for p in plots),
        "=" * 72,
    ]
    return "\n".join(lines)


def _overflow(train: list[dict[str, float]]) -> dict[str, int]:
    """The last logged ``data/truncated`` and ``data/dropped`` (cumulative; 0 when not
    logged)."""
    last = train[-1] if train else {}
    return {k: int(last.get(f"data/{k}", 0)) for k in ("truncated", "dropped")}


NOT_DECODED = (
    "not run: the vision tower is on ranks of its own (vision_ranks), so the language ranks "
    "cannot encode the prompts' images; evaluate the checkpoint colocated for it"
)
"""The summary's note in place of greedy accuracy under non-colocated towers."""


def _tower_on_own_ranks(trainer: Trainer) -> bool:
    """Whether the run put the vision tower on ranks of its own (``vision_ranks > 0``)."""
    config = getattr(trainer.strategy, "config", None)
    return bool(getattr(config, "vision_ranks", 0))


def last_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint the run's ``ModelCheckpoint`` wrote: ``last.ckpt`` with
    ``save_last``, else its best (the latest one without a monitored metric); ``None``."""
    callback = trainer.checkpoint_callback
    last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    return last or None


def summary_failure(err: BaseException, steps: int, checkpoint: str | None) -> str:
    """The warning of a run summary that raised ``err`` after ``steps`` finished steps: the
    cause, and that the training and its checkpoint are kept."""
    kept = f"its last checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
    return (
        f"RunSummary: the end-of-run summary failed ({type(err).__name__}: {err}). Training "
        f"finished ({steps} steps) and {kept}; only the summary (summary.json, plots, greedy "
        "caption accuracy) is missing. LIGHTNING_MMPAR_TRACEBACK=1 re-raises it with its "
        "traceback."
    )


def _val_batches(data: Any) -> Any:
    """``data.val_dataloader()``; ``None`` when the data module has no validation split (no
    ``val_dataloader`` of its own, or a caption module without ``val_file`` / ``val_shards``:
    its ``datasets`` hold no ``"val"``)."""
    if isinstance(data, LightningDataModule) and not is_overridden("val_dataloader", data):
        return None
    datasets = getattr(data, "datasets", None)
    if isinstance(datasets, Mapping) and "val" not in datasets:
        return None
    return data.val_dataloader()


def _router(trainer: Trainer) -> dict[str, Any]:
    """Per-modality router statistics and the heatmap path of an ``ExpertLoadMonitor`` among
    the Trainer's callbacks (duck-typed: ``modality_summary``); empty without one."""
    for cb in getattr(trainer, "callbacks", ()):
        if callable(getattr(cb, "modality_summary", None)):
            path = getattr(cb, "heatmap_path", None)
            return {"router": cb.modality_summary(), "expert_load_heatmap": path and str(path)}
    return {}


def _recalls(values: dict[str, float]) -> str:
    """``i2t_recall@1 18.1%  ...``; ``n/a`` when none was measured (data without labels)."""
    return "  ".join(f"{k} {_pct(v)}" for k, v in values.items()) or "n/a"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
