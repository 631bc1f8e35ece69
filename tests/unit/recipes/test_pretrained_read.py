"""The recipe loader's read of one checkpoint tensor into a parameter's slice
(``recipes.pretrained._read``): a vocabulary parameter past the checkpoint's rows gets zero
rows; any other parameter whose tensor has fewer rows is refused, not padded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mmpar.recipes.pretrained import _read
from lightning_mmpar.recipes.pretrained_files import TensorFile


def _file(key: str, value: torch.Tensor) -> TensorFile:
    return TensorFile(Path("ckpt"), {key: tuple(value.shape)}, lambda k, index: value[index])


def test_vocabulary_rows_past_the_checkpoint_are_zero() -> None:
    value = torch.arange(20.0).reshape(5, 4)
    tensors = _file("embed_tokens.weight", value)
    got = _read(
        tensors,
        "embed_tokens.weight",
        (8, 4),
        (slice(4, 8), slice(0, 4)),
        "language.embed_tokens.weight",
    )
    assert torch.equal(got[0], value[4]) and torch.equal(got[1:], torch.zeros(3, 4))
    head = _file("lm_head.weight", value)
    got = _read(
        head, "lm_head.weight", (8, 4), (slice(0, 8), slice(0, 4)), "language.lm_head.weight"
    )
    assert torch.equal(got[:5], value) and not got[5:].any()


def test_a_shorter_tensor_of_another_parameter_is_refused() -> None:
    tensors = _file("blocks.0.attn.q_proj.weight", torch.ones(31, 32))
    with pytest.raises(
        ValueError,
        match=r"'blocks\.0\.attn\.q_proj\.weight' has shape \[31, 32\], "
        r"the model's parameter \[32, 32\]",
    ):
        _read(
            tensors,
            "blocks.0.attn.q_proj.weight",
            (32, 32),
            (slice(0, 32), slice(0, 32)),
            "vision.blocks.0.attn.q_proj.weight",
        )
