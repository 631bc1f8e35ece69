"""The CLIP-LLaMA recipe's LightningModule: the fusion model's blocks and three loss terms.

Loss (CLIP's InfoNCE, Radford et al. 2021; a caption cross-entropy; ALBEF's momentum
distillation, Li et al. 2021)::

    L = w_c * InfoNCE(u, v; dp group) + w_cap * CE_vocab-parallel(caption) + MML(u, v; EMA heads)

with ``u`` the image features and ``v`` the text-only features
(:mod:`lightning_mmpar.models.blocks`), assembled layout-independently by
:class:`~lightning_mmpar.recipes.losses.RecipeLoss` (caption: global token mean; negatives: the
whole global batch). The module is a :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`
over the model's own pipeline blocks and a
:class:`~lightning_mmpar.parallel.gradient_cache.BatchLossModule`: under ``mm_parallel`` the
strategy runs the blocks through the pipeline (any pp, the gradient cache for whole-batch
negatives) and computes every term and metric on the last stage; other strategies (DeepSpeed,
DDP, one device) run :meth:`training_step`, which chains the same blocks, as does
``FusionModel.forward``. After each optimizer step (not each accumulated batch) the rank holding
the head clamps the logit scale parameter to ``[0, ln 100]`` and takes one EMA step (CLIP /
open_clip, ALBEF); AdamW decays weights by role.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_mmpar.data.packing import OVERFLOW_KEY, contrastive_pairs
from lightning_mmpar.layout import BlockSpec, measure_blocks
from lightning_mmpar.models.blocks import Head
from lightning_mmpar.models.fusion import (
    FusionConfig,
    FusionModel,
    FusionOutput,
    freeze_for_finetuning,
)
from lightning_mmpar.parallel import deferred
from lightning_mmpar.parallel.moe_state import average_density_estimates, update_expert_biases
from lightning_mmpar.parallel.parallelize import (
    ParallelPlan,
    applies_plans,
    apply_model_parallel,
    checkpoint_and_compile,
)
from lightning_mmpar.parallel.towers import (
    TowerInlet,
    image_index,
    share_metrics,
    tower_block_count,
)
from lightning_mmpar.plans.fusion import fusion_plan
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes import pretrained as ptl
from lightning_mmpar.recipes.evaluation import RecipeMetrics, digit_token_classes, eval_values
from lightning_mmpar.recipes.generation import CaptionGeneration, next_tokens
from lightning_mmpar.recipes.losses import TERMS, RecipeLoss, accumulation_warning, caption_tokens
from lightning_mmpar.recipes.optim import recipe_optimizer
from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    FusionPlanOptions,
    LossConfig,
    OptimConfig,
    PretrainedConfig,
    TensorParallelOptions,
    check_image_size,
)
from lightning_mmpar.topology import ParallelDims
from lightning_mmpar.trainer_topology import TrainerTopology

__all__ = ["TERMS", "ClipLlamaModule"]


def _config_classes(config: Any) -> set[type]:
    """The dataclass types in a (nested) config, for ``torch.serialization.add_safe_globals``."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return set()
    found: set[type] = {type(config)}
    for f in dataclasses.fields(config):
        found |= _config_classes(getattr(config, f.name))
    return found


# The hyper-parameters (these dataclasses) are in every checkpoint: Lightning's single-file
# checkpoints load with torch.load(weights_only=True), which needs them allow-listed.
_CONFIGS = (
    FusionConfig(),
    FinetuneConfig(),
    LossConfig(),
    OptimConfig(),
    FusionPlanOptions(),
    PretrainedConfig(),
)
torch.serialization.add_safe_globals(list(set().union(*map(_config_classes, _CONFIGS))))
torch.serialization.add_safe_globals([TensorParallelOptions])  # checkpoints before the rename


