"""Ragged multimodal batches in the fusion model: masks, image slots, splicing, pooling.

A ragged batch (:class:`lightning_mmpar.data.MultimodalCollator`) packs several samples with
0..N images each into a row: ``sample_ids [B, T]`` (index of the sample in its row, -1 on pad),
``position_ids [B, T]`` (restarting at 0 per sample), image slots ``pixel_values [B, I, C, H,
W]`` with ``image_mask [B, I]``, ``image_sample [B, I]`` (the slot's sample) and
``image_position [B, I]`` (the token index of its marker, spliced: of its first image token).

Attention is block-diagonal causal: a token attends to the tokens of its own sample at or before
it. It is computed by ``scaled_dot_product_attention`` with a boolean ``[B, 1, T, T]`` mask
built from ``sample_ids`` (torchtitan's and Hugging Face's packed SDPA path) rather than flex
attention or a varlen kernel: SDPA with a mask runs on CPU and on every device in eager mode,
on tensor-parallel head shards (the mask broadcasts over heads) and under every pipeline
schedule, with no compile step; flex attention needs ``torch.compile`` to be faster than the
mask and varlen kernels are CUDA-only. The mask costs ``B T^2`` booleans per layer call, small
beside the activations at the sequence lengths this package trains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "block_causal_mask",
    "image_cross_mask",
    "occupied",
    "on_images",
    "sample_last_index",
    "scatter_slots",
    "splice_images",
]


def block_causal_mask(sample_ids: Tensor) -> Tensor:
    """``[B, 1, T, T]`` bool: query ``q`` sees key ``k`` iff ``k <= q`` and both belong to the
    same sample (``sample_ids [B, T]``, -1 on pad). A pad query sees itself only (no fully
    masked row: SDPA would return NaN there)."""
    t = sample_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=sample_ids.device).tril()
    same = sample_ids[:, :, None] == sample_ids[:, None, :]
    mask = same & causal & (sample_ids[:, None, :] >= 0)
    eye = torch.eye(t, dtype=torch.bool, device=sample_ids.device)
    mask = mask | (eye & (sample_ids[:, :, None] < 0))
    return mask[:, None]


def image_cross_mask(
    sample_ids: Tensor,
    image_mask: Tensor,
    image_sample: Tensor,
    image_position: Tensor,
    tokens_per_image: int,
) -> Tensor:
    """``[B, 1, T, I * N]`` bool for cross-attention from text to the flattened image tokens
    ``[B, I * N, D]``: text token ``t`` of sample ``s`` sees the tokens of image slot ``i`` iff
    the slot holds an image of ``s`` whose marker is at or before ``t`` (Flamingo: each token
    attends to the images that precede it; never another packed sample's images)."""
    t = sample_ids.shape[1]
    pos = torch.arange(t, device=sample_ids.device)
    own = sample_ids[:, :, None] == image_sample[:, None, :]  # [B, T, I]
    seen = image_position[:, None, :] <= pos[None, :, None]
    mask = own & seen & image_mask[:, None, :] & (sample_ids[:, :, None] >= 0)
    return mask.repeat_interleave(tokens_per_image, dim=2)[:, None]


def occupied(x: Tensor, image_mask: Tensor) -> tuple[Tensor, bool]:
    """``(x[image_mask] [N_img, ...], False)``, or with no image at all ``(one zero image
    [1, ...], True)``: the tower then runs on a dummy, so its data-parallel collectives (FSDP2
    all-gathers in forward pre-hooks, gradient reduce-scatters, DDP's gradient hooks) fire on
    every rank, and tensor-parallel DTensor ops never see a zero-size batch (whose sharding
    propagation torch rejects). The dummy depends on ``x`` (times 0), so every earlier block
    stays on the autograd path and gets its (zero) gradient in the usual order: FSDP2 ranks
    then issue their reduce-scatters in the same order."""
    if bool(image_mask.any()):
        return x[image_mask], False
    # on x's graph (0 * sum): the blocks before stay on the path to the loss
    return x.new_zeros(1, *x.shape[2:]) + 0.0 * x.sum(), True


def scatter_slots(y: Tensor, image_mask: Tensor, dummy: bool) -> Tensor:
    """``y [N_img, ...]`` back into ``[B, I, ...]`` (zeros in empty slots); the output of a
    dummy (:func:`occupied`) contributes zero, keeping its graph (zero gradients)."""
    out = y.new_zeros(*image_mask.shape, *y.shape[1:])
    if dummy:
        return out + 0.0 * y.sum()
    return out.index_put((image_mask,), y)


def on_images(fn: Callable[[Tensor], Tensor], x: Tensor, image_mask: Tensor) -> Tensor:
    """``fn`` on the occupied slots of ``x [B, I, ...]`` as ONE batch ``[N_img, ...]`` (no
    image: on a zero dummy, :func:`occupied`), scattered back into ``[B, I, ...]`` with zeros
    in empty slots."""
    sel, dummy = occupied(x, image_mask)
    return scatter_slots(fn(sel), image_mask, dummy)


def splice_images(h: Tensor, ids: Tensor, img: Tensor, image_mask: Tensor, token: int) -> Tensor:
    """Spliced fusion (LLaVA, Qwen-VL; transformers' ``masked_scatter``): the embeddings at the
    ``token`` positions of ``ids [B, T]`` are replaced, in order, by the image tokens
    ``img [B, I, N, D]`` of the occupied slots. ``h [B, T, D]``.

    Raises:
        ValueError: the image-token positions do not match ``N`` tokens per image (the
            collator's ``image_seq_length`` must equal the vision tower's patch tokens).
    """
    where = ids == token
    images = img[image_mask]  # [N_img, N, D] in (row, slot) order = order of appearance
    if int(where.sum()) != images.shape[0] * images.shape[1]:
        raise ValueError(
            f"spliced fusion: {int(where.sum())} image tokens (id {token}) in input_ids but "
            f"{images.shape[0]} images x {images.shape[1]} tokens per image; set the "
            f"collator's image_seq_length to {images.shape[1]}."
        )
    return h.masked_scatter(where[..., None], images.reshape(-1, h.shape[-1]).to(h.dtype))


def sample_last_index(sample_ids: Tensor, image_sample: Tensor) -> Tensor:
    """``[B, I]``: index of the last token of each image slot's sample (0 for empty slots)."""
    b, t = sample_ids.shape
    pos = torch.arange(t, device=sample_ids.device).expand(b, t)
    s = sample_ids.clamp(min=0)
    n = int(max(int(sample_ids.max()) + 1, 1)) if t else 1
    last = torch.zeros(b, n, dtype=torch.long, device=sample_ids.device)
    last = last.scatter_reduce(1, s, torch.where(sample_ids >= 0, pos, 0), "amax")
    return last.gather(1, image_sample.clamp(min=0).clamp(max=n - 1))
