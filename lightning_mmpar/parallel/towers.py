"""Non-colocated towers: the vision tower on ranks of its own (Megatron-Bridge MIMO's layout).

The layout (:class:`~lightning_mmpar.topology.TowerRanks`): language ranks ``0 .. L - 1`` laid
out by tp x pp x dp as usual, then ``V`` vision ranks, each holding the whole vision tower
(the module's leading blocks of kind ``"vision"``). One optimizer step (an accumulation
window of ``A`` batches, ``accumulate_grad_batches``), per
:class:`~lightning_mmpar.topology.TowerLink` (replica ``r``'s images, or a chunk of them, and
one vision rank)::

    language stage 0, tp rank 0 --A, pixels of batches 1..A--> vision rank      (isend_tensor)
    for batch k of the window:
      vision rank: tower(all its links' pixels of batch k + 1 as ONE batch)  (k = 1: also k)
      vision rank --parts of k + 1--> every tp rank of replica r's first stage (isend_tensor)
      language: TowerInlet puts the parts of k into the image slots; the schedule runs
      language stage 0, tp rank 0 --d loss / d parts of k--> vision rank       (isend_tensor)
      vision rank, at batch k + 1's start (k = A: now): autograd.backward(parts of k, gradients)
    optimizer step: the tower's gradients summed over the vision ranks

The vision rank encodes batch ``k + 1`` while the language ranks run batch ``k`` (one batch
ahead, as the first stage of a 1F1B pipeline runs ahead of the second) and back-propagates
batch ``k`` while they run ``k + 1``; exact, since no weight changes inside a window. With
``A = 1`` the exchange is serial. Evaluation batches go one at a time; a language rank first
receives and holds the batch encoded ahead, so the messages never cross (gloo and NCCL match
point-to-point messages between two ranks in order; a blocking send waits for its receive,
hence the non-blocking sends of images and parts).

Point-to-point sends with a shape header (:func:`~lightning_mmpar.parallel.comm.send_tensor`),
not an all-to-all: each message has one sender and one receiver whose counts differ per step
(ragged, zero included), the two sides run different programs (an all-to-all would make every
rank wait for every other), and no rank outside a link joins it. Pixels cross the wire rather
than each vision rank reading its own data: the language replica that owns a sample's text
owns its images, the data pipeline stays as it is, and pixels are usually fewer values than
the embeddings they become (3 x 336^2 = 0.34 M against 577 x 1024 = 0.59 M for a ViT-L/14 at
336 px). The cut falls after the tower's last block, before the projector: tokens travel at
the ViT's width, usually narrower than the decoder's, and the projector's parameters keep
their names (checkpoints move between layouts).

A frozen tower (no trainable vision parameter) sends no gradient and runs no backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.data import shard_placement
from lightning_mmpar.topology import TowerLink, TowerRanks, chunk_sizes

__all__ = [
    "TowerExchange",
    "TowerInlet",
    "image_index",
    "shard_tower",
    "share_metrics",
    "tower_block_count",
    "tower_group",
    "zero_on_graph",
]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
Tower = Callable[[Tensor], tuple[Tensor, ...]]
"""The vision tower as the vision ranks run it: pixels ``[n, C, H, W]`` -> its outputs."""


def tower_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """A process group of ``ranks`` (the vision ranks, or one rank), created by its members
    only (``use_local_synchronization``: the language ranks never call it, so no rank waits on
    a group-creation barrier of the whole world) and once per default group (a later
    ``Trainer`` in the same processes reuses it: a second creation would take the same name)."""
    key = (id(dist.group.WORLD), *ranks)
    if key not in _GROUPS:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        assert isinstance(group, dist.ProcessGroup), "only members create it"
        _GROUPS[key] = group
    return _GROUPS[key]


def shard_tower(blocks: Sequence[nn.Module], group: dist.ProcessGroup, device_type: str) -> None:
    """FSDP2 of the vision tower over the vision ranks (``vision_data_parallel="fsdp"``):
    torch's ``fully_shard`` on each block with parameters over a 1-D mesh of ``group``
    (dimension ``"vision"``), shards placed by
    :func:`~lightning_mmpar.parallel.data.shard_placement`, 0-dim parameters left replicated
    (their gradients are all-reduced by the strategy). Each block is its own FSDP root (the
    vision ranks call the blocks, not a module around them), so ``reshard_after_forward=True``
    is explicit: the backward gathers again, as for a colocated block (torchtitan's default).
    Gradients are reduce-scattered in their own dtype as a plain **sum** (divide factor 1, sum
    reduction: the strategy scales the sum to the one-process gradients), zeros for a
    parameter without gradient (a rank that encoded no image still joins every
    reduce-scatter). Collective over ``group`` (its members only)."""
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("vision",))
    size = mesh.size()
    for block in blocks:
        params = list(block.parameters())
        ignored = {p for p in params if p.ndim == 0}
        if len(ignored) == len(params):
            continue  # no parameter, or only scalars: nothing to shard
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=True,
            shard_placement_fn=lambda p: shard_placement(p, size),
            ignored_params=ignored or None,
        )
        assert isinstance(block, FSDPModule)
        block.set_gradient_divide_factor(1.0)
        block.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: sum, no divide
        block.set_reduce_scatter_unused_params(True)


def zero_on_graph(tensors: Iterable[Tensor], zero: Tensor) -> Tensor:
    """``zero`` (zeros of any shape, e.g. ``t.new_zeros(())``) plus ``t.sum() * 0`` for each of
    ``tensors``: zeros whose backward reaches every one of them with zero gradients. A rank with
    nothing to compute (a vision rank's loss, a vision rank or a language micro-batch without
    an image) still runs the backward its peers run, and so joins the collectives inside it
    (FSDP2's reduce-scatters). The one home of this loss: the strategy's vision step, the
    exchange's backward without images and :class:`TowerInlet` use it."""
    return sum((t.sum() * 0.0 for t in tensors), zero)


def share_metrics(values: Mapping[str, float] | None) -> dict[str, float]:
    """Global rank 0's ``values`` (a language rank's evaluation metrics) on every rank: the
    vision ranks compute no loss, so without it their ``trainer.validate`` / ``test`` returned
    zeros. ``values`` is read on rank 0 only (the others pass ``None``); a collective over the
    default group (:func:`~lightning_mmpar.parallel.comm.all_gather_objects`): every rank calls
    it, once per evaluation epoch."""
    return dict(comm.all_gather_objects(dict(values or {}))[0])


def tower_block_count(blocks: Sequence[nn.Module]) -> int:
    """How many leading blocks are of kind ``"vision"`` (the tower the vision ranks run).

    Raises:
        ValueError: none, or every block is one (nothing left for the language ranks).
    """
    k = 0
    while k < len(blocks) and getattr(blocks[k], "kind", "") == "vision":
        k += 1
    if k == 0 or k == len(blocks):
        raise ValueError(
            f"vision_ranks needs pipeline blocks starting with the vision tower (kind "
            f"'vision') followed by others; got {k} vision blocks of {len(blocks)}. Use a "
            "model whose first blocks are its vision tower, or vision_ranks=0."
        )
    return k


def image_index(image_mask: Tensor) -> Tensor:
    """``[B, I]`` long: each occupied slot's position in ``image_mask``'s (row, slot) order
    (the order of ``pixel_values[image_mask]``), -1 on empty slots."""
    flat = image_mask.flatten().long()
    idx = flat.cumsum(0) - 1
    return torch.where(flat.bool(), idx, -1).view(image_mask.shape)


class TowerInlet(nn.Module):
    """The language ranks' first block under non-colocated towers: ``(index [B, I], *rest)``
    -> ``(part_0 [B, I, ...], ..., *rest)``, each received part (``[n, ...]``, in
    :attr:`parts`) gathered into the image slots (zeros in empty slots), as the colocated
    tower's last block scatters its outputs. No parameters; differentiable in the parts."""

    kind = "aligner"

    def __init__(self) -> None:
        super().__init__()
        self.parts: tuple[Tensor, ...] = ()
        """The step's received tower outputs (set by :class:`TowerExchange`)."""

    def forward(self, index: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        keep = index >= 0
        out = []
        for part in self.parts:
            if part.shape[0] == 0:  # no image in the step: zeros on the (empty) part's graph
                out.append(zero_on_graph([part], part.new_zeros(*index.shape, *part.shape[1:])))
                continue
            sel = part[index.clamp(min=0)]
            mask = keep.reshape(*keep.shape, *([1] * (part.ndim - 1)))
            out.append(torch.where(mask, sel, sel.new_zeros(())))
        return (*out, *rest)


class TowerExchange:
    """One rank's side of the non-colocated data flow (module docstring).

    Training runs by accumulation window (the batches of one optimizer step): at the window's
    first batch the language side sends all its batches' images (:meth:`send_window`); the
    vision rank encodes batch ``k + 1`` of the window while the language ranks run batch ``k``
    (:meth:`encode`): exact, the tower's weights do not change inside a window. Evaluation
    steps exchange one batch at a time (:meth:`exchange_once`, :meth:`encode_once`).

    Args:
        towers: the layout. rank: this process's global rank. device: its device.
        trains: whether the vision tower has trainable parameters (both sides derive it from
            the same module; a frozen tower exchanges no gradient).
    """

    def __init__(self, towers: TowerRanks, rank: int, device: torch.device, trains: bool) -> None:
        self.towers, self.rank, self.device, self.trains = towers, rank, device, trains
        self.links: list[TowerLink] = towers.links_of(rank)
        self.is_vision = towers.is_vision(rank)
        self._parts: tuple[Tensor, ...] = ()
        self._sends: list[Any] = []
        """Pending ``isend`` works (waited before the next ones are posted, and at the end)."""
        self._pixels: deque[list[Tensor]] = deque()
        """Vision rank: the window's batches not encoded yet, each as its links' pixels."""
        self._encoded: deque[tuple[Tensor, ...]] = deque()
        """Vision rank: outputs sent and not back-propagated yet (the batch, the one ahead)."""
        self._window_left = 0
        """Language rank: batches of the current window whose outputs are still to come."""
        self._held: tuple[Tensor, ...] | None = None
        """Language rank: the outputs of the batch encoded ahead, received early (before an
        evaluation step): at most one batch."""
        self.encoded_ahead = 0
        """Vision rank: batches encoded while the language ranks ran the one before."""
        self._deferred: tuple[Tensor, ...] | None = None
        """Vision rank: outputs whose backward runs at the next training batch."""
        self._held_grads: list[Tensor] | None = None
        """Vision rank: the deferred outputs' gradients, received before an evaluation step."""
        self.join_empty = False
        """Vision rank: back-propagate a batch without images too (zero gradients), so the
        rank joins the collectives its peers run inside their backward (FSDP2's
        reduce-scatters, ``vision_data_parallel="fsdp"``)."""

    @property
    def sender(self) -> bool:
        """Whether this language rank sends its replica's pixels and gradients (tp rank 0 of
        the first stage)."""
        return bool(self.links) and not self.is_vision and self.rank == self.links[0].stage0[0]

    # ------------------------------------------------------------------ language side
    def send_window(self, pixels: Sequence[Tensor]) -> None:
        """Language first-stage rank, at an accumulation window's first batch: the window's
        images, ``pixels[k] [n_k, ...]`` for its ``k``-th batch, to the vision ranks without
        waiting (tp rank 0; every first-stage rank notes the window's length)."""
        self._wait_sends()
        self._window_left = len(pixels)
        if self.sender:
            self._sends += self._post_window(pixels)

    def _post_window(self, pixels: Sequence[Tensor]) -> list[Any]:
        works = []
        for j, link in enumerate(self.links):
            pieces = [b.split(chunk_sizes(b.shape[0], len(self.links)))[j] for b in pixels]
            works += _isend_parts(pieces, link.vision)
        return works

    def receive(self) -> tuple[Tensor, ...]:
        """Language first-stage rank, each training batch: the tower's outputs for the next
        batch of the window, as leaves needing gradients when the tower trains. Raises
        ``RuntimeError`` when the window has no batch left (:meth:`send_window` first)."""
        if self._window_left <= 0:
            raise RuntimeError("TowerExchange.receive() outside a window: send_window() first.")
        held, self._held = self._held, None
        parts = held if held is not None else self._recv_outputs()
        self._window_left -= 1
        self._parts = tuple(p.requires_grad_(self.trains) for p in parts)
        return self._parts

    def exchange_once(self, pixels: Tensor) -> tuple[Tensor, ...]:
        """Language first-stage rank, an evaluation batch: the outputs encoded ahead for
        training are received first and held (:meth:`hold_ahead`), then ``pixels`` go out as
        a window of one and their outputs come back."""
        self.hold_ahead()
        if self.sender:
            for work in self._post_window([pixels]):
                work.wait()
        return self._recv_outputs()

    def hold_ahead(self) -> None:
        """Language first-stage rank: receive and hold the outputs the vision ranks encoded
        ahead (one batch when the window has batches left), so that the next message from
        them is not those."""
        if self._window_left > 0 and self._held is None:
            self._held = self._recv_outputs()

    def _recv_outputs(self) -> tuple[Tensor, ...]:
        got = [self._recv_parts(link.vision) for link in self.links]
        return tuple(torch.cat(p) for p in zip(*got, strict=True))

    def send_gradients(self, scale: float) -> None:
        """Language first-stage rank, after the step's backward: the parts' gradients times
        ``scale`` back to the vision ranks without waiting (tp rank 0; nothing when the tower
        is frozen): the vision rank receives them at its next batch (:meth:`backward`)."""
        parts, self._parts = self._parts, ()
        if not (self.trains and self.sender):
            return
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) * scale for p in parts]
        sizes = chunk_sizes(parts[0].shape[0], len(self.links))
        pieces = [g.split(sizes) for g in grads]
        for j, link in enumerate(self.links):
            for piece in pieces:
                self._sends += comm.isend_tensor(piece[j], link.vision)

    def send_tokens(self, total: float) -> None:
        """Language first-stage tp rank 0, at the optimizer step: the step's target tokens
        (``-1``: plain mean losses) to its vision ranks (nothing when the tower is frozen)."""
        if self.trains and self.sender:
            for link in self.links:
                comm.send_tensor(torch.tensor([float(total)], dtype=torch.float64), link.vision)

    def _recv_parts(self, src: int) -> list[Tensor]:
        """What :func:`_isend_parts` sent from ``src``: a count, then as many tensors."""
        count = int(comm.recv_tensor(src, self.device)[0])
        return [comm.recv_tensor(src, self.device) for _ in range(count)]

    # ------------------------------------------------------------------ vision side
    def encode(self, tower: Tower) -> tuple[Tensor, ...]:
        """Vision rank, each training batch: at a window's first batch receive its images;
        make sure this batch's outputs are sent, then encode and send the next batch of the
        window ahead (the language ranks run this one meanwhile). Returns this batch's
        outputs (:meth:`backward` takes them)."""
        if not self._pixels and not self._encoded:
            self._pixels.extend(self._recv_window())
        self._backward_deferred()
        if not self._encoded:
            self._encoded.append(self._encode_send(tower, self._pixels.popleft()))
        if self._pixels and len(self._encoded) == 1:
            self._encoded.append(self._encode_send(tower, self._pixels.popleft()))
            self.encoded_ahead += 1
        return self._encoded[0]

    def encode_once(self, tower: Tower) -> tuple[Tensor, ...]:
        """Vision rank, an evaluation batch: a window of one, encoded and sent (the gradients
        of a deferred backward, already on their way, are received and held first)."""
        if self._deferred is not None and self._held_grads is None:
            self._held_grads = self._recv_grads(self._deferred)
        (pixels,) = self._recv_window()
        outs = self._encode_send(tower, pixels)
        self._wait_sends()
        return outs

    def _recv_window(self) -> list[list[Tensor]]:
        """Every link's window: ``[batch][link] -> pixels``. Raises ``RuntimeError`` when the
        links' windows differ in length (their loaders are not in step)."""
        per_link = [self._recv_parts(link.stage0[0]) for link in self.links]
        lengths = {len(w) for w in per_link}
        if len(lengths) != 1:
            raise RuntimeError(
                f"vision rank {self.rank}: its language replicas sent windows of "
                f"{[len(w) for w in per_link]} batches; their loaders must yield as many batches."
            )
        return [list(batch) for batch in zip(*per_link, strict=True)]

    def _encode_send(self, tower: Tower, pixels: list[Tensor]) -> tuple[Tensor, ...]:
        """Run ``tower`` on the links' pixels as one batch and send each link's rows of every
        output to the replica's first-stage ranks without waiting."""
        counts = [p.shape[0] for p in pixels]
        outs = tower(torch.cat(pixels))
        self._wait_sends()
        per_link = zip(*(o.split(counts) for o in outs), strict=True)
        for link, rows in zip(self.links, per_link, strict=True):
            for dst in link.stage0:
                self._sends += _isend_parts(rows, dst)
        return outs

    def backward(self) -> None:
        """Vision rank, after a training batch: back-propagate its outputs' gradients through
        the tower, received from every link (nothing when it is frozen) - now at a window's
        last batch, else at the start of the next batch (:meth:`encode`), while the language
        ranks run it: Lightning joins every rank in a broadcast at each batch's start, so a
        backward here would hold the language ranks there."""
        outs = self._encoded.popleft() if self._encoded else ()
        if not self.trains:
            return
        if self._pixels or self._encoded:  # more batches of this window follow
            self._deferred = outs
            return
        self._backprop(outs)

    def _backward_deferred(self) -> None:
        outs, self._deferred = self._deferred, None
        if outs is not None:
            self._backprop(outs)

    def _recv_grads(self, outs: tuple[Tensor, ...]) -> list[Tensor]:
        got = [[comm.recv_tensor(link.stage0[0], self.device) for _ in outs] for link in self.links]
        return [torch.cat(g) for g in zip(*got, strict=True)]

    def _backprop(self, outs: tuple[Tensor, ...]) -> None:
        grads, self._held_grads = self._held_grads, None
        grads = grads if grads is not None else self._recv_grads(outs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        if pairs and any(o.numel() for o, _ in pairs):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        elif pairs and self.join_empty:  # no image: zero gradients, the same collectives
            leaves = [o for o, _ in pairs]
            torch.autograd.backward(zero_on_graph(leaves, leaves[0].new_zeros(())))

    def receive_tokens(self) -> float:
        """Vision rank, at the optimizer step: the step's target tokens from its links (the
        same on every language replica; ``-1``: plain mean losses)."""
        values = [float(comm.recv_tensor(x.stage0[0], self.device)[0]) for x in self.links]
        return values[0]

    # ------------------------------------------------------------------ both sides
    def drain(self) -> None:
        """At the end of training (both sides): a run stopped inside a window leaves the batch
        encoded ahead unused; the language ranks receive its outputs, the vision ranks drop
        it and the rest of the window, and every send completes."""
        if not self.is_vision:
            self.hold_ahead()
        elif self._deferred is not None and self._held_grads is None:
            self._recv_grads(self._deferred)  # their sender waits for this receive
        self._deferred, self._held_grads, self._held = None, None, None
        self._pixels.clear()
        self._encoded.clear()
        self._window_left = 0
        self._parts = ()
        self._wait_sends()

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work in sends:
            work.wait()


def _isend_parts(tensors: Sequence[Tensor], dst: int) -> list[Any]:
    """A count, then ``tensors`` (any number, any shapes) to ``dst`` without waiting
    (:func:`~lightning_mmpar.parallel.comm.isend_tensor`); the receiver runs
    :meth:`TowerExchange._recv_parts`. Returns the sends' works."""
    works = comm.isend_tensor(torch.tensor([len(tensors)]), dst)
    for t in tensors:
        works += comm.isend_tensor(t, dst)
    return works
