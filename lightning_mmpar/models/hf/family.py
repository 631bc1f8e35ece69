"""What one transformers model type needs to become a :class:`FusionModel` and back.

A family translates ``config.json`` into a :class:`FusionConfig` (refusing values that change
the math and that the blocks do not implement) and maps state-dict keys both ways through one
table (Megatron-Bridge's ``MegatronMappingRegistry`` / torchtitan's ``state_dict_adapter``
idea: one name mapping serves import and export).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mmpar.models.fusion import FusionConfig

__all__ = ["HFFamily"]


@dataclass(frozen=True)
class HFFamily:
    """One transformers model family (a ``model_type`` of ``config.json``)."""

    model_class: str
    """The transformers class the checkpoint is for (``LlavaForConditionalGeneration``)."""
    fusion_config: Callable[[Any], FusionConfig]
    """transformers config object (``AutoConfig.from_pretrained``) -> :class:`FusionConfig`;
    raises ``ValueError`` naming the field and value it cannot express."""
    hf_keys: Callable[[str], tuple[str, ...]]
    """Our state-dict key -> its checkpoint keys: one (a rename), several (stacked on a new
    dim 0, e.g. q/k/v into a fused ``[3, D, D]``), or none (a part transformers lacks:
    contrastive heads; never exported)."""
    unused_keys: Callable[[Any], Callable[[str], bool]]
    """transformers config -> predicate of the checkpoint keys the model deliberately does not
    hold (vision layers after the feature layer): never trained, so export copies them from
    the source checkpoint unchanged."""
    normalize_key: Callable[[str], str] = str
    """Checkpoint key in an older layout -> the current transformers layout."""
    data_args: Callable[[Any, FusionConfig], dict[str, Any]] | None = None
    """``(transformers config, its FusionConfig) ->`` the data module arguments the checkpoint
    fixes (``image_size``, ``image_seq_length``), replacing the defaults
    :func:`~lightning_mmpar.models.hf.hf_data_args` derives from the ViT (one fixed image size,
    ``vision.tokens`` tokens per image); ``None``: those defaults."""

    def table(self, keys: Mapping[str, Any] | list[str]) -> dict[str, tuple[str, ...]]:
        """``{our key: checkpoint keys}`` for ``keys`` (ours) that have a counterpart."""
        return {k: hf for k in keys if (hf := self.hf_keys(k))}
