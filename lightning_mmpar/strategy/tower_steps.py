"""The strategy's side of non-colocated towers (``vision_ranks``, Megatron-Bridge MIMO's
layout): set-up, steps, backward, gradient normalisation and clipping on either side.

:class:`TowerSteps` is a mixin of :class:`~lightning_mmpar.strategy.MultimodalParallelStrategy`
(first in its bases). With ``vision_ranks=0`` every method defers to the next class. The data
flow and its messages: :mod:`lightning_mmpar.parallel.towers`. The module implements
``use_tower_role(role, inlet)``, ``tower_blocks()`` and ``tower_inputs(batch)`` (the recipe's
:class:`~lightning_mmpar.recipes.module.ClipLlamaModule` does).

Gradient arithmetic: the language side sends each step's embedding gradients at the scale of
its own parameters' gradients before normalisation (``1 / (micro_batches * accumulate)`` of the
summed losses' gradients), the vision ranks accumulate the tower's gradients from them, and at
the optimizer step multiply their sum over the vision ranks by ``micro_batches * accumulate / N``
(``N``: the step's target tokens, sent by the language side; token losses) or ``1 / dp`` (plain
mean losses): the gradients one process computes on the whole global batch. Under
``vision_data_parallel="fsdp"`` (FSDP2 of the tower over the vision ranks, torchtitan's
``fully_shard`` per block) the sum is FSDP2's reduce-scatter inside backward (divide factor 1),
so only the scaling is left for the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.numerics import clip_grad_norm_, shard_count
from lightning_mmpar.parallel.pipeline.schedules import _drop_parameters
from lightning_mmpar.parallel.towers import (
    TowerExchange,
    TowerInlet,
    shard_tower,
    tower_group,
    zero_on_graph,
)
from lightning_mmpar.topology import ParallelDims, TowerRanks

__all__ = ["TowerSteps"]

_TOWER_METHODS = ("use_tower_role", "tower_blocks", "tower_inputs")


def _params(optimizer: Optimizer) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class TowerSteps(ParallelStrategy):
    """Mixin: non-colocated towers (module docstring)."""

    config: ParallelConfig
    pipeline: Any
    _towers: TowerRanks | None = None
    """``vision_ranks > 0``: the non-colocated layout (set in ``setup_environment``)."""
    _exchange: TowerExchange | None = None
    """This rank's side of the data flow (set in ``setup``)."""
    _inlet: TowerInlet | None = None
    _vision_group: Any = None

    @property
    def parallel_dims(self) -> ParallelDims:
        raise NotImplementedError

    @property
    def _lm(self) -> Any:
        """The LightningModule (typed ``Any``: it also implements the tower methods)."""
        assert self.lightning_module is not None
        return self.lightning_module

    def _tower_setup_environment(self, dims: ParallelDims) -> bool:
        """After the default group exists, before ``configure_model``: give the module its
        role, create the vision ranks' group; on a vision rank every group of ``dims`` is a
        one-rank group. Returns whether this rank is a vision rank (it builds no mesh)."""
        if self.config.vision_ranks == 0:
            self._towers = None
            return False
        towers = self._towers = TowerRanks(dims=dims, vision_ranks=self.config.vision_ranks)
        module = self._lm
        missing = [m for m in _TOWER_METHODS if not callable(getattr(module, m, None))]
        if missing:
            raise TypeError(
                f"vision_ranks={towers.vision_ranks} needs {type(module).__name__} to implement "
                f"{', '.join(_TOWER_METHODS)} (missing {', '.join(missing)}; see "
                "ClipLlamaModule); or set vision_ranks=0."
            )
        vision = towers.is_vision(self.global_rank)
        self._inlet = None if vision else TowerInlet()
        module.use_tower_role("vision" if vision else "language", self._inlet)
        if vision:  # its own groups: the vision ranks', and one-rank groups for every dim
            self._vision_group = tower_group(towers.vision_group_ranks)
            solo = tower_group([self.global_rank])
            dims._groups = dict.fromkeys(("pp", "dp", "edp", "ep", "tp"), solo)
        return vision

    def _tower_split(self, module: Any) -> bool:
        """In ``setup``, before ``parallelize``: drop the other side's parameters and build the
        exchange. Returns whether this is a vision rank (no ``parallelize`` then: its replicas
        start from the first vision rank's tower, broadcast here)."""
        if self._towers is None:
            return False
        if self._exchange is not None:  # a later fit / validate on this strategy
            return self._exchange.is_vision
        tower = module.tower_blocks()
        trains = any(p.requires_grad for b in tower for p in b.parameters())
        exchange = TowerExchange(self._towers, self.global_rank, self.root_device, trains)
        self._exchange = exchange
        if exchange.is_vision:
            _drop_parameters(module, tower, [module])
            for t in (*module.parameters(), *module.buffers()):  # from the first vision rank
                if not t.is_meta:  # the dry run's meta tensors hold no values
                    t.data.copy_(comm.broadcast(t.data, 0, self._vision_group))
            if self.config.vision_data_parallel == "fsdp":
                self._shard_vision(tower)
            return True
        _drop_parameters(module, module.pipeline_blocks(), tower)
        return False

    def _shard_vision(self, tower: list[Any]) -> None:
        """``vision_data_parallel="fsdp"``: FSDP2 of the tower over the vision ranks
        (:func:`~lightning_mmpar.parallel.towers.shard_tower`); the exchange then
        back-propagates a batch without images too (zero gradients), so this rank joins the
        reduce-scatters its peers run inside their backward (``TowerExchange.join_empty``)."""
        shard_tower(tower, self._vision_group, self.root_device.type)
        assert self._exchange is not None
        self._exchange.join_empty = True

    # ------------------------------------------------------------------ steps
    def _tower_batch(self, batch: Any, grad: bool) -> None:
        """A language first-stage rank's images out and the tower's outputs in (the inlet):
        in training the window's images at its first batch (:meth:`_tower_window`), then
        this batch's outputs; in evaluation this batch's, one at a time."""
        ex = self._exchange
        if ex is None or ex.is_vision or not ex.links:
            return
        assert self._inlet is not None
        module = self._lm
        if not grad:
            parts = ex.exchange_once(module.tower_inputs(batch))
            self._inlet.parts = tuple(p.detach() for p in parts)
            return
        window = self._tower_window(batch)
        if window is not None:
            ex.send_window([module.tower_inputs(b) for b in window])
        self._inlet.parts = ex.receive()

    def _tower_window(self, batch: Any) -> tuple[Any, ...] | None:
        """The accumulation window ``batch`` opens (its batches, ``batch`` first), ``None``
        inside one. Without a window loader (``accumulate_grad_batches == 1``) each batch is
        its own window."""
        windows = getattr(self, "_windows", None)
        if windows is None:
            return (batch,)
        entry = windows.peek()
        return entry.batches if entry.first else None

    def _vision_step(self, grad: bool) -> Tensor:
        """A vision rank's step: encode what its links sent (in training one batch of the
        window ahead), send the outputs; returns a zero loss on this batch's tower graph (its
        backward: :meth:`_tower_backward`)."""
        assert self._exchange is not None
        blocks = self._lm.tower_blocks()

        def tower(x: Tensor) -> tuple[Tensor, ...]:
            state: tuple[Tensor, ...] = (x,)
            for block in blocks:
                out = block(*state)
                state = out if isinstance(out, tuple) else (out,)
            return state

        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            ex = self._exchange
            outs = ex.encode(tower) if grad else ex.encode_once(tower)
        return zero_on_graph(outs, torch.zeros((), device=self.root_device))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        ex = self._exchange
        if ex is not None and ex.is_vision:
            return self._vision_step(grad=True)
        self._tower_batch(args[0], grad=True)
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        ex = self._exchange
        if ex is not None and ex.is_vision:
            return self._vision_step(grad=False)
        self._tower_batch(args[0], grad=False)
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        ex = self._exchange
        if ex is not None and ex.is_vision:
            return self._vision_step(grad=False)
        self._tower_batch(args[0], grad=False)
        return super().test_step(*args, **kwargs)

    def on_train_end(self) -> None:
        """Both sides: a run stopped inside an accumulation window leaves the batch encoded
        ahead unused (:meth:`TowerExchange.drain`)."""
        if self._exchange is not None:
            self._exchange.drain()
        super().on_train_end()

    # ------------------------------------------------------------------ gradients
    def _tower_backward(self, piped: bool) -> None:
        """After a backward: a language first-stage rank sends the embeddings' gradients (at
        its parameters' scale: the pipeline's ``1 / (micro_batches * accumulate)``, else
        already Lightning's ``1 / accumulate``); a vision rank back-propagates them."""
        ex = self._exchange
        if ex is None:
            return
        if ex.is_vision:
            ex.backward()
            return
        if not ex.links:
            return
        scale = 1.0
        if piped:
            accumulate = self._lm.trainer.accumulate_grad_batches
            scale = 1.0 / (self.pipeline.num_micro_batches * accumulate)
        ex.send_gradients(scale)

    def _tower_tokens(self, total: int | None) -> None:
        """Language side, at the optimizer step: the step's target tokens to the vision ranks."""
        ex = self._exchange
        if ex is not None and not ex.is_vision:
            ex.send_tokens(-1.0 if total is None else float(total))

    @torch.no_grad()
    def _normalise_vision(self, optimizer: Any) -> int | None:
        """Vision rank, at the optimizer step: sum the tower's gradients over the vision ranks
        and scale them to the global batch's (module docstring). Under
        ``vision_data_parallel="fsdp"`` the sharded parameters' gradients are already the sum
        (FSDP2's reduce-scatter, divide factor 1): only scaled; the 0-dim ones all-reduced."""
        ex = self._exchange
        assert ex is not None
        if not ex.trains:
            return None
        tokens = ex.receive_tokens()
        dims, c = self.parallel_dims, self.config
        micro = c.layout.num_micro_batches if c.pipeline_parallel > 1 else 1
        accumulate = self._lm.trainer.accumulate_grad_batches
        factor = micro * accumulate / max(tokens, 1.0) if tokens >= 0 else 1.0 / dims.dp
        for p in _params(optimizer):
            if not p.requires_grad:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if isinstance(grad, DTensor):  # FSDP2 shard: the sum over the vision ranks already
                p.grad = grad.mul_(factor)
            else:
                p.grad = comm.all_reduce(grad, "sum", self._vision_group).mul_(factor)
        return int(tokens) if tokens >= 0 else None

    def _tower_clip(self, optimizer: Optimizer, clip_val: float) -> bool:
        """Clip by the norm over both sides (one all-reduce over the world): a language
        parameter weighs ``S * pp / L`` (``S`` its shards, ``L`` the language ranks), a vision
        parameter ``S / V`` (``S = 1``: full copies on ``V`` ranks; ``S = V``: FSDP2 shards,
        one distinct piece per vision rank). Returns whether it clipped."""
        if self._towers is None:
            return False
        params, towers = _params(optimizer), self._towers
        if towers.is_vision(self.global_rank):
            weights = [shard_count(p) / towers.vision_ranks for p in params]
        else:
            lang, pp = towers.dims.world_size, towers.dims.pp
            weights = [shard_count(p) * pp / lang for p in params]
        clip_grad_norm_(params, clip_val, weights=weights)
        return True

    def _tower_data_rank(self) -> tuple[int, int] | None:
        """``(replicas, rank)`` a vision rank's loader uses (its first link's replica: the
        same number of batches as the language ranks), ``None`` on a language rank."""
        towers = self._towers
        if towers is None or not towers.is_vision(self.global_rank):
            return None
        return towers.dims.dp, towers.links_of(self.global_rank)[0].replica