class ClipLlamaModule(CaptionGeneration, LightningModule):
    """The fusion model trained with contrastive + caption + MML losses.

    Args:
        fusion: tower sizes, adapter, contrastive width and initial temperature
            (``logit_scale_init = 1 / temperature``). ``language.vocab_size`` is replaced by
            ``vocab_size`` padded to ``plan.vocab_multiple``.
        finetune: which parts train (default: this package's fine-tuning policy, a frozen ViT
            as in LLaVA, Liu et al. 2023; :class:`~lightning_mmpar.recipes.options.FinetuneConfig`).
        loss: weights of the terms and the EMA momentum.
        optim: AdamW and its schedule.
        plan: options of the fusion model's parallel plan (``model.plan:``; the degree is the
            strategy's ``tensor_parallel``).
        vocab_size: tokenizer vocabulary (linked from ``data.vocab_size`` by the CLI).
        pretrained: local tower checkpoints (:mod:`~lightning_mmpar.recipes.pretrained`); their
            sizes replace ``fusion``'s.
        tensor_parallel: deprecated name of ``plan`` (``model.tensor_parallel:``); a
            ``DeprecationWarning``, and ``ValueError`` when both are given and differ.

    Under ``mm_parallel`` :meth:`configure_model` builds the model and the strategy applies
    :meth:`parallel_plan` (:func:`~lightning_mmpar.parallel.parallelize.parallelize`); under
    another strategy :meth:`configure_model` applies the plan's model-parallel part itself.
    """

    fixed_image_size: ClassVar[bool] = True
    """The ViT takes images of ``fusion.vision.image_size`` only (the data's must match);
    ``False`` for a dynamic-resolution model."""
    loss_is_dp_share: ClassVar[bool] = True
    """Each dp rank's loss is its share of the global batch's, already scaled by ``dp`` (the
    caption term's ``sum_CE_r / N * dp``, :class:`~lightning_mmpar.recipes.losses.RecipeLoss`):
    ``mm_parallel`` logs ``train_loss`` / ``val_loss`` / ``test_loss`` as the plain mean of the
    ranks' values, not weighted by their rows."""
    _hf_modules: ClassVar[list[type[ClipLlamaModule]]] = []
    """Subclasses that train a transformers directory of their own kind (:meth:`handles_hf`),
    registered by defining ``handles_hf``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "handles_hf" in vars(cls):
            ClipLlamaModule._hf_modules.append(cls)

    @classmethod
    def handles_hf(cls, path: str | None) -> bool:
        """Whether this class trains the ``model.pretrained.hf`` directory ``path`` instead of
        :class:`ClipLlamaModule` (a registered subclass that accepts it becomes the class of
        a ``ClipLlamaModule(...)`` built for that directory)."""
        return False

    def __init__(
        self,
        *,
        fusion: FusionConfig = FusionConfig(),  # noqa: B008 - LightningCLI prints the fields
        finetune: FinetuneConfig = FinetuneConfig(),  # noqa: B008
        loss: LossConfig = LossConfig(),  # noqa: B008
        optim: OptimConfig = OptimConfig(),  # noqa: B008
        plan: FusionPlanOptions = FusionPlanOptions(),  # noqa: B008
        vocab_size: int = 64,
        pretrained: PretrainedConfig = PretrainedConfig(),  # noqa: B008
        tensor_parallel: FusionPlanOptions | None = None,
    ) -> None:
        super().__init__()
        if type(self) is ClipLlamaModule and pretrained.hf:  # e.g. a Qwen-VL directory
            chosen = (sub for sub in self._hf_modules if sub.handles_hf(pretrained.hf))
            self.__class__ = next(chosen, ClipLlamaModule)  # same arguments, same attributes
        # hparams (the dataclass configs) go into every checkpoint's meta.pt, where
        # validate_checkpoint / load_sharded name the fields a resumed run changed
        self.save_hyperparameters()
        self.plan_options = _plan_options(plan, tensor_parallel, self.hparams)
        self.pretrained = pretrained
        self.fusion_config = self._fusion_config(fusion, pretrained)
        # the sizes the towers' files gave, so a checkpoint describes its model (export); in the
        # form given: LightningCLI saves plain dicts, which instantiate_module (and so
        # load_from_checkpoint) parses back - a dataclass there is not parsed
        resolved: Any = self.fusion_config
        if isinstance(self.hparams.get("fusion"), Mapping):
            resolved = dataclasses.asdict(resolved)
        self.hparams["fusion"] = resolved
        self.load_report: ptl.LoadReport | None = None  # what load_towers read (pretrained)
        self.finetune = finetune
        self.loss_config = loss
        self.optim = optim
        self.vocab_size = vocab_size
        self.blocks: nn.ModuleList | None = None
        self._fusion: tuple[FusionModel, ...] = ()  # a tuple: the blocks hold the parameters
        self._fresh: dict[str, Tensor] | None = None  # pretrained: fresh values, until read
        self.read_checkpoints = True  # False: pretrained towers stay on meta (shapes only)
        self._metrics: RecipeMetrics | None = None
        self._loss: RecipeLoss | None = None
        self._prompts: dict[str, Tensor] = {}
        self._digit_classes = torch.zeros(0, dtype=torch.long)
        self._tokenizer: Any = None
        self._decode_position: int | None = None
        self._decoded: list[Tensor] = []
        self._stepped_at = 0  # trainer.global_step when the last optimizer step was followed up
        self._window_tokens: int | None = None  # target tokens of the accumulation window
        self._overflow = torch.zeros(2, dtype=torch.long)  # truncated, dropped (dp sum, this fit)
        self.text_length: int | None = None  # block costs' caption length without a datamodule
        self._tower_role: str | None = None  # non-colocated towers: "vision" or "language"
        self._inlet: TowerInlet | None = None

    # ------------------------------------------------------------------ model
    def _fusion_config(self, fusion: FusionConfig, pretrained: PretrainedConfig) -> FusionConfig:
        """``fusion`` with the pretrained towers' sizes
        (:func:`~lightning_mmpar.recipes.pretrained.resolve_fusion_config`)."""
        return ptl.resolve_fusion_config(fusion, pretrained)

    def _resolved_config(self, tp: int) -> FusionConfig:
        multiple = math.lcm(self.plan_options.vocab_multiple, tp)
        vocab = -(-self.vocab_size // multiple) * multiple
        cfg = self.fusion_config
        language = type(cfg.language)(**{**vars(cfg.language), "vocab_size": vocab})
        return type(cfg)(**{**vars(cfg), "language": language})

    @property
    def tp_options(self) -> FusionPlanOptions:
        """Deprecated name of :attr:`plan_options` (the options of the fusion model's plan)."""
        warnings.warn(
            "ClipLlamaModule.tp_options is deprecated: use plan_options.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.plan_options

    def configure_model(self) -> None:
        """Build the fusion model (pretrained towers on the meta device) and cut its blocks;
        under a strategy that applies no plans (DDP, DeepSpeed, Lightning's
        ``ModelParallelStrategy``, none), apply :meth:`parallel_plan`'s model-parallel part here
        (``mm_parallel`` applies the whole plan in its ``setup``).

        The blocks (``self.blocks``, state-dict keys ``blocks.N.*``) are registered, the model
        is not: a data-parallel wrapper shards the blocks' parameters in place. Raises
        ``ValueError`` when a size does not fit the layout (:func:`~lightning_mmpar.plans.
        fusion.check_fusion_layout`).
        """
        if self.blocks is not None:
            return
        dims = ParallelDims.of(self._trainer)
        cfg = self._resolved_config(dims.tp)
        meta = ptl.meta_fusion(self, cfg, dims.tp) if self.pretrained.used else None  # towers
        model = meta[0] if meta else FusionModel(cfg, momentum=self.loss_config.mml.momentum)
        model.text_stream = self.text_stream
        self._fusion = (model,)
        self._fresh = meta[1] if meta else None
        self.blocks = nn.ModuleList(model.pipeline_blocks())
        if self._tower_role is not None:  # non-colocated: both sides must know, now, whether
            self._freeze(model)  # the tower trains (vision ranks apply no plan)
        plan = self.parallel_plan(dims)  # the sizes against the layout, checked now
        if not applies_plans(self._trainer):
            apply_model_parallel(model, dims, plan)
            checkpoint_and_compile(self, plan)  # the deprecated model-side choice, if any

    @property
    def text_stream(self) -> bool:
        """Whether the decoder runs the text-only stream (:attr:`FusionModel.text_stream`): the
        contrastive or MML term reads it (weight > 0), or a mixture-of-experts decoder routes
        it. Off for a caption-only objective on a dense decoder (LLaVA's): half the decoder's
        work, the same logits, losses and gradients."""
        loss = self.loss_config
        moe = self.fusion_config.language.moe is not None
        return loss.contrastive_weight > 0 or loss.mml.weight > 0 or moe

    def parallel_plan(self, dims: ParallelDims) -> ParallelPlan:
        """The fusion model's plan (:func:`~lightning_mmpar.plans.fusion.fusion_plan`, checked
        against ``dims``) on the model :meth:`configure_model` built, with two more steps after
        TP and EP: freezing per :attr:`finetune` (after TP: sequence parallelism's norms are
        new parameters) and reading the pretrained towers (:meth:`load_towers`). Raises
        ``ValueError`` as ``fusion_plan``."""
        options = self.plan_options
        if self._tower_role == "language":  # the tower runs on the vision ranks: no styles
            options = dataclasses.replace(options, vision_parallel="replicate")
        plan = fusion_plan(self.fusion_model, options, dims)
        steps = (*plan.after_model_parallel, self._freeze_step, self.load_towers)
        return dataclasses.replace(plan, after_model_parallel=steps)

    def load_towers(self, dims: ParallelDims) -> None:
        """Fill the pretrained towers' meta parameters with this rank's tensor-parallel slices,
        or defer them until FSDP sharded them (:func:`~lightning_mmpar.recipes.pretrained.
        load_towers`): a step of :meth:`parallel_plan`, after the plan's sharding and freezing,
        before the pipeline cut. Sets :attr:`load_report`; nothing without pretrained towers or
        with ``read_checkpoints`` False (a meta-device build for shapes: planner, partitioner)."""
        if self._fresh is None or not self.read_checkpoints:
            return
        self.load_report = ptl.load_towers(self, self.fusion_model, self.pretrained, self._fresh)
        self._fresh = None
        device = self.device
        if any(p.device != device and not p.is_meta for p in self.parameters()):
            deferred.move(self, device)  # fresh reads are on the CPU: to where the module is

    def _freeze_step(self, dims: ParallelDims) -> None:
        self._freeze(self.fusion_model)

    def load_sharded_parameters(self, device: torch.device) -> None:
        """The strategy's hook after sharding (:mod:`lightning_mmpar.parallel.deferred`): read
        the pretrained tower shards deferred under FSDP (:func:`~lightning_mmpar.recipes.
        pretrained.load_deferred`); plain parameters go to ``device``."""
        ptl.load_deferred(self, device)

    def _freeze(self, model: FusionModel) -> None:
        f = self.finetune
        n = len(model.language.layers) if f.train_decoder_layers < 0 else f.train_decoder_layers
        freeze_for_finetuning(model, train_vision=f.train_vision, train_decoder_layers=n)
        if f.train_embeddings:
            for m in (model.language.embed_tokens, model.language.norm, model.language.lm_head):
                m.requires_grad_(True)
        if not f.train_projector:
            model.projector.requires_grad_(False)

    @property
    def fusion_model(self) -> FusionModel:
        """The model the blocks wrap (built by :meth:`configure_model`), in this module's
        train/eval mode (it is not a registered child, so ``train()`` does not reach it)."""
        if not self._fusion:
            raise RuntimeError("configure_model() builds the fusion model; call it first.")
        model = self._fusion[0]
        model.training = self.training
        return model

    @property
    def head(self) -> Head | None:
        """The last block when this rank owns it (always, without pipeline parallelism)."""
        last = self.blocks[-1] if self.blocks is not None else None
        if self._tower_role == "vision":
            return None
        if not isinstance(last, Head) or not TrainerTopology.of(self._trainer).owns_last_stage:
            return None
        return last

    def setup(self, stage: str) -> None:
        """Losses and metrics on the dp group; prompts, tokenizer and digit tokens from data."""
        group = TrainerTopology.of(self._trainer).dp_group
        self._loss = RecipeLoss(self.loss_config, group)
        self._metrics = RecipeMetrics(group)
        data = getattr(self._trainer, "datamodule", None)
        if data is not None and hasattr(data, "class_prompts"):
            image_size = getattr(data, "image_size", self.fusion_config.vision.image_size)
            check_image_size(image_size, self.fusion_config.vision.image_size)
            self._prompts = data.class_prompts()
            self._tokenizer = data.tokenizer
            rows = ptl.vocab_rows(self, ParallelDims.of(self._trainer).tp)  # the logits' width
            self._digit_classes = digit_token_classes(data.tokenizer, rows)
        elif data is not None and callable(getattr(data, "prompts", None)):  # a question task
            image_size = getattr(data, "image_size", self.fusion_config.vision.image_size)
            check_image_size(image_size, self.fusion_config.vision.image_size)
            self._tokenizer = data.tokenizer  # greedy answers (RunSummary: answer_accuracy)

    # ------------------------------------------------------------------ PipelineModule
    def pipeline_blocks(self) -> list[nn.Module]:
        """The fusion model's blocks (vision, aligner, language, head); under non-colocated
        towers (:meth:`use_tower_role`) a vision rank's are the tower's, a language rank's the
        inlet and the rest."""
        assert self.blocks is not None, "configure_model() builds the blocks"
        if self._tower_role == "vision":
            return self.tower_blocks()
        if self._tower_role == "language":
            assert self._inlet is not None
            return [self._inlet, *list(self.blocks)[len(self.tower_blocks()) :]]
        return list(self.blocks)

    # ------------------------------------------------------------------ TowerModule
    def use_tower_role(self, role: str, inlet: TowerInlet | None = None) -> None:
        """Non-colocated towers (the strategy's ``vision_ranks``, :mod:`lightning_mmpar.
        parallel.towers`), called before :meth:`configure_model`: this rank runs the vision
        tower (``"vision"``) or the rest behind ``inlet`` (``"language"``). Raises
        ``ValueError`` with pretrained towers (read by the plan, which vision ranks skip)."""
        if self.pretrained.used:
            raise ValueError(
                "vision_ranks (non-colocated towers) does not read pretrained towers yet "
                "(model.pretrained); train from scratch or set vision_ranks=0."
            )
        self._tower_role, self._inlet = role, inlet

    def tower_blocks(self) -> list[nn.Module]:
        """The vision tower's blocks (the leading ``vision`` ones), on any rank."""
        assert self.blocks is not None, "configure_model() builds the blocks"
        blocks = list(self.blocks)
        return blocks[: tower_block_count(blocks)]

    def tower_inputs(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The images a ragged batch gives the tower: ``pixel_values[image_mask]`` ``[n, C, H,
        W]`` in (row, slot) order. Raises ``ValueError`` for a batch without ``pixel_values``
        (non-colocated towers take ragged batches, :class:`~lightning_mmpar.data.
        MultimodalCollator`)."""
        if "pixel_values" not in batch or "image_mask" not in batch:
            raise ValueError(
                "vision_ranks (non-colocated towers) takes ragged batches (pixel_values, "
                "image_mask: lightning_mmpar.data.MultimodalCollator); got keys "
                f"{sorted(batch)}. Use a ragged data module or vision_ranks=0."
            )
        return batch["pixel_values"][batch["image_mask"]]

    def pipeline_block_specs(self, text_length: int | None = None) -> list[BlockSpec]:
        """Each block's name (``vision.stem``, ``vision.layer0``, .., ``vision.pool``, ``bridge``,
        ``adapter0``, ``decoder0``, .., ``head``), kind, cost at ``vision.merged_patches``
        image tokens (the ViT's blocks at its ``grid**2`` patches) and ``text_length`` (default:
        :attr:`text_length`, else the data's ``max_length``) and parameter bytes
        (:func:`lightning_mmpar.layout.measure_blocks`; meta-device models work). Call after
        :meth:`configure_model`, before pipeline stages drop parameters.

        Raises:
            ValueError: no ``text_length`` given and no data module with ``max_length``.
        """
        data = getattr(self._trainer, "datamodule", None)
        t = text_length or self.text_length or int(getattr(data, "max_length", 0) or 0)
        m, v = self.fusion_model, self.fusion_config.vision
        vl, ad, de = len(m.vision.transformer.resblocks), len(m.adapters), len(m.language.layers)
        names = ["vision.stem", *(f"vision.layer{i}" for i in range(vl)), "vision.pool"]
        names += ["bridge", *(f"adapter{i}" for i in range(ad))]
        names += [*(f"decoder{i}" for i in range(de)), "head"]
        n, patches = v.merged_patches, v.grid**2  # the language model's image tokens; the ViT's
        if self._tower_role == "language":  # the inlet (no cost) and the blocks after the tower
            k = len(self.tower_blocks())
            rest = measure_blocks(list(self.blocks or [])[k:], n, t, names[k:])
            return [BlockSpec("tower.inlet", "aligner", 0.0, 0.0, 0.0, 0.0), *rest]
        return measure_blocks(self.pipeline_blocks(), n, t, names, vision_tokens=patches)

    def pipeline_inputs(self, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        """The model's block-0 inputs (with the data's class prompts) and
        ``[target_ids | label]``; the caption loss learns the batch's token count here (every
        path splits the full local batch through this method)."""
        if "pixel_values" in batch:
            return self._ragged_inputs(batch)
        ids = batch["input_ids"]
        prompts = {k: v.to(ids.device) for k, v in self._prompts.items()}
        inputs = FusionModel.pipeline_inputs(
            batch["images"],
            ids,
            batch["attention_mask"],
            prompts.get("input_ids"),
            prompts.get("attention_mask"),
        )
        if self._loss is not None:
            self._loss.start_batch(batch["target_ids"], self._window())
        b = ids.shape[0]
        labels = batch.get("labels", torch.full((b,), -1, dtype=torch.long, device=ids.device))
        return inputs, torch.cat([batch["target_ids"], labels[:, None]], dim=1)

    def _ragged_inputs(self, batch: Mapping[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        """A ragged batch (:class:`~lightning_mmpar.data.MultimodalCollator`): the model's
        block-0 inputs and ``[labels [B, T] | contrastive pair slots [B, I]]``."""
        inputs = FusionModel.ragged_inputs(batch)
        if self._tower_role == "language":  # the inlet's slot index instead of the pixels
            inputs = (image_index(batch["image_mask"]), *inputs[1:])
        if self._loss is not None:
            self._loss.start_batch(batch["labels"], self._window())
        return inputs, torch.cat([batch["labels"], contrastive_pairs(batch).long()], dim=1)

    # ------------------------------------------------------------------ accumulation windows
    def target_tokens(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Target tokens of a batch as the caption term counts them (``labels`` of a ragged
        batch, else ``target_ids``; position ``t`` predicts ``t + 1``): 0-dim int64. Under
        ``mm_parallel`` with ``accumulate_grad_batches > 1`` the strategy counts every
        accumulation window with it before the window's first batch."""
        return caption_tokens(batch["labels"] if "pixel_values" in batch else batch["target_ids"])

    def on_accumulation_window(self, tokens: int) -> None:
        """The strategy's count of the coming accumulation window's target tokens, summed over
        the data-parallel group: the caption term of its batches is their share of the
        window's token mean (:meth:`~lightning_mmpar.recipes.losses.RecipeLoss.start_batch`)."""
        self._window_tokens = tokens

    def _window(self) -> tuple[int, int] | None:
        """``(window tokens, accumulate_grad_batches)`` for a training batch counted by the
        strategy, else ``None`` (the batch's own tokens)."""
        if not self.training or self._window_tokens is None or self._trainer is None:
            return None
        return self._window_tokens, self._trainer.accumulate_grad_batches

    def pipeline_loss(self, output: tuple[Tensor, ...], target: Tensor) -> Tensor:
        """All three terms of one (micro-)batch; metrics in eval mode."""
        micro = self.pipeline_micro_loss(output, target)
        if self._decode_position is not None:
            return micro
        return micro + self.pipeline_batch_loss(self.pipeline_features(output, target))

    # ------------------------------------------------------------------ BatchLossModule
    def pipeline_batch_coupled(self) -> bool:
        """Contrastive / MML negatives over the whole batch (``loss.negatives``), not while
        decoding."""
        return self.loss_config.negatives == "global_batch" and self._decode_position is None

    def pipeline_micro_loss(self, output: tuple[Tensor, ...], target: Tensor) -> Tensor:
        """Weighted caption term of one (micro-)batch (its share of the global token mean),
        metrics in eval mode; the next tokens while decoding."""
        assert self._loss is not None, "setup() builds the losses"
        out = FusionOutput(*output)
        if self._decode_position is not None:  # greedy decoding through the pipeline
            self._decoded.append(next_tokens(out.logits, self._decode_position, self.vocab_size))
            return torch.zeros((), device=out.image_features.device)
        if out.image_features.ndim == 3:  # ragged: [labels | pair slots]
            return self.loss_config.caption_weight * self._loss.caption(
                out.logits, target[:, : out.logits.shape[1]]
            )
        target_ids, labels = target[:, :-1], target[:, -1]
        cap = self._loss.caption(out.logits, target_ids)
        if not self.training and self._metrics is not None and self._prompts:
            self._metrics.update(out, target_ids, labels, self._digit_classes)
        return self.loss_config.caption_weight * cap

    def pipeline_features(self, output: tuple[Tensor, ...], target: Tensor) -> tuple[Tensor, ...]:
        """Image, text and momentum features and the logit scale of one (micro-)batch; a
        ragged batch's image-caption pairs only (``[P, C]``, :func:`~lightning_mmpar.data.
        contrastive_pairs`)."""
        out = FusionOutput(*output)
        if out.image_features.ndim == 3:
            pairs = target[:, out.logits.shape[1] :].bool()
            img, txt, m_img, m_txt, scale = RecipeLoss.features(out)
            return (img[pairs], txt[pairs], m_img[pairs], m_txt[pairs], scale)
        return RecipeLoss.features(out)

    def pipeline_batch_loss(self, features: tuple[Tensor, ...]) -> Tensor:
        """``w_c * InfoNCE + MML`` of a batch's features (dp-gathered negatives)."""
        assert self._loss is not None, "setup() builds the losses"
        return self._loss.coupled(features)

    def forward(self, batch: dict[str, Tensor]) -> FusionOutput:
        """All blocks in order (needs every block on this rank: pipeline_parallel 1)."""
        inputs, _ = self.pipeline_inputs(batch)
        return self._run(inputs)

    def _run(self, state: tuple[Tensor, ...]) -> FusionOutput:
        assert self.blocks is not None
        if self.head is None or len(self.blocks) == 0:
            raise RuntimeError("forward() needs pipeline_parallel=1 (all blocks on this rank).")
        for block in self.blocks:
            state = block(*state)
        return FusionOutput(*state)

    # ------------------------------------------------------------------ steps (other strategies)
    def _step(self, batch: dict[str, Tensor], name: str, prog_bar: bool = True) -> Tensor:
        inputs, target = self.pipeline_inputs(batch)
        loss = self.pipeline_loss(self._run(inputs), target)
        self.log(f"{name}_loss", loss, prog_bar=prog_bar, sync_dist=True)
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "test", prog_bar=False)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self) -> None:
        """A checkpoint written in a callback's ``on_train_batch_end`` (``ModelCheckpoint``)
        precedes this module's hook: that step's clamp and EMA step are still due, do them now.
        Warns (rank 0, once per fit) when the caption term is not the token mean over
        accumulated batches: a strategy other than ``mm_parallel``
        (:func:`~lightning_mmpar.recipes.losses.accumulation_warning`)."""
        self._window_tokens = None  # until the strategy counts this fit's first window
        self._overflow.zero_()
        windows = getattr(
            getattr(self.trainer, "strategy", None), "counts_accumulation_windows", False
        )
        note = accumulation_warning(self.trainer.accumulate_grad_batches, self.loss_config, windows)
        if note is not None:
            rank_zero_warn(note)
        if self._stepped_at != self.trainer.global_step and self.head is not None:
            self.head.after_optimizer_step()
        self._stepped_at = self.trainer.global_step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Log ``data/truncated`` and ``data/dropped``: samples the collator cut or left out
        since this fit started, summed over the data-parallel group (a ragged batch's
        :data:`~lightning_mmpar.data.packing.OVERFLOW_KEY` counts, which travel with the batch
        and so count whatever the DataLoader's ``num_workers``)."""
        counts = batch.get(OVERFLOW_KEY) if isinstance(batch, Mapping) else None
        if counts is None:
            return
        local = counts.to(self.device).sum(0)
        self._overflow += penv.dp_sum(self.trainer, local).cpu()
        for i, name in enumerate(("truncated", "dropped")):
            self.log(f"data/{name}", float(self._overflow[i]), batch_size=1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["recipe_stepped_at"] = self._stepped_at

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._stepped_at = int(checkpoint.get("recipe_stepped_at", checkpoint["global_step"]))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After a batch that ended with an optimizer step (``global_step`` moved: once per
        ``accumulate_grad_batches`` batches, whichever strategy accumulates), the rank holding
        the head clamps the logit scale and takes one EMA step (``Head.after_optimizer_step``);
        MoE layers with aux-loss-free balancing move their expert bias by the load summed over
        the data-parallel group."""
        step = self.trainer.global_step
        if step != self._stepped_at:
            self._stepped_at = step
            if not _skipped(self.trainer, step - 1):
                dp = ParallelDims.of(self.trainer).get_group("dp")
                update_expert_biases(self, dp)  # aux-free MoE balancing (a no-op without it)
                average_density_estimates(self, dp)  # density-driven top-k: one estimate
                if self.head is not None:
                    self.head.after_optimizer_step()

    def on_after_backward(self) -> None:
        """Log this batch's loss terms (``train/<term>``) right after its backward, so the
        callbacks' ``on_train_batch_end`` (progress bar, run summary) see the same step's terms
        as its ``train_loss`` (the module's own batch-end hook runs after theirs)."""
        self._log_terms("train")

    def on_validation_epoch_start(self) -> None:
        self._start_eval()

    def on_test_epoch_start(self) -> None:
        self._start_eval()

    def _start_eval(self) -> None:
        if self._loss is not None:
            self._loss.terms.zero_()
        if self._metrics is not None:
            self._metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _log_terms(self, prefix: str) -> None:
        assert self._loss is not None, "setup() builds the losses"
        values = self._loss.pop_terms(self.trainer, self.head is not None)
        for name, value in values.items():
            bar = prefix == "train" and name != "mml"
            self.log(f"{prefix}/{name}", value, batch_size=1, prog_bar=bar)

    def _log_eval(self, prefix: str) -> None:
        """The epoch's loss terms and metrics. Under non-colocated towers a vision rank, which
        computes no loss, logs the language side's values (``<prefix>_loss`` and
        ``<prefix>/...`` of global rank 0, :func:`~lightning_mmpar.parallel.towers.
        share_metrics`), so ``trainer.validate`` / ``test`` return the same on every rank."""
        if self._tower_role == "vision":
            for name, shared in share_metrics(None).items():
                self.log(name, shared, batch_size=1)
            return
        self._log_terms(prefix)
        if self._metrics is not None and self._prompts:
            values = eval_values(self.trainer, self._metrics, self.head is not None)
            for name, value in values.items():
                self.log(f"{prefix}/{name}", value, batch_size=1, prog_bar=name == "zero_shot_acc")
        if self._tower_role == "language":
            logged = self.trainer.callback_metrics.items()
            ours = (f"{prefix}_loss", f"{prefix}/")
            share_metrics({k: float(v) for k, v in logged if k.startswith(ours)})

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> Any:
        """AdamW, weight decay by role and a peak learning rate per tower
        (:mod:`~lightning_mmpar.recipes.optim`), linear warm-up and cosine decay per step."""
        ptl.check_stage_guess(self, self.load_report)
        if self._tower_role == "vision" and not any(p.requires_grad for p in self.parameters()):
            # a frozen tower's rank steps nothing, but joins every collective of the others:
            # recipe_optimizer's estimated_stepping_batches (the loader's length, summed) too
            self.trainer.estimated_stepping_batches  # noqa: B018
            return torch.optim.SGD([nn.Parameter(torch.zeros(0, device=self.device))], lr=0.0)
        return recipe_optimizer(self)


def _plan_options(
    plan: FusionPlanOptions, tensor_parallel: FusionPlanOptions | None, hparams: Any
) -> FusionPlanOptions:
    """The plan options from ``plan`` or its deprecated name ``tensor_parallel`` (warned), with
    ``hparams`` (what checkpoints keep) holding them under ``plan`` only.

    Raises:
        ValueError: both given, and different.
    """
    saved = hparams.pop("tensor_parallel", None)
    if tensor_parallel is None:
        return plan
    warnings.warn(
        "ClipLlamaModule(tensor_parallel=...) / model.tensor_parallel is deprecated: it is "
        "model.plan (FusionPlanOptions); tensor_parallel is the strategy's degree only.",
        DeprecationWarning,
        stacklevel=3,
    )
    given = dataclasses.asdict(tensor_parallel)
    if dataclasses.asdict(plan) not in (dataclasses.asdict(FusionPlanOptions()), given):
        raise ValueError(
            f"model.tensor_parallel ({tensor_parallel}) is the deprecated name of model.plan "
            f"({plan}); give one of them."
        )
    hparams["plan"] = saved
    return tensor_parallel


def _skipped(trainer: Any, step: int) -> bool:
    """Whether ``mm_parallel`` skipped the optimizer step at ``step`` (``on_nonfinite="skip"``):
    weights did not change, so neither do the EMA heads nor the logit-scale clamp."""
    guard = getattr(trainer.strategy, "nonfinite", None)
    return guard is not None and guard.last_skipped_step == step
