"""Issue 28 item 4: under ``mm_parallel`` the recipe's caption term of an optimizer step is the
mean over the target tokens of all its accumulated batches (the strategy counts each window
first, :mod:`lightning_mmpar.parallel.token_windows`); the contrastive / MML terms stay each
batch's own, averaged over the window as Lightning does.

One process, fp32: two ragged batches of different target-token counts accumulated
(``accumulate_grad_batches=2``) against one batch holding both rows.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.recipes.losses import caption_tokens
from tests.recipes import ragged_parity_worker as rpw
from tests.recipes import recipe_faults_worker as rw

TOL = 1e-6  # the loss
GRAD_TOL = 1e-5  # gradients (the parity tests'): worst 1.2e-6 measured, 0.26 before


def _halves() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A 4-row ragged batch and its rows 0-1 and 2-3 (3 and 2 text-only samples: different
    target-token counts)."""
    batch = rpw.batches(1)[0]
    halves = tuple({k: v[r : r + 2] for k, v in batch.items()} for r in (0, 2))
    return batch, halves[0], halves[1]


def _fit(data: list[dict[str, Any]], accumulate: int, **weights: float) -> rw.Recorder:
    module = rw.tiny_module(rpw.VOCAB, **weights)
    strategy = MultimodalParallelStrategy()
    return rw.fit(module, data, strategy=strategy, accumulate=accumulate)


def _close(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    name, ratio = rw.worst_gradient(got, want)
    assert ratio < GRAD_TOL, f"{name}: relative gradient error {ratio:.2e}"


def test_accumulated_caption_is_the_token_mean_of_the_window() -> None:
    """Caption only: two accumulated batches give the gradient and the loss of the one batch
    holding both (before: the mean of the two batches' token means)."""
    whole, first, second = _halves()
    tokens = [int(caption_tokens(b["labels"])) for b in (first, second)]
    assert tokens[0] != tokens[1], tokens
    only = {"contrastive_weight": 0.0, "mml_weight": 0.0}
    got = _fit([first, second], 2, **only)
    want = _fit([whole], 1, **only)
    _close(got.grads, want.grads)
    # each batch logs its share of the window's token mean: their mean is the window's
    loss = sum(got.losses) / 2
    assert abs(loss - want.losses[0]) < TOL * abs(want.losses[0]), (got.losses, want.losses)


def test_a_shorter_last_window_logs_its_token_mean() -> None:
    """An epoch's last window shorter than ``accumulate`` (here one batch of 2): the logged
    ``train_loss`` is the batch's own loss (it was ``accumulate`` times it: each batch logs its
    share of the window's token mean times ``accumulate``); the gradient was right already."""
    from torch.utils.data import DataLoader

    from lightning_mmpar.testing import quiet_trainer

    _, first, _ = _halves()
    only = {"contrastive_weight": 0.0, "mml_weight": 0.0}
    recorder = rw.Recorder()
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(),
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        limit_val_batches=0,
        callbacks=[recorder],
    )
    trainer.fit(rw.tiny_module(rpw.VOCAB, **only), DataLoader([first], batch_size=None))  # type: ignore[arg-type]
    assert trainer.global_step == 1  # Lightning steps on the epoch's last batch
    want = _fit([first], 1, **only)
    assert abs(recorder.losses[0] - want.losses[0]) < TOL * abs(want.losses[0]), (
        recorder.losses,
        want.losses,
    )
    _close(recorder.grads, want.grads)


def test_accumulated_recipe_loss_keeps_its_other_terms_per_batch() -> None:
    """All three terms: the caption term's gradient is the window's token mean (the one batch
    of both), contrastive + MML the mean of each batch's own (as Lightning accumulates)."""
    whole, first, second = _halves()
    got = _fit([first, second], 2)
    caption = _fit([whole], 1, contrastive_weight=0.0, mml_weight=0.0).grads
    coupled = [_fit([b], 1, caption_weight=0.0).grads for b in (first, second)]
    want = {n: caption[n] + (coupled[0][n] + coupled[1][n]) / 2 for n in caption}
    _close(got.grads, want)
