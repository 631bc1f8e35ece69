"""Lightning steps of a :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`, run by the
strategy: through the pipeline schedule (``pp > 1``) or as one chunk of every block (``pp == 1``).

:class:`PipelinedSteps` is a mixin of
:class:`~lightning_mmpar.strategy.MultimodalParallelStrategy`. A module that is no
``PipelineModule`` runs its own steps (Lightning's). A pipelined training step keeps the
schedule's gradients aside (:class:`~lightning_mmpar.strategy.gradient_stash.GradientStash`)
until the strategy's ``backward``; every step logs ``train_loss`` / ``val_loss`` /
``test_loss``, the per-sample mean over the data-parallel group (:meth:`PipelinedSteps._log`);
the mean of the ranks' shares for a module whose loss is each rank's share of the global
batch's (``loss_is_dp_share = True``, the recipe's); or, for a ``pipeline_loss`` that returns
``(sum, token count)`` or a :class:`~lightning_mmpar.parallel.token_loss.TokenMean`, the mean
over the batch's target tokens on every dp rank.

Token losses, from a pipelined module or from any module's own ``training_step`` (a
``TokenMean``, e.g. :func:`lightning_mmpar.losses.caption_loss`'s result, alone or as a dict's
``"loss"``), are recorded in the strategy's
:class:`~lightning_mmpar.parallel.token_loss.TokenCount` and back-propagated as sums; the
strategy divides the gradients by the step's target tokens after the last backward.

A module whose loss adds other terms to a token mean (the recipe's caption, contrastive and MML
terms) needs the step's target tokens before its first backward. It defines
``target_tokens(batch)`` (a batch's target tokens, counted as its loss counts them) and
``on_accumulation_window(tokens)``; under ``accumulate_grad_batches > 1`` the strategy then reads
the training loader one accumulation window at a time
(:class:`~lightning_mmpar.parallel.token_windows.WindowLoader`), sums each window's tokens over
the data-parallel group once and hands the sum to ``on_accumulation_window`` before the window's
first batch (Hugging Face transformers' ``num_items_in_batch``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.finite import NonFiniteGuard
from lightning_mmpar.parallel.pipeline import PipelineChunk, PipelineEngine
from lightning_mmpar.parallel.token_loss import TokenCount, TokenMean, as_token_mean
from lightning_mmpar.parallel.token_windows import WindowLoader, window_loader
from lightning_mmpar.strategy.gradient_stash import GradientStash
from lightning_mmpar.topology import ParallelDims

__all__ = ["PipelinedSteps"]

_WINDOW_HOOKS = ("target_tokens", "on_accumulation_window")


def _no_tokens(batch: Any) -> int:
    """The window loader's count for a module that counts no target tokens."""
    return 0


