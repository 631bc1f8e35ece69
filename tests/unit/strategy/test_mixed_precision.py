"""``precision="bf16-mixed"`` computes in bf16 for a pipelined module too (the strategy runs its
loss through the schedule or the one-chunk model, not through ``LightningModule.training_step``:
Lightning's autocast context must still wrap it). Found on an H200: the recipe's module ran its
matmuls in fp32 under ``bf16-mixed`` (1.9% MFU), while FP8 layers, which cast themselves, did not.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer, make_tokens
from lightning_mmpar.testing import quiet_trainer


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("32", torch.float32)]
)
def test_pipelined_module_steps_run_in_the_plugins_precision(
    precision: str, dtype: torch.dtype, tmp_path: object
) -> None:
    cfg = ToyConfig(layers=2)
    torch.manual_seed(0)
    module = ToyTransformer(cfg)
    seen: dict[str, list[torch.dtype]] = {"train": [], "val": []}

    def record(mod: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        seen["train" if mod.training else "val"].append(out.dtype)

    linear = next(m for m in module.layers[0].modules() if isinstance(m, nn.Linear))
    linear.register_forward_hook(record)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        strategy=MultimodalParallelStrategy(),
        precision=precision,
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    tokens = make_tokens(8, cfg)
    loader = torch.utils.data.DataLoader(tokens, batch_size=4)
    trainer.fit(module, loader, loader)
    assert seen["train"] and set(seen["train"]) == {dtype}, seen
    assert seen["val"] and set(seen["val"]) == {dtype}, seen
    assert next(module.parameters()).dtype == torch.float32  # master weights stay fp32
