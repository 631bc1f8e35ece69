"""Round-trip check of an export (:mod:`lightning_mmpar.recipes.export`): reload every written
format with its own library and compare it with the fusion model it came from."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from lightning_mmpar.models.fusion import FusionModel

__all__ = ["verify_export"]

BATCH, TEXT_LENGTH = 2, 16
"""Shape of the random token ids the LLaMA check runs."""


_OPEN_CLIP_NO_WEIGHTS = ("Local config loaded, but no CLIP weights", "No pretrained weights loaded")
"""open_clip's warnings for a model built without weights (the check loads them right after)."""


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_OPEN_CLIP_NO_WEIGHTS)


@contextmanager
def _no_weights_warnings() -> Iterator[None]:
    """Silence open_clip's "no weights" warnings (root logger) while the empty CLIP is built."""
    root, quiet = logging.getLogger(), _DropMessages()
    handlers = [root, *root.handlers]
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@torch.no_grad()
def verify_export(
    model: FusionModel, out: Path, vocab_size: int, seed: int = 0
) -> dict[str, float]:
    """Max abs differences between ``model`` and the formats written into ``out``.

    * ``llama_logits``: ``LlamaForCausalLM.from_pretrained(out/llama)`` vs
      ``model.language`` (the text-only stream) on random ids ``[2, 16]`` below
      ``vocab_size``, ours cut to the first ``vocab_size`` columns (absent for a
      mixture-of-experts decoder, which is not exported as LLaMA);
    * ``open_clip_features``: open_clip's CLIP built from ``out/open_clip`` with the exported
      visual state dict (``strict=True``) vs ``model.vision`` pooled features ``[2, output_dim]``
      on random images;
    * ``adapter``, ``heads``: the safetensors files vs the model's tensors (0 when exact).

    Runs in the model's dtype; random inputs from ``torch.Generator().manual_seed(seed)``.
    """
    import open_clip

    g = torch.Generator().manual_seed(seed)
    diffs: dict[str, float] = {}
    if (out / "llama").is_dir():
        from transformers import LlamaForCausalLM

        llama = LlamaForCausalLM.from_pretrained(str(out / "llama"), local_files_only=True).eval()
        ids = torch.randint(0, vocab_size, (BATCH, TEXT_LENGTH), generator=g)
        ours = model.language(ids)[..., :vocab_size]
        diffs["llama_logits"] = _max_diff(llama(input_ids=ids).logits, ours)
    with _no_weights_warnings():  # the exported weights are loaded next (strict)
        clip = open_clip.create_model(f"local-dir:{out / 'open_clip'}", load_weights=False)
    visual = clip.visual.to(model.vision.proj.dtype).eval()
    visual.load_state_dict(load_file(str(out / "open_clip_visual.safetensors")), strict=True)
    size = model.config.vision.image_size
    images = torch.randn(BATCH, 3, size, size, generator=g).to(model.vision.proj.dtype)
    diffs["open_clip_features"] = _max_diff(visual(images), model.vision(images)[0])
    state = model.state_dict()
    state |= {f"momentum_heads.{k}": v for k, v in model.momentum_heads.state_dict().items()}
    for name in ("adapter", "heads"):
        saved = load_file(str(out / f"{name}.safetensors"))
        diffs[name] = max((_max_diff(v, state[k]) for k, v in saved.items()), default=0.0)
    return diffs