class PipelinedSteps(Strategy):
    """Mixin: training, validation and test steps of a pipelined module (module docstring)."""

    pipeline: PipelineEngine | None
    _chunk: PipelineChunk | None
    _stash: GradientStash
    nonfinite: NonFiniteGuard | None
    _step_tokens: TokenCount
    _windows: WindowLoader | None = None
    _counts_windows = False
    """Whether the module counts its windows' target tokens (``_WINDOW_HOOKS``)."""
    _window_batches = 0
    """Batches of the current training batch's accumulation window."""
    counts_accumulation_windows = True
    """A module with ``target_tokens`` and ``on_accumulation_window`` gets each accumulation
    window's target tokens before the window's first batch (module docstring)."""

    @property
    def parallel_dims(self) -> ParallelDims:
        """The run's layout (the strategy's)."""
        raise NotImplementedError

    @property
    def _module(self) -> Any:
        """The LightningModule (typed ``Any``: it also implements ``PipelineModule``)."""
        assert self.lightning_module is not None
        return self.lightning_module

    def _pipelined(self) -> bool:
        return self.pipeline is not None or self._chunk is not None

    def _loss(self, batch: Any, train: bool) -> Tensor:
        """The step's loss through the pipeline schedule or the one-chunk model, inside the
        precision plugin's step context (``bf16-mixed``: autocast), as Lightning's own
        ``Strategy.training_step`` runs ``LightningModule.training_step``."""
        plugin = self.precision_plugin
        context = plugin.train_step_context() if train else plugin.val_step_context()
        with context:
            return self._schedule_loss(batch, train)

    def _schedule_loss(self, batch: Any, train: bool) -> Tensor:
        module = self._module
        if self.pipeline is not None:
            return self.pipeline.train_step(batch) if train else self.pipeline.eval_step(batch)
        assert self._chunk is not None
        inputs, target = module.pipeline_inputs(batch)
        return as_token_mean(module.pipeline_loss(self._chunk(*inputs), target))

    def _log(self, name: str, loss: Tensor, batch: Any) -> None:
        """Log the loss of the data-parallel group's global batch, identical on every rank.

        A per-sample mean: each dp rank contributes ``(loss * B_r, B_r)`` and the value is
        their ratio, the mean over the global batch's samples (rows) as on one process. A module
        with ``loss_is_dp_share = True`` returns on each rank its share of the global batch's
        loss, already scaled by ``dp`` (the recipe's caption term, ``sum_CE_r / N * dp``): the
        value is the plain mean of the ranks' shares, whatever rows each rank holds (weighting
        them by rows is wrong when packing gives the ranks different row counts). A
        :class:`~lightning_mmpar.parallel.token_loss.TokenMean` contributes ``(sum, tokens)``:
        the value is the token mean of the global batch. The logged ``batch_size`` is the
        global batch (samples; tokens for a ``TokenMean``), so Lightning's epoch mean of
        validation/test losses weighs every batch by its size, as on one process (not a mean
        of batch means).
        """
        share = not isinstance(loss, TokenMean) and self._dp_share_loss()
        if isinstance(loss, TokenMean):
            pair = torch.stack([loss.token_sum.detach().double(), loss.tokens.double()])
        else:
            samples = float(extract_batch_size(batch))
            weight = 1.0 if share else samples
            pair = torch.stack([loss.detach().float() * weight, loss.new_tensor(samples).float()])
        group = self.parallel_dims.get_group("dp")
        pair = comm.all_reduce(pair, "sum", group)  # one [2] sum, whatever the kind of loss
        divisor = float(comm.group_size(group)) if share else pair[1].clamp(min=1)
        value = (pair[0] / divisor).float()
        self._module.log(name, value, prog_bar=True, batch_size=int(pair[1].item()))

    def _dp_share_loss(self) -> bool:
        """The module's loss is each dp rank's share of the global batch's (``_log``)."""
        return bool(getattr(self._module, "loss_is_dp_share", False))

    def _backward_loss(self, out: Any) -> Any:
        """A training step's result with a token loss replaced by its sum (recorded for the
        step's normalisation); unchanged under manual optimisation."""
        if not self._module.automatic_optimization:
            return out
        if isinstance(out, dict) and isinstance(out.get("loss"), Tensor):
            return {**out, "loss": self._step_tokens.add(out["loss"])}
        return self._step_tokens.add(out) if isinstance(out, Tensor) else out

    def _windowed(self, dataloader: Any, trainer: Any) -> Any:
        """The training loader, read one accumulation window at a time for a module that
        counts its target tokens (module docstring) and on the language ranks of
        non-colocated towers (they send a window's images at its first batch,
        :mod:`lightning_mmpar.parallel.towers`); unchanged otherwise and on vision ranks."""
        module = self._module
        self._windows = None
        self._counts_windows = all(callable(getattr(module, n, None)) for n in _WINDOW_HOOKS)
        exchange = getattr(self, "_exchange", None)  # non-colocated towers (TowerSteps)
        if exchange is not None and exchange.is_vision:
            return dataloader  # a vision rank's batches only count steps
        if trainer.accumulate_grad_batches <= 1 or not (self._counts_windows or exchange):
            return dataloader
        loop = trainer.fit_loop

        def position() -> tuple[int, float]:
            return loop.epoch_loop.batch_progress.current.ready, trainer.num_training_batches

        count = module.target_tokens if self._counts_windows else _no_tokens
        self._windows = window_loader(dataloader, trainer.accumulate_grad_batches, count, position)
        return self._windows

    def _start_window(self) -> None:
        """Before a training batch: at a window's first batch, its target tokens summed over
        the dp group (one all-reduce per window) go to the module's ``on_accumulation_window``."""
        if self._windows is None:
            return
        self._window_batches = len(self._windows.peek().batches)
        tokens, first = self._windows.pop()
        if first and self._counts_windows:
            total = torch.tensor(float(tokens), dtype=torch.float64, device=self.root_device)
            total = comm.all_reduce(total, "sum", self.parallel_dims.get_group("dp"))
            self._module.on_accumulation_window(int(total))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._start_window()
        if self.nonfinite is not None and args:
            idx = args[1] if len(args) > 1 else self._module.trainer.fit_loop.batch_idx
            self.nonfinite.observe_batch(args[0], idx)
        if not self._pipelined():
            return self._backward_loss(super().training_step(*args, **kwargs))
        if self.pipeline is None:
            loss = self._loss(args[0], train=True)
        else:  # Lightning zeroes gradients before backward(): keep the schedule's aside
            params = list(self._module.parameters())
            loss = self._stash.capture(params, lambda: self._loss(args[0], train=True))
        self._log("train_loss", self._shown_loss(loss), args[0])
        return self._backward_loss(loss)

    def _shown_loss(self, loss: Tensor) -> Tensor:
        """The training loss as logged: a module that counts its windows returns each batch's
        share of the window's token mean times ``accumulate`` (Lightning divides by it); in an
        epoch's last, shorter window of ``L`` batches that is ``accumulate / L`` times the
        batches' mean, so the logged value is scaled by ``L / accumulate`` (a full window: 1)."""
        if self._windows is None or not self._counts_windows or isinstance(loss, TokenMean):
            return loss
        accumulate = self._module.trainer.accumulate_grad_batches
        return loss * (self._window_batches / accumulate) if self._window_batches else loss

    def _eval_loss(self, name: str, batch: Any) -> Tensor:
        loss = self._loss(batch, train=False)
        self._log(name, loss, batch)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._pipelined():
            return super().validation_step(*args, **kwargs)
        return self._eval_loss("val_loss", args[0])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._pipelined():
            return super().test_step(*args, **kwargs)
        return self._eval_loss("test_loss", args[0])
