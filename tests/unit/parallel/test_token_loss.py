"""Per-token loss normalisation on one process: TokenMean, the (sum, count) pair, TokenCount."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mmpar.losses import IGNORE_INDEX, TokenMean, caption_loss, token_mean
from lightning_mmpar.parallel.pipeline import PipelineSteps
from lightning_mmpar.parallel.token_loss import TokenCount, as_token_mean


def _logits_and_labels(rows: list[int], seed: int = 0) -> tuple[Tensor, Tensor]:
    """``[B, 5, 7]`` logits (a leaf) and labels scoring ``rows[i]`` targets of row ``i``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), 5, 7, generator=g).requires_grad_()
    labels = torch.randint(0, 7, (len(rows), 5), generator=g)
    for i, n in enumerate(rows):
        labels[i, 1 + n :] = IGNORE_INDEX
    return logits, labels


def test_caption_loss_is_the_same_mean_and_carries_sum_and_count() -> None:
    logits, labels = _logits_and_labels([4, 1, 0])
    loss = caption_loss(logits, labels)
    mean = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    total = F.cross_entropy(
        logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), reduction="sum"
    )
    assert isinstance(loss, TokenMean)
    assert torch.equal(loss.detach(), mean.detach())  # the mean, bit for bit as before
    assert int(loss.tokens) == 5
    torch.testing.assert_close(loss.token_sum, total, rtol=1e-6, atol=0)
    (grad_sum,) = torch.autograd.grad(loss.token_sum, logits)
    (grad_ref,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(grad_sum, grad_ref, rtol=1e-5, atol=1e-7)


def test_no_target_token_gives_a_zero_sum_with_zero_gradients() -> None:
    logits, labels = _logits_and_labels([0, 0])
    loss = caption_loss(logits, labels)
    assert isinstance(loss, TokenMean) and int(loss.tokens) == 0
    assert torch.isnan(loss.detach())  # the mean of nothing, as F.cross_entropy gives
    loss.token_sum.backward()
    assert float(loss.token_sum.detach()) == 0.0
    assert logits.grad is not None and torch.equal(logits.grad, torch.zeros_like(logits))


def test_operations_on_a_token_mean_give_plain_tensors() -> None:
    loss = token_mean(torch.tensor(6.0), 4)
    assert isinstance(loss, TokenMean) and float(loss) == 1.5
    for derived in (loss * 2, loss + 1, loss.detach(), torch.stack([loss, loss])):
        assert type(derived) is Tensor
    assert float(token_mean(torch.tensor(0.0), 0)) == 0.0  # no token: zero, not NaN
    with pytest.raises(ValueError, match="0-dim"):
        token_mean(torch.ones(2), 3)


def test_as_token_mean_accepts_a_pair_a_token_mean_or_a_scalar() -> None:
    pair = as_token_mean((torch.tensor(9.0), torch.tensor(3)))
    assert isinstance(pair, TokenMean) and float(pair) == 3.0 and int(pair.tokens) == 3
    plain = torch.tensor(2.0)
    assert as_token_mean(plain) is plain
    assert as_token_mean(pair) is pair
    with pytest.raises(ValueError, match="pair"):
        as_token_mean((torch.tensor(1.0), 2, 3))
    with pytest.raises(TypeError, match="tensor or a"):
        as_token_mean(1.5)


def _half(loss: TokenMean) -> TokenMean:
    """What Lightning back-propagates for ``accumulate_grad_batches=2``: the loss / 2."""
    return token_mean(loss.token_sum / 2, loss.tokens)


def test_token_count_turns_summed_gradients_into_the_steps_token_mean() -> None:
    """Two accumulated batches of 2 and 6 tokens, each back-propagated as its sum / 2
    (Lightning's division), then ``finish`` with scale 2: the gradient of the mean over all 8
    tokens, not the mean of the two batch means."""
    x1, x2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 4.0])
    w = nn.Parameter(torch.ones(3))
    count = TokenCount()
    for x, n in ((x1, 2), (x2, 6)):
        count.add(_half(token_mean((w * x).sum() * n, n))).backward()
    assert count.pending
    assert count.finish([w], None, 2.0) == 8
    assert not count.pending
    torch.testing.assert_close(w.grad, (2 * x1 + 6 * x2) / 8)


def test_a_step_mixing_token_and_plain_losses_is_refused() -> None:
    count = TokenCount()
    count.add(token_mean(torch.tensor(2.0), 2))
    with pytest.raises(ValueError, match="both a plain mean"):
        count.add(torch.tensor(1.0))


def test_a_step_of_plain_losses_is_left_alone() -> None:
    w = nn.Parameter(torch.ones(2))
    count = TokenCount()
    count.add((w * 3).sum()).backward()
    assert not count.pending
    assert count.finish([w], None, 4.0) is None
    assert torch.equal(w.grad, torch.full((2,), 3.0))  # type: ignore[arg-type]


def test_the_strategy_skips_a_plain_steps_normalisation_without_asking_for_groups() -> None:
    """A step of plain mean losses costs the strategy nothing at the optimizer step: no
    parameter list, no data-parallel group looked up (``ParallelDims.get_group``), no
    collective; gradients untouched and the step forgotten."""
    from types import SimpleNamespace

    from lightning_mmpar import MultimodalParallelStrategy

    class NoGroups:
        dp = 2

        def get_group(self, name: str) -> None:
            raise AssertionError(f"a plain step looked up the {name!r} group")

    w = nn.Parameter(torch.ones(2))
    strategy = MultimodalParallelStrategy()
    strategy._dims = NoGroups()  # type: ignore[assignment]
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=1))  # type: ignore[assignment]
    strategy._step_tokens.add((w * 3).sum()).backward()
    optimizer = torch.optim.SGD([w], lr=0.1)
    assert strategy.normalise_token_gradients(optimizer) is None
    assert torch.equal(w.grad, torch.full((2,), 3.0))  # type: ignore[arg-type]
    assert not strategy._step_tokens.pending


class _Steps(PipelineSteps):
    """PipelineSteps outside mm_parallel: a (sum, count) loss logs and trains as its mean."""

    def __init__(self) -> None:
        self.logged: dict[str, Tensor] = {}

    def pipeline_inputs(self, batch: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        return (batch,), batch

    def pipeline_blocks(self) -> list[nn.Module]:
        return [nn.Identity()]

    def pipeline_loss(self, out: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        return out.sum(), torch.tensor(4)

    def log(self, name: str, value: Tensor, **kwargs: object) -> None:
        self.logged[name] = value


def test_pipeline_steps_under_other_strategies_use_the_batch_token_mean() -> None:
    steps = _Steps()
    loss = steps.training_step(torch.full((2, 3), 2.0), 0)
    assert isinstance(loss, TokenMean) and float(loss) == 3.0  # 12 / 4 tokens
    assert float(steps.logged["train_loss"]) == 3.0
