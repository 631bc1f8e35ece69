"""Evaluation of the CLIP-LLaMA recipe: zero-shot accuracy, retrieval, caption accuracy.

Metrics are updated where the last pipeline stage lives and combined over the data-parallel
group only (tp/pp peers hold copies of the same samples); :func:`eval_values` hands them to
every pipeline peer. Retrieval is reported two ways:

* per-pair recall (``i2t_recall@k``, ``t2i_recall@k``): a hit only when the retrieved caption
  is the image's *own* caption. Captions of one digit and template are identical token for
  token, so their features tie and the pair's own caption wins about ``1 / (copies)`` of the
  time: on the 360 held-out digits (36 per class) recall@1 stays low even for a perfect model;
* class recall (``i2t_class_recall@k``, ``t2i_class_recall@k``,
  :class:`~lightning_mmpar.recipes.metrics.ClassRecall`): a hit
  when a retrieved caption (image) names the same digit, i.e. has the query's label. This is
  what zero-shot accuracy measures through retrieval, and what a reader compares with it.

"Caption accuracy" is measured two ways:

* teacher-forced (every layout): at the first caption position whose target is a digit word
  (``five`` or ``5``), the argmax token names the image's digit;
* greedy (every layout, KV-cached): the caption decoded from ``<bos>`` names the digit first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mmpar.data.digits import CLASS_NAMES
from lightning_mmpar.data.tokenizer import WordTokenizer
from lightning_mmpar.parallel import comm
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.metrics import ClassRecall, RetrievalRecall, ZeroShotAccuracy

__all__ = [
    "EVAL_METRICS",
    "RecipeMetrics",
    "digit_token_classes",
    "eval_values",
    "named_digit",
    "teacher_forced_hits",
]

EVAL_METRICS: tuple[str, ...] = (
    "zero_shot_acc",
    "i2t_recall@1",
    "i2t_recall@5",
    "t2i_recall@1",
    "t2i_recall@5",
    "i2t_class_recall@1",
    "i2t_class_recall@5",
    "t2i_class_recall@1",
    "t2i_class_recall@5",
    "caption_acc_tf",
)
"""Evaluation metrics logged as ``val/<name>`` and ``test/<name>``."""


def eval_values(trainer: Any, metrics: RecipeMetrics, owner: bool) -> dict[str, Tensor]:
    """:data:`EVAL_METRICS` of ``metrics`` (computed on the rank ``owner`` of the last
    stage, a collective over its dp group) on every pipeline peer."""
    values = torch.zeros(len(EVAL_METRICS))
    if owner:
        computed = metrics.compute()
        values = torch.tensor([computed[n] for n in EVAL_METRICS])
    values = penv.from_last_stage(trainer, values, owner)
    return dict(zip(EVAL_METRICS, values, strict=True))


def digit_token_classes(tokenizer: WordTokenizer, vocab_size: int) -> Tensor:
    """``[V]`` long: the digit class each token names (``five``, ``5``), -1 for other tokens."""
    classes = torch.full((vocab_size,), -1, dtype=torch.long)
    for label, name in enumerate(CLASS_NAMES):
        for word in (name, str(label)):
            ids = tokenizer.encode(word)[1:-1]
            if len(ids) == 1 and ids[0] != tokenizer.unk_id:
                classes[ids[0]] = label
    return classes


def named_digit(ids: Sequence[int], classes: Tensor) -> int:
    """The first digit class named in a token sequence, or -1."""
    for i in ids:
        if 0 <= i < classes.numel() and int(classes[i]) >= 0:
            return int(classes[i])
    return -1


def teacher_forced_hits(
    logits: Tensor, target_ids: Tensor, labels: Tensor, classes: Tensor
) -> Tensor:
    """``[B]`` bool: at the first digit-word target position the prediction names ``labels``."""
    # position t predicts token t + 1; padded vocabulary columns (tensor parallelism pads the
    # vocabulary to a multiple of tp) are never predicted: they have no class entry
    pred = logits[:, :-1, : classes.numel()].argmax(-1)
    tgt = target_ids[:, 1:].clamp(min=0)
    is_digit = classes.to(tgt.device)[tgt] >= 0
    first = torch.where(is_digit.any(1), is_digit.float().argmax(1), torch.zeros_like(labels))
    rows = torch.arange(labels.shape[0], device=labels.device)
    named = classes.to(pred.device)[pred[rows, first]]
    return is_digit.any(1) & (named == labels)


class RecipeMetrics:
    """Zero-shot accuracy, per-pair and class recall@1/@5 both ways and teacher-forced caption
    accuracy over the dp group."""

    def __init__(self, dp_group: dist.ProcessGroup | None) -> None:
        # Without a dp group nothing is combined (torchmetrics would otherwise sync over WORLD,
        # which holds tp/pp peers that never call compute()).
        kw: dict[str, Any] = (
            {"process_group": dp_group} if dp_group is not None else {"sync_on_compute": False}
        )
        self.group = dp_group
        self.zero_shot = ZeroShotAccuracy(**kw)
        self.retrieval = RetrievalRecall(ks=(1, 5), **kw)
        self.class_recall = ClassRecall(ks=(1, 5), **kw)
        self.caption_hits = torch.zeros(2)

    def reset(self) -> None:
        """Forget every sample seen."""
        self.zero_shot.reset()
        self.retrieval.reset()
        self.class_recall.reset()
        self.caption_hits.zero_()

    def update(self, out: Any, target_ids: Tensor, labels: Tensor, classes: Tensor) -> None:
        """One (micro-)batch of :class:`~lightning_mmpar.models.fusion.FusionOutput`."""
        self.zero_shot.update(out.image_features.detach(), out.class_features, labels)
        self.retrieval.update(out.image_features.detach(), out.text_features.detach())
        self.class_recall.update(out.image_features, out.text_features, labels)
        logits = out.logits.full_tensor() if hasattr(out.logits, "full_tensor") else out.logits
        hits = teacher_forced_hits(logits.detach(), target_ids, labels, classes)
        self.caption_hits += torch.tensor([hits.sum().item(), hits.numel()], dtype=torch.float)

    def compute(self) -> dict[str, float]:
        """Every metric over all dp ranks (collective over the dp group)."""
        values = {"zero_shot_acc": float(self.zero_shot.compute())}
        values.update({k: float(v) for k, v in self.retrieval.compute().items()})
        values.update({k: float(v) for k, v in self.class_recall.compute().items()})
        hits = self.caption_hits.clone()
        if self.group is not None:  # None: one dp rank (not the world group)
            comm.all_reduce(hits, "sum", self.group)
        values["caption_acc_tf"] = float(hits[0] / hits[1].clamp(min=1))
        return values
