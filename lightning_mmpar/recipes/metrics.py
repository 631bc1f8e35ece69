"""Evaluation metrics of the CLIP-LLaMA recipe as torchmetrics ``Metric`` subclasses.

Being torchmetrics metrics, their states are synchronised across ranks at ``compute()``; pass
``process_group=<dp group>`` so that only data-parallel peers (who hold different samples) are
combined, never tensor/pipeline peers (who hold copies of the same samples).

* :class:`ZeroShotAccuracy`: ``argmax_c <u_i, w_c>`` over class-prompt text features ``w_c``.
* :class:`RetrievalRecall`: image->text and text->image recall@k over the whole evaluation
  set, pairs ``(u_i, v_i)`` matched by position;
* :class:`ClassRecall`: the same retrieval, a hit when the retrieved item has the query's class.
* :class:`AnswerAccuracy`: exact match of generated answers (the digits question task).

Wired into the recipe's validation and test steps by
:class:`~lightning_mmpar.recipes.evaluation.RecipeMetrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

__all__ = [
    "AnswerAccuracy",
    "ClassRecall",
    "RetrievalRecall",
    "ZeroShotAccuracy",
    "normalise_answer",
    "recall_at_k",
]


class ZeroShotAccuracy(Metric):
    """Top-k accuracy of zero-shot classification with class-prompt text features.

    ``update(image_features [n, d], class_features [C, d] or [C, P, d], labels [n])``; with P
    prompts per class their normalised mean is the class embedding (CLIP's prompt ensemble).
    Extra keyword arguments (``process_group``, ``sync_on_compute``...) go to ``Metric``.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, *, top_k: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if top_k < 1:
            raise ValueError(f"top_k ({top_k}) must be >= 1.")
        self.top_k = top_k
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(
        self, image_features: torch.Tensor, class_features: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """Score a batch of images against every class embedding."""
        if class_features.ndim == 3:
            class_features = F.normalize(F.normalize(class_features, dim=-1).mean(1), dim=-1)
        if class_features.shape[0] < self.top_k:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the number of classes ({class_features.shape[0]})."
            )
        scores = F.normalize(image_features, dim=-1) @ F.normalize(class_features, dim=-1).T
        top = scores.topk(self.top_k, dim=-1).indices
        self.correct += (top == labels.view(-1, 1)).any(dim=-1).sum()
        self.total += labels.numel()

    def compute(self) -> torch.Tensor:
        """Fraction of images whose label is among the top-k classes."""
        return self.correct.float() / self.total.clamp(min=1)


def recall_at_k(scores: torch.Tensor, ks: Sequence[int]) -> dict[int, torch.Tensor]:
    """Recall@k of the square score matrix ``scores[i, j]`` where item ``i`` matches ``j = i``.

    Ties never count as hits: they are ranked in every order with equal probability, so a
    query whose match ties with ``t`` other candidates, ``g`` scoring strictly higher, is a
    hit at ``k`` with probability ``clamp(k - g, 0, t + 1) / (t + 1)`` (the tie-aware expected
    recall of McSherry & Najork, "Computing Information Retrieval Performance Measures
    Efficiently in the Presence of Tied Scores", ECIR 2008). A constant model (every score
    tied) scores chance, ``min(k, n) / n``; two copies of one pair (the duplicates a
    distributed sampler adds to even out ranks) share the credit. A non-finite match score
    (NaN features) is a miss, and a non-finite candidate ranks above the match, so a NaN model
    scores 0. Returns ``{k: recall}`` (0-dim float tensors in [0, 1]).
    """
    positive = scores.diagonal().unsqueeze(1)
    above = ((scores > positive) | ~scores.isfinite()).sum(dim=1)
    tied = (scores == positive).sum(dim=1)  # the match included
    finite = positive.squeeze(1).isfinite()
    out = {}
    for k in ks:
        hit = (k - above).clamp(min=0).minimum(tied) / tied.clamp(min=1)
        out[k] = torch.where(finite, hit.float(), 0.0).mean()
    return out


class RetrievalRecall(Metric):
    """Image->text and text->image recall@k over all pairs seen (all dp ranks).

    ``update(image_features [n, d], text_features [n, d])``: row ``i`` of both is a pair.
    ``compute()`` returns ``{"i2t_recall@k": ..., "t2i_recall@k": ...}`` for each ``k``. The
    features of the whole evaluation set are kept (``n_total x d`` each) until ``reset()``.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    image_features: list[torch.Tensor]
    text_features: list[torch.Tensor]

    def __init__(self, *, ks: Sequence[int] = (1, 5), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"ks {tuple(ks)} must be a non-empty list of integers >= 1.")
        self.ks = tuple(ks)
        self.add_state("image_features", default=[], dist_reduce_fx="cat")
        self.add_state("text_features", default=[], dist_reduce_fx="cat")

    def update(self, image_features: torch.Tensor, text_features: torch.Tensor) -> None:
        """Store a batch of L2-normalised pairs."""
        if image_features.ndim != 2 or image_features.shape != text_features.shape:
            raise ValueError(
                f"image_features {tuple(image_features.shape)} and text_features "
                f"{tuple(text_features.shape)} must both be [batch, dim] with equal shapes."
            )
        self.image_features.append(F.normalize(image_features.detach(), dim=-1))
        self.text_features.append(F.normalize(text_features.detach(), dim=-1))

    def compute(self) -> dict[str, torch.Tensor]:
        """Recall@k in both directions."""
        scores = dim_zero_cat(self.image_features) @ dim_zero_cat(self.text_features).T
        i2t = recall_at_k(scores, self.ks)
        t2i = recall_at_k(scores.T, self.ks)
        out = {f"i2t_recall@{k}": v for k, v in i2t.items()}
        out.update({f"t2i_recall@{k}": v for k, v in t2i.items()})
        return out


class ClassRecall(Metric):
    """Image->text and text->image *class* recall@k over every pair seen (all dp ranks).

    ``update(image_features [n, d], text_features [n, d], labels [n])``: row ``i`` of the
    features is a pair, ``labels[i]`` its class. For image query ``i`` the captions are ranked
    by cosine similarity; it is a hit at ``k`` when one of the top ``k`` has label
    ``labels[i]`` (text->image alike over images). Unlike per-pair recall
    (:class:`RetrievalRecall`), the many identical captions of one
    class do not count as misses. Ties are broken by ``torch.topk``. ``compute()`` returns
    ``{"i2t_class_recall@k": ..., "t2i_class_recall@k": ...}`` (fractions in [0, 1]).

    Raises:
        ValueError: bad ``ks`` or mismatched shapes in ``update``.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    image_features: list[torch.Tensor]
    text_features: list[torch.Tensor]
    labels: list[torch.Tensor]

    def __init__(self, *, ks: Sequence[int] = (1, 5), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"ClassRecall ks {tuple(ks)} must be integers >= 1, e.g. (1, 5).")
        self.ks = tuple(ks)
        for name in ("image_features", "text_features", "labels"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(
        self, image_features: torch.Tensor, text_features: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """Store a batch of pairs and their labels."""
        n = image_features.shape[0]
        if image_features.shape != text_features.shape or labels.shape != (n,):
            raise ValueError(
                f"ClassRecall.update: image_features {tuple(image_features.shape)}, "
                f"text_features {tuple(text_features.shape)} and labels {tuple(labels.shape)} "
                "must be [n, d], [n, d] and [n]."
            )
        self.image_features.append(F.normalize(image_features.detach().float(), dim=-1))
        self.text_features.append(F.normalize(text_features.detach().float(), dim=-1))
        self.labels.append(labels.detach().long())

    def compute(self) -> dict[str, torch.Tensor]:
        """Class recall@k both ways (``k`` capped at the number of pairs)."""
        labels = dim_zero_cat(self.labels)
        scores = dim_zero_cat(self.image_features) @ dim_zero_cat(self.text_features).T
        out = {}
        for name, s in (("i2t", scores), ("t2i", scores.T)):
            for k in self.ks:
                top = s.topk(min(k, s.shape[1]), dim=1).indices
                hits = (labels[top] == labels[:, None]).any(1)
                out[f"{name}_class_recall@{k}"] = hits.float().mean()
        return out


def normalise_answer(text: str) -> str:
    """``text`` lower-cased with runs of whitespace collapsed (exact-match comparison form)."""
    return " ".join(text.lower().split())


class AnswerAccuracy(Metric):
    """Exact-match accuracy of generated answers (VQA-style, after :func:`normalise_answer`).

    ``update(predicted: list[str], expected: list[str])``; ``compute()`` is the fraction of
    predictions equal to their expected answer (0 before any update). Extra keyword arguments
    (``process_group``...) go to ``Metric``.

    Raises:
        ValueError: (``update``) lists of different lengths.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, predicted: Sequence[str], expected: Sequence[str]) -> None:
        """Count the exact matches of a batch of answers."""
        if len(predicted) != len(expected):
            raise ValueError(
                f"AnswerAccuracy: {len(predicted)} predictions for {len(expected)} answers; "
                "pass one prediction per question."
            )
        pairs = zip(predicted, expected, strict=True)
        hits = sum(normalise_answer(p) == normalise_answer(e) for p, e in pairs)
        self.correct += hits
        self.total += len(expected)

    def compute(self) -> torch.Tensor:
        """Fraction of exact matches."""
        return self.correct.float() / self.total.clamp(min=1)
