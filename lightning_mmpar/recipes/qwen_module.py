"""The recipe's LightningModule for a Qwen2-VL / Qwen2.5-VL directory (``model.pretrained.hf``).

:class:`~lightning_mmpar.recipes.module.ClipLlamaModule` becomes this subclass when
``model.pretrained.hf`` names a directory whose ``config.json`` is a Qwen-VL family
(``ClipLlamaModule(pretrained=PretrainedConfig(hf=<qwen dir>))`` is a
:class:`QwenVLRecipeModule`: it registers for such directories with :meth:`handles_hf`;
``load_from_checkpoint`` does the same from the saved hyper-parameters). Same options and
YAML; what differs:

* **model**: :class:`~lightning_mmpar.models.hf.qwen2_vl.QwenVLModel` (sizes from the
  directory's ``config.json``, ``model.fusion`` ignored) built on the meta device, cut into its
  pipeline blocks, planned by :func:`~lightning_mmpar.plans.qwen_vl.qwen_vl_plan`
  (``model.plan.vision_parallel`` tp / replicate / dp; ``sequence_parallel`` refused), each
  rank reading only its slices, stages or FSDP shards
  (:func:`~lightning_mmpar.recipes.pretrained.load_towers`, the checkpoint keys mapped by
  :func:`~lightning_mmpar.recipes.pretrained_files.transformers_qwen_vl`).
* **batches**: :class:`~lightning_mmpar.data.QwenVLCollator` ones (the conversation data
  module with ``image_processor``: patches, ``image_grid_thw``, M-RoPE positions).
* **loss**: the caption term alone (next-token cross-entropy over the labelled, i.e.
  assistant, tokens; the global token mean of every layout): the model has no contrastive
  heads, so ``loss.contrastive_weight`` and ``loss.mml.weight`` do not apply (a warning when
  set).
* **freezing** (``model.finetune``): ``train_vision`` the ViT (patch embedding and blocks),
  ``train_decoder_layers`` the first N decoder layers (-1 all), ``train_embeddings`` the
  embedding, final norm and LM head; the patch merger (the projector's role) always trains.
* **learning rates** (``model.optim``): ``lr_vision`` the ViT, ``lr_language`` the decoder,
  ``lr_adapter`` the merger (:mod:`~lightning_mmpar.recipes.optim`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_mmpar.layout import BlockSpec, measure_blocks
from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.models.hf.checkpoint import hf_config
from lightning_mmpar.models.hf.qwen2_vl import QwenVLConfig, QwenVLModel
from lightning_mmpar.models.hf.qwen_convert import is_qwen_vl_dir, qwen_vl_config
from lightning_mmpar.parallel.activation import LAYERS
from lightning_mmpar.parallel.parallelize import (
    ParallelPlan,
    applies_plans,
    apply_model_parallel,
    checkpoint_and_compile,
)
from lightning_mmpar.plans.qwen_vl import qwen_vl_plan
from lightning_mmpar.recipes.losses import RecipeLoss
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import PretrainedConfig
from lightning_mmpar.topology import ParallelDims
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["QwenVLRecipeModule"]


class QwenVLRecipeModule(ClipLlamaModule):
    """:class:`ClipLlamaModule` over a Qwen-VL checkpoint (module docstring); build it through
    ``ClipLlamaModule(pretrained=...)`` or directly with the same arguments.

    Raises:
        ValueError: ``pretrained.hf`` unset or not a Qwen-VL directory; a config value the
            model does not compute (:func:`~lightning_mmpar.models.hf.qwen_convert.
            qwen_vl_config`, naming the field).
    """

    fixed_image_size = False  # dynamic resolution: the image processor sizes each image

    @classmethod
    def handles_hf(cls, path: str | None) -> bool:
        """A Qwen2-VL / Qwen2.5-VL directory (``config.json``'s ``model_type``)."""
        return is_qwen_vl_dir(path)

    def _fusion_config(self, fusion: FusionConfig, pretrained: PretrainedConfig) -> FusionConfig:
        """The Qwen model's config (:attr:`qwen_config`) from the directory; ``fusion`` is
        kept as given (it does not describe this model)."""
        if not pretrained.hf:
            raise ValueError(
                f"{type(self).__name__} needs model.pretrained.hf (a Qwen-VL directory)."
            )
        self.qwen_config: Any = self._model_config(hf_config(pretrained.hf))
        return fusion

    # the family's parts (a subclass for another Qwen family replaces these three)
    def _model_config(self, config: Any) -> QwenVLConfig:
        """The model's config of a transformers config (:func:`qwen_vl_config`)."""
        return qwen_vl_config(config)

    def _meta_model(self) -> Any:
        """The model of :attr:`qwen_config` on the meta device."""
        with torch.device("meta"):
            return QwenVLModel(self.qwen_config)

    def _plan(self, **options: Any) -> ParallelPlan:
        """The family's plan (:func:`~lightning_mmpar.plans.qwen_vl.qwen_vl_plan`)."""
        return qwen_vl_plan(self.qwen_model, **options)

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the Qwen model on the meta device and cut its blocks; the checkpoint's
        slices are read by :meth:`load_towers` (a step of :meth:`parallel_plan`). Under a
        strategy that applies no plans, the plan's model-parallel part is applied here."""
        if self.blocks is not None:
            return
        dims = ParallelDims.of(self._trainer)
        model = self._meta_model()
        self._fusion = (cast(Any, model),)
        self._fresh = {}
        self.blocks = nn.ModuleList(model.pipeline_blocks())
        plan = self.parallel_plan(dims)
        if not applies_plans(self._trainer):
            apply_model_parallel(model, dims, plan)
            checkpoint_and_compile(self, plan)

    @property
    def qwen_model(self) -> QwenVLModel:
        """The model the blocks wrap (built by :meth:`configure_model`)."""
        return cast(QwenVLModel, self.fusion_model)

    def parallel_plan(self, dims: ParallelDims) -> ParallelPlan:
        """:func:`~lightning_mmpar.plans.qwen_vl.qwen_vl_plan` (``model.plan``'s
        ``vision_parallel``, ``sequence_parallel`` and ``activation_checkpointing``; checked
        against ``dims``), then freezing and the checkpoint read. Raises its ``ValueError``."""
        o = self.plan_options
        plan = self._plan(
            vision_parallel=cast(Any, o.vision_parallel),
            sequence_parallel=o.sequence_parallel,
            dims=dims,
            pipeline_blocks=self.pipeline_blocks,
        )
        if o.activation_checkpointing:
            plan = dataclasses.replace(plan, checkpointing=LAYERS)
        steps = (*plan.after_model_parallel, self._freeze_step, self.load_towers)
        return dataclasses.replace(plan, after_model_parallel=steps)

    def _freeze(self, model: Any) -> None:
        f, m = self.finetune, cast(QwenVLModel, model)
        m.vision.requires_grad_(f.train_vision)
        for name in ("merger", "deepstack_merger_list"):  # the projector's role
            if isinstance(part := getattr(m.vision, name, None), nn.Module):
                part.requires_grad_(f.train_projector)
        m.language.requires_grad_(False)
        n = len(m.language.layers) if f.train_decoder_layers < 0 else f.train_decoder_layers
        for layer in m.language.layers[:n]:
            layer.requires_grad_(True)
        if f.train_embeddings:
            for part in (m.language.embed_tokens, m.language.norm, m.language.lm_head):
                part.requires_grad_(True)

    @property
    def head(self) -> Any:
        """No contrastive head (nothing to clamp or average after a step)."""
        return None

    def setup(self, stage: str) -> None:
        """The caption loss on the dp group; the tokenizer must fit the checkpoint's rows.

        Raises:
            ValueError: the data's vocabulary is larger than the model's.
        """
        self._loss = RecipeLoss(self.loss_config, TrainerTopology.of(self._trainer).dp_group)
        if self.loss_config.contrastive_weight or self.loss_config.mml.weight:
            rank_zero_warn(
                "model.pretrained.hf is a Qwen-VL model: it trains the caption term only "
                "(no contrastive heads); model.loss.contrastive_weight / mml.weight are ignored."
            )
        rows = self.qwen_config.language.vocab_size
        if self.vocab_size > rows:
            raise ValueError(
                f"data.vocab_size ({self.vocab_size}) exceeds the Qwen-VL checkpoint's "
                f"vocab_size ({rows}); use the checkpoint's own tokenizer."
            )

    # ------------------------------------------------------------------ PipelineModule
    def pipeline_block_specs(self, text_length: int | None = None) -> list[BlockSpec]:
        """Each block's name (``vision.stem``, ``vision.layer0``, .., ``vision.merger``,
        ``bridge``, ``decoder0``, .., ``head``), kind, cost and parameter bytes at
        ``text_length`` tokens (default: :attr:`text_length`, else the data's
        ``max_length``) and ``text_length // 4`` merged image tokens per row.

        Raises:
            ValueError: no ``text_length`` given and no data module with ``max_length``.
        """
        data = getattr(self._trainer, "datamodule", None)
        t = text_length or self.text_length or int(getattr(data, "max_length", 0) or 0)
        if t < 1:
            raise ValueError(
                "pipeline_block_specs needs text_length (or a data module with max_length)."
            )
        m = self.qwen_model
        names = ["vision.stem", *(f"vision.layer{i}" for i in range(len(m.vision.blocks)))]
        names += ["vision.merger", "bridge"]
        names += [*(f"decoder{i}" for i in range(len(m.language.layers))), "head"]
        return measure_blocks(self.pipeline_blocks(), max(1, t // 4), t, names)

    def pipeline_inputs(self, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        """Block 0's inputs (:meth:`QwenVLModel.pipeline_inputs`) and the labels ``[B, T]``;
        the caption loss learns the batch's token count here."""
        if self._loss is not None:
            self._loss.start_batch(batch["labels"], self._window())
        return QwenVLModel.pipeline_inputs(batch), batch["labels"]

    def pipeline_batch_coupled(self) -> bool:
        """No whole-batch term."""
        return False

    def pipeline_micro_loss(self, output: Any, target: Tensor) -> Tensor:
        """The weighted caption term of one (micro-)batch (its share of the token mean);
        ``output``: the logits, or the head's one-tensor tuple."""
        assert self._loss is not None, "setup() builds the losses"
        logits = output[0] if isinstance(output, tuple) else output
        return self.loss_config.caption_weight * self._loss.caption(logits, target)

    def pipeline_loss(self, output: Any, target: Tensor) -> Tensor:
        """:meth:`pipeline_micro_loss`."""
        return self.pipeline_micro_loss(output, target)

    def forward(self, batch: dict[str, Tensor]) -> Any:
        """``logits [B, T, V]`` of all blocks in order (pipeline_parallel 1)."""
        inputs, _ = self.pipeline_inputs(batch)
        return self._run(inputs)[0]

    def _run(self, state: tuple[Tensor, ...]) -> Any:
        assert self.blocks is not None
        if not TrainerTopology.of(self._trainer).owns_last_stage or len(self.blocks) == 0:
            raise RuntimeError("forward() needs pipeline_parallel=1 (all blocks on this rank).")
        for block in self.blocks:
            state = block(*state)
        return state

    def _log_terms(self, prefix: str) -> None:
        assert self._loss is not None, "setup() builds the losses"
        owner = TrainerTopology.of(self.trainer).owns_last_stage
        values = self._loss.pop_terms(self.trainer, owner)
        self.log(f"{prefix}/caption", values["caption"], batch_size=1, prog_bar=prefix == "train")

    def _log_eval(self, prefix: str) -> None:
        self._log_terms(prefix)
