"""Issue 28: without an accumulation window's token count (a strategy other than
``mm_parallel``) the recipe's caption term under ``accumulate_grad_batches`` is the mean of the
batches' token means (the global token mean would need the tokens of batches not yet seen);
the recipe says so once per fit instead of training a different loss silently. Under
``mm_parallel`` it is exact (tests/unit/recipes/test_accumulation_windows.py) and silent."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_mmpar.recipes.losses import RecipeLoss, accumulation_warning
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import LossConfig
from tests.builders import tiny_fusion_config


def test_the_caption_term_of_accumulated_batches_is_each_batchs_token_mean() -> None:
    """Two batches of 1 and 3 target tokens: each batch's caption term is its own token mean
    (what Lightning then averages over the 2 accumulated batches), not its share of the 4."""
    loss = RecipeLoss(LossConfig(), None)
    logits = torch.zeros(1, 5, 4)
    logits[0, :, 1] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    few = torch.tensor([[0, 1, -100, -100, -100]])
    many = torch.tensor([[0, 1, 1, 1, -100]])
    values = []
    for target in (few, many):
        loss.start_batch(target)
        values.append(float(loss.caption(logits, target)))
    ce = torch.nn.functional.cross_entropy(
        logits[0, :3], torch.ones(3, dtype=torch.long), reduction="none"
    )
    assert values == pytest.approx([float(ce[0]), float(ce.mean())])


def test_accumulating_with_a_caption_term_warns_once_per_fit() -> None:
    note = accumulation_warning(2, LossConfig())
    assert note is not None and note.startswith("accumulate_grad_batches=2: the recipe's caption")
    assert "mean of the 2 batches' token means" in note and "raise data.batch_size" in note
    assert accumulation_warning(1, LossConfig()) is None
    assert accumulation_warning(4, LossConfig(caption_weight=0.0)) is None
    assert accumulation_warning(2, LossConfig(), windows=True) is None
    module = ClipLlamaModule(fusion=tiny_fusion_config(), vocab_size=32)
    module._trainer = SimpleNamespace(accumulate_grad_batches=2, global_step=0)  # type: ignore[assignment]
    with pytest.warns(UserWarning, match=r"accumulate_grad_batches=2: the recipe's caption"):
        module.on_train_start()
    module._trainer = SimpleNamespace(accumulate_grad_batches=1, global_step=0)  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.on_train_start()
    counts = SimpleNamespace(counts_accumulation_windows=True)  # mm_parallel's
    module._trainer = SimpleNamespace(accumulate_grad_batches=2, global_step=0, strategy=counts)  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.on_train_start()
