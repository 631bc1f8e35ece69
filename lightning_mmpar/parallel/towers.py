"""Non-colocated towers: the vision tower on ranks of its own (Megatron-Bridge MIMO's layout).

The layout (:class:`~lightning_mmpar.topology.TowerRanks`): language ranks ``0 .. L - 1`` laid
out by tp x pp x dp as usual, then ``V`` vision ranks, each holding the whole vision tower
(the module's leading blocks of kind ``"vision"``). One training step, per
:class:`~lightning_mmpar.topology.TowerLink` (replica ``r``'s images, or a chunk of them, and
one vision rank)::

    language stage 0, tp rank 0 --pixels [n, C, H, W]--> vision rank        (send_tensor)
    vision rank: tower(all its links' pixels as ONE batch) -> parts ([n, ...] each)
    vision rank --parts--> every tp rank of replica r's first stage         (send_tensor)
    language: TowerInlet puts the parts into the image slots; the schedule runs
    language stage 0, tp rank 0 --d loss / d parts--> vision rank           (send_tensor)
    vision rank: autograd.backward(parts, gradients); gradients summed over the vision ranks

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

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpar.parallel import comm
from lightning_mmpar.topology import TowerLink, TowerRanks, chunk_sizes

__all__ = ["TowerExchange", "TowerInlet", "image_index", "tower_block_count", "tower_group"]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


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
                out.append(part.new_zeros(*index.shape, *part.shape[1:]) + 0.0 * part.sum())
                continue
            sel = part[index.clamp(min=0)]
            mask = keep.reshape(*keep.shape, *([1] * (part.ndim - 1)))
            out.append(torch.where(mask, sel, sel.new_zeros(())))
        return (*out, *rest)


class TowerExchange:
    """One rank's side of the non-colocated data flow (module docstring).

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
        self._counts: list[int] = []

    @property
    def sender(self) -> bool:
        """Whether this language rank sends its replica's pixels and gradients (tp rank 0 of
        the first stage)."""
        return bool(self.links) and not self.is_vision and self.rank == self.links[0].stage0[0]

    # ------------------------------------------------------------------ language side
    def receive(self, pixels: Tensor) -> tuple[Tensor, ...]:
        """Language first-stage rank: send this replica's ``pixels [n, ...]`` (tp rank 0) and
        receive the tower's outputs, as leaves needing gradients when the tower trains."""
        sizes = chunk_sizes(pixels.shape[0], len(self.links))
        if self.sender:
            for link, piece in zip(self.links, pixels.split(sizes), strict=True):
                comm.send_tensor(piece, link.vision)
        got = [self._recv_parts(link.vision) for link in self.links]
        parts = tuple(torch.cat(p) for p in zip(*got, strict=True))
        self._parts = tuple(p.requires_grad_(self.trains) for p in parts)
        return self._parts

    def send_gradients(self, scale: float) -> None:
        """Language first-stage rank, after the step's backward: the parts' gradients times
        ``scale`` back to the vision ranks (tp rank 0; nothing when the tower is frozen)."""
        parts, self._parts = self._parts, ()
        if not (self.trains and self.sender):
            return
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) * scale for p in parts]
        sizes = chunk_sizes(parts[0].shape[0], len(self.links))
        pieces = [g.split(sizes) for g in grads]
        for j, link in enumerate(self.links):
            for piece in pieces:
                comm.send_tensor(piece[j], link.vision)

    def send_tokens(self, total: float) -> None:
        """Language first-stage tp rank 0, at the optimizer step: the step's target tokens
        (``-1``: plain mean losses) to its vision ranks (nothing when the tower is frozen)."""
        if self.trains and self.sender:
            for link in self.links:
                comm.send_tensor(torch.tensor([float(total)], dtype=torch.float64), link.vision)

    def _recv_parts(self, src: int) -> list[Tensor]:
        count = int(comm.recv_tensor(src, self.device)[0])
        return [comm.recv_tensor(src, self.device) for _ in range(count)]

    # ------------------------------------------------------------------ vision side
    def encode(self, tower: Callable[[Tensor], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """Vision rank: receive every link's pixels, run ``tower`` on them as one batch, send
        each link's rows of every output to the replica's first-stage ranks. Returns the
        outputs (kept for :meth:`backward`)."""
        pixels = [comm.recv_tensor(link.stage0[0], self.device) for link in self.links]
        self._counts = [p.shape[0] for p in pixels]
        outs = tower(torch.cat(pixels))
        per_link = zip(*(o.split(self._counts) for o in outs), strict=True)
        for link, rows in zip(self.links, per_link, strict=True):
            for dst in link.stage0:
                comm.send_tensor(torch.tensor([len(rows)]), dst)
                for r in rows:
                    comm.send_tensor(r, dst)
        self._parts = outs
        return outs

    def backward(self) -> None:
        """Vision rank: receive the outputs' gradients from every link and back-propagate them
        through the tower (nothing when it is frozen)."""
        outs, self._parts = self._parts, ()
        if not self.trains:
            return
        got = [[comm.recv_tensor(link.stage0[0], self.device) for _ in outs] for link in self.links]
        grads = [torch.cat(g) for g in zip(*got, strict=True)]
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        if pairs and any(o.numel() for o, _ in pairs):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def receive_tokens(self) -> float:
        """Vision rank, at the optimizer step: the step's target tokens from its links (the
        same on every language replica; ``-1``: plain mean losses)."""
        values = [float(comm.recv_tensor(x.stage0[0], self.device)[0]) for x in self.links]
        return values[0]
