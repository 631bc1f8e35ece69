"""Write the captions ``predict`` generates (JSON lines) and report how many name the digit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mmpar.recipes.parallel_env import dp_sum

__all__ = ["CaptionWriter"]


class CaptionWriter(BasePredictionWriter):
    """Collect ``predict_step`` rows (dicts with ``caption``, ``digit``, ``label``).

    Each rank writes ``captions.rank<R>.jsonl`` in ``output_dir`` (tensor- and pipeline-parallel
    peers write identical rows: the last stage's tokens are broadcast to its pipeline peers),
    replacing an earlier run's; global rank 0 removes the files of ranks this world does not have
    (left by a run with more processes);
    the fraction of captions that name the right digit is summed over the data-parallel group
    only and printed. Works at every layout (``predict`` decodes with a key/value cache, through
    the pipeline stages in order under pipeline parallelism).

    Args:
        output_dir: folder of the JSONL files (default: the Trainer's ``default_root_dir``).
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.rows: list[dict[str, Any]] = []
        self.accuracy: float | None = None

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.rows.extend(prediction)

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        out = Path(self.output_dir or trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"captions.rank{trainer.global_rank}.jsonl"
        if trainer.global_rank == 0:  # an earlier, larger world's files would read as this run's
            for old in out.glob("captions.rank*.jsonl"):
                rank = old.name.removeprefix("captions.rank").removesuffix(".jsonl")
                if rank.isdigit() and int(rank) >= trainer.world_size:
                    old.unlink(missing_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        hits = torch.tensor(
            [sum(r.get("digit") == r.get("label") for r in self.rows), len(self.rows)],
            dtype=torch.float,
        )
        hits = dp_sum(trainer, hits)
        self.accuracy = float(hits[0] / hits[1].clamp(min=1))
        examples = "\n".join(f"    label {r.get('label')}: {r['caption']}" for r in self.rows[:5])
        rank_zero_info(
            f"captions: {int(hits[1])} written to {out}/captions.rank*.jsonl; "
            f"{100 * self.accuracy:.1f}% name the right digit\n{examples}"
        )
