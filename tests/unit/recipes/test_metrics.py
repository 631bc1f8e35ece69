"""Zero-shot accuracy and retrieval recall on hand-computed examples and torchmetrics' oracle."""

from __future__ import annotations

import math

import pytest
import torch
from torchmetrics.retrieval import RetrievalRecall as OracleRecall

from lightning_mmpar.recipes.metrics import RetrievalRecall, ZeroShotAccuracy, recall_at_k


def _unit(degrees: list[float]) -> torch.Tensor:
    rad = torch.tensor(degrees) * math.pi / 180
    return torch.stack([rad.cos(), rad.sin()], dim=1)


def test_recall_hand_computed() -> None:
    # scores[i, j] = cos(a_i - b_j):
    #   image 0 (0 deg):   t0 .985 (true)  t1 -.940   t2 -.985  -> rank 0
    #   image 1 (90 deg):  t0 .174  t1 -.342 (true)  t2 .174    -> rank 2
    #   image 2 (180 deg): t0 -.985  t1 .940  t2 .985 (true)    -> rank 0
    #   text 1 (200 deg) vs images: -.940, -.342 (true), .940   -> rank 1; texts 0, 2 rank 0
    metric = RetrievalRecall(ks=(1, 2, 3))
    images, texts = _unit([0, 90, 180]), _unit([10, 200, 170])
    metric.update(images[:2], texts[:2])
    metric.update(images[2:], texts[2:])
    out = {k: round(v.item(), 4) for k, v in metric.compute().items()}
    assert out == {
        "i2t_recall@1": round(2 / 3, 4),
        "i2t_recall@2": round(2 / 3, 4),
        "i2t_recall@3": 1.0,
        "t2i_recall@1": round(2 / 3, 4),
        "t2i_recall@2": 1.0,
        "t2i_recall@3": 1.0,
    }


def test_recall_never_counts_ties_as_hits() -> None:
    """Issue 31 item 6(b): a constant model scored recall@1 = 1 (ties were hits); now chance."""
    scores = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    assert recall_at_k(scores, [1, 2]) == {1: torch.tensor(0.5), 2: torch.tensor(1.0)}
    metric = RetrievalRecall(ks=(1, 5))
    metric.update(torch.ones(10, 4), torch.ones(10, 4))  # every feature the same
    assert {k: round(v.item(), 6) for k, v in metric.compute().items()} == {
        "i2t_recall@1": 0.1,
        "i2t_recall@5": 0.5,
        "t2i_recall@1": 0.1,
        "t2i_recall@5": 0.5,
    }
    # a tie with one other candidate, one candidate above: rank 1 or 2 with equal chance
    scores = torch.tensor([[0.5, 0.9, 0.5], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert recall_at_k(scores, [1, 2, 3])[2] == pytest.approx((0.5 + 1 + 1) / 3)


def test_recall_of_nan_features_is_zero() -> None:
    metric = RetrievalRecall(ks=(1, 5))
    metric.update(torch.full((6, 4), float("nan")), torch.randn(6, 4))
    assert all(v.item() == 0.0 for v in metric.compute().values())
    scores = torch.eye(3)
    scores[0, 1] = float("nan")  # a NaN candidate ranks above query 0's match
    assert recall_at_k(scores, [1])[1] == pytest.approx(2 / 3)


def test_recall_matches_torchmetrics_retrieval() -> None:
    g = torch.Generator().manual_seed(0)
    images, texts = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    metric = RetrievalRecall(ks=(1, 5))
    metric.update(images, texts)
    out = metric.compute()
    scores = torch.nn.functional.normalize(images, dim=-1)
    scores = scores @ torch.nn.functional.normalize(texts, dim=-1).T
    for direction, s in (("i2t", scores), ("t2i", scores.T)):
        for k in (1, 5):
            oracle = OracleRecall(top_k=k)
            query = torch.arange(12).repeat_interleave(12)
            oracle.update(s.reshape(-1), torch.eye(12, dtype=torch.bool).reshape(-1), query)
            torch.testing.assert_close(out[f"{direction}_recall@{k}"], oracle.compute())


def test_zero_shot_accuracy_hand_computed_and_prompt_ensemble() -> None:
    classes = torch.eye(3)
    images = torch.tensor([[1.0, 0.2, 0.0], [0.9, 1.0, 0.0], [0.0, 0.5, 0.4], [0.1, 0.0, 1.0]])
    labels = torch.tensor([0, 0, 2, 2])
    top1, top2 = ZeroShotAccuracy(), ZeroShotAccuracy(top_k=2)
    for metric in (top1, top2):
        metric.update(images[:2], classes, labels[:2])
        metric.update(images[2:], classes, labels[2:])
    # top-1 predictions: 0, 1, 1, 2 -> 2 of 4; top-2 adds class 0 for image 1, class 2 for 2.
    assert top1.compute().item() == pytest.approx(0.5)
    assert top2.compute().item() == pytest.approx(1.0)
    # Two prompts per class whose normalised mean is the class axis again.
    prompts = torch.stack([classes + 0.5 * classes.roll(1, 0), classes - 0.5 * classes.roll(1, 0)])
    ensemble = ZeroShotAccuracy()
    ensemble.update(images, prompts.transpose(0, 1), labels)
    assert ensemble.compute().item() == pytest.approx(0.5)


def test_metric_errors() -> None:
    with pytest.raises(ValueError, match=r"top_k \(4\) exceeds the number of classes \(3\)"):
        ZeroShotAccuracy(top_k=4).update(torch.randn(2, 3), torch.eye(3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"top_k \(0\) must be >= 1"):
        ZeroShotAccuracy(top_k=0)
    with pytest.raises(ValueError, match=r"ks \(0, 5\) must be"):
        RetrievalRecall(ks=(0, 5))
    with pytest.raises(ValueError, match=r"image_features \(2, 3\) and text_features \(3, 3\)"):
        RetrievalRecall().update(torch.randn(2, 3), torch.randn(3, 3))
