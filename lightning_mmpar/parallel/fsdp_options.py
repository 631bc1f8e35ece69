"""Precision and memory options of the strategy: FSDP2 mixed precision, optimizer-state offload,
per-block activation checkpointing and ``torch.compile``.

* ``mixed_precision``: FSDP2's ``MixedPrecisionPolicy`` (torch ``fully_shard(mp_policy=...)``;
  Micikevicius et al. 2018, "Mixed Precision Training"): ``"bf16"`` all-gathers parameters in
  BF16 and computes in BF16 while the sharded parameters, the gradients the optimizer sees and
  its state stay FP32, and reduce-scatters gradients in FP32 (``reduce_dtype``); a ``dict``
  sets ``param_dtype`` / ``reduce_dtype`` / ``output_dtype`` (``"bfloat16"``, ``"float16"``,
  ``"float32"``) and ``cast_forward_inputs`` itself. Every block is then a ``fully_shard``
  unit even at one data-parallel rank (so one process computes what dp ranks compute).
* ``offload_optimizer``: FSDP2's ``CPUOffloadPolicy``: sharded parameters, their gradients and
  hence the optimizer state live in CPU memory (the optimizer step runs on the CPU), copied to
  the device for each all-gather; ZeRO-Offload's role (Ren et al. 2021). Pinned memory on CUDA.
  On a CPU accelerator it changes no memory and runs the same code path.
* ``activation_checkpointing`` and ``compile_blocks``: :mod:`lightning_mmpar.parallel.activation`,
  applied by :func:`lightning_mmpar.parallel.parallelize.checkpoint_and_compile`.

Combinations that cannot work are refused with ``ValueError`` (:meth:`MemoryOptions.check`,
:meth:`MemoryOptions.check_precision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from lightning_mmpar.layout import ParallelLayout, validate
from lightning_mmpar.parallel import activation

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MP_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def mixed_precision_policy(spec: str | dict[str, Any] | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``spec`` (module docstring); ``None`` for ``None``.

    Raises ``ValueError`` naming the field, the value and the accepted forms."""
    if spec is None:
        return None
    if spec == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if not isinstance(spec, dict) or set(spec) - set(_MP_KEYS):
        raise ValueError(
            f"mixed_precision ({spec!r}) must be 'bf16' (BF16 parameters and compute, FP32 "
            f"gradient reduction), None, or a dict with keys from {list(_MP_KEYS)}."
        )
    kwargs: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "cast_forward_inputs":
            kwargs[key] = bool(value)
        elif value is None or value in DTYPES:
            kwargs[key] = None if value is None else DTYPES[value]
        else:
            raise ValueError(
                f"mixed_precision[{key!r}] ({value!r}) must be one of {sorted(DTYPES)} or None."
            )
    return MixedPrecisionPolicy(**kwargs)


@dataclass(frozen=True)
class MemoryOptions:
    """The strategy's precision and memory options (module docstring); validated on creation.

    Raises ``ValueError`` for a malformed value (field, value and fix named)."""

    mixed_precision: str | dict[str, Any] | None = None
    offload_optimizer: bool = False
    activation_checkpointing: activation.Checkpointing = None
    compile_blocks: bool | str | None = None

    def __post_init__(self) -> None:
        mixed_precision_policy(self.mixed_precision)
        activation.check_checkpointing(self.activation_checkpointing)
        activation.check_backend(self.compile_blocks)
        if not isinstance(self.offload_optimizer, bool):
            raise ValueError(
                f"offload_optimizer ({self.offload_optimizer!r}) must be True or False."
            )

    @property
    def needs_fsdp(self) -> bool:
        """Whether the options need ``fully_shard`` units even at one data-parallel rank."""
        return self.mixed_precision is not None or self.offload_optimizer

    def check(self, data_parallel: str, expert_parallel: int) -> None:
        """Refuse options the data-parallel engine cannot honour (``ValueError``): the FSDP2
        policies' rules of :func:`lightning_mmpar.layout.validate`."""
        layout = ParallelLayout(
            dp=None,
            ep=expert_parallel,
            data_parallel=data_parallel,
            mixed_precision=self.mixed_precision,
            offload_optimizer=self.offload_optimizer,
        )
        validate(layout)

    def check_precision(self, plugin: Any) -> None:
        """Refuse ``mixed_precision`` with a Lightning "true" half precision plugin
        (``precision="bf16-true"`` / ``"16-true"``: parameters already stored in half precision,
        so FP32 reduction and FP32 master weights would be lost). Raises ``ValueError``."""
        from lightning.pytorch.plugins.precision import HalfPrecision

        if self.mixed_precision is not None and isinstance(plugin, HalfPrecision):
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} with Trainer(precision="
                f"{plugin.precision!r}): FSDP2 mixed precision needs FP32 parameters; use "
                "precision='32-true' (default) with mixed_precision, or mixed_precision=None."
            )

    def fsdp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of ``fully_shard`` (``mp_policy``, ``offload_policy``)."""
        kwargs: dict[str, Any] = {}
        if (policy := mixed_precision_policy(self.mixed_precision)) is not None:
            kwargs["mp_policy"] = policy
        if self.offload_optimizer:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        return kwargs


__all__ = ["DTYPES", "MemoryOptions", "mixed_precision_policy"]
