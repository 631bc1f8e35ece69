"""The CLIP-LLaMA recipe's LightningModule: the fusion model's blocks and three loss terms.

Loss (TECHNIQUES 1.5, 4)::

    L = w_c * InfoNCE(u, v; dp group) + w_cap * CE_vocab-parallel(caption) + MML(u, v; EMA heads)

with ``u`` the image features and ``v`` the text-only features
(:mod:`lightning_mmpar.models.blocks`). The module is a
:class:`~lightning_mmpar.parallel.pipeline.PipelineModule` over the model's own pipeline blocks:
under ``mm_parallel`` the strategy runs them through the pipeline (any pp) and calls
:meth:`ClipLlamaModule.pipeline_loss` on the last stage, where every term and metric is
computed; other strategies (DeepSpeed, DDP, one device) run :meth:`training_step`, which chains
the same blocks, as does ``FusionModel.forward``. After each optimizer step (not each
accumulated batch) the rank holding the head clamps the logit scale parameter to ``[0, ln 100]``
and takes one EMA step (CLIP / open_clip, ALBEF); AdamW decays weights by role.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_mmpar.losses.caption import caption_loss
from lightning_mmpar.losses.contrastive import ContrastiveLoss
from lightning_mmpar.losses.mml import MMLLoss
from lightning_mmpar.models.blocks import Head
from lightning_mmpar.models.fusion import (
    FusionConfig,
    FusionModel,
    FusionOutput,
    freeze_for_finetuning,
    weight_decay_split,
)
from lightning_mmpar.parallel import comm
from lightning_mmpar.plans.fusion import parallelize_fusion
from lightning_mmpar.recipes import parallel_env as penv
from lightning_mmpar.recipes.config import (
    FinetuneConfig,
    LossConfig,
    OptimConfig,
    TensorParallelOptions,
)
from lightning_mmpar.recipes.evaluation import RecipeMetrics, digit_token_classes, named_digit
from lightning_mmpar.recipes.generation import greedy_decode, next_tokens
from lightning_mmpar.topology import ParallelDims

__all__ = ["TERMS", "ClipLlamaModule"]

TERMS: tuple[str, ...] = ("contrastive", "caption", "mml")
"""Loss terms logged as ``train/<term>`` and ``val/<term>``."""
EVAL_METRICS: tuple[str, ...] = (
    "zero_shot_acc",
    "i2t_recall@1",
    "i2t_recall@5",
    "t2i_recall@1",
    "t2i_recall@5",
    "caption_acc_tf",
)
"""Evaluation metrics logged as ``val/<name>`` and ``test/<name>``."""


class ClipLlamaModule(LightningModule):
    """The fusion model trained with contrastive + caption + MML losses.

    Args:
        fusion: tower sizes, adapter, contrastive width and initial temperature
            (``logit_scale_init = 1 / temperature``). ``language.vocab_size`` is replaced by
            ``vocab_size`` padded to ``tensor_parallel.vocab_multiple``.
        finetune: which parts train (default: the TECHNIQUES 1.5 policy).
        loss: weights of the terms and the EMA momentum.
        optim: AdamW and its schedule.
        tensor_parallel: options of the fusion plan (the degree comes from the strategy).
        vocab_size: tokenizer vocabulary (linked from ``data.vocab_size`` by the CLI).
    """

    def __init__(
        self,
        *,
        fusion: FusionConfig = FusionConfig(),  # noqa: B008 - LightningCLI prints the fields
        finetune: FinetuneConfig = FinetuneConfig(),  # noqa: B008
        loss: LossConfig = LossConfig(),  # noqa: B008
        optim: OptimConfig = OptimConfig(),  # noqa: B008
        tensor_parallel: TensorParallelOptions = TensorParallelOptions(),  # noqa: B008
        vocab_size: int = 64,
    ) -> None:
        super().__init__()
        self.fusion_config = fusion
        self.finetune = finetune
        self.loss_config = loss
        self.optim = optim
        self.tp_options = tensor_parallel
        self.vocab_size = vocab_size
        self.blocks: nn.ModuleList | None = None
        self._fusion: tuple[FusionModel, ...] = ()  # a tuple: the blocks hold the parameters
        self._terms = torch.zeros(len(TERMS) + 1)
        self._metrics: RecipeMetrics | None = None
        self._losses: tuple[ContrastiveLoss, MMLLoss] | None = None
        self._prompts: dict[str, Tensor] = {}
        self._digit_classes = torch.zeros(0, dtype=torch.long)
        self._tokenizer: Any = None
        self._decode_position: int | None = None
        self._decoded: list[Tensor] = []
        self._stepped_at = 0  # trainer.global_step when the last optimizer step was followed up

    # ------------------------------------------------------------------ model
    def _resolved_config(self, tp: int) -> FusionConfig:
        multiple = math.lcm(self.tp_options.vocab_multiple, tp)
        vocab = -(-self.vocab_size // multiple) * multiple
        cfg = self.fusion_config
        language = type(cfg.language)(**{**vars(cfg.language), "vocab_size": vocab})
        return type(cfg)(**{**vars(cfg), "language": language})

    def configure_model(self) -> None:
        """Build the fusion model, apply its parallel plan, freeze per policy, cut the blocks.

        The blocks (``self.blocks``, state-dict keys ``blocks.N.*``) are registered, the model
        is not: a data-parallel wrapper shards the blocks' parameters in place.
        """
        if self.blocks is not None:
            return
        dims = ParallelDims.of(self._trainer)
        model = FusionModel(self._resolved_config(dims.tp), momentum=self.loss_config.mml.momentum)
        parallelize_fusion(model, dims, self.tp_options)
        self._freeze(model)
        self._fusion = (model,)
        self.blocks = nn.ModuleList(model.pipeline_blocks())

    def _freeze(self, model: FusionModel) -> None:
        f = self.finetune
        n = len(model.language.layers) if f.train_decoder_layers < 0 else f.train_decoder_layers
        freeze_for_finetuning(model, train_vision=f.train_vision, train_decoder_layers=n)
        if f.train_embeddings:
            for m in (model.language.embed_tokens, model.language.norm, model.language.lm_head):
                m.requires_grad_(True)

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
        if not isinstance(last, Head) or not penv.owns_last_stage(self._trainer):
            return None
        return last

    def setup(self, stage: str) -> None:
        """Losses and metrics on the dp group; prompts, tokenizer and digit tokens from data."""
        group = penv.dp_group(self._trainer)
        self._losses = (
            ContrastiveLoss(group=group),
            MMLLoss(config=self.loss_config.mml, group=group),
        )
        self._metrics = RecipeMetrics(group)
        data = getattr(self._trainer, "datamodule", None)
        if data is not None and hasattr(data, "class_prompts"):
            image_size = getattr(data, "image_size", self.fusion_config.vision.image_size)
            if image_size != self.fusion_config.vision.image_size:
                raise ValueError(
                    f"data.image_size ({image_size}) must equal model.fusion.vision.image_size "
                    f"({self.fusion_config.vision.image_size}); set both to the same value."
                )
            self._prompts = data.class_prompts()
            self._tokenizer = data.tokenizer
            self._digit_classes = digit_token_classes(data.tokenizer, self.vocab_size)

    # ------------------------------------------------------------------ PipelineModule
    def pipeline_blocks(self) -> list[nn.Module]:
        """The fusion model's blocks (vision, aligner, language, head)."""
        assert self.blocks is not None, "configure_model() builds the blocks"
        return list(self.blocks)

    def pipeline_inputs(self, batch: dict[str, Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        """The model's block-0 inputs (with the data's class prompts) and
        ``[target_ids | label]``."""
        ids = batch["input_ids"]
        prompts = {k: v.to(ids.device) for k, v in self._prompts.items()}
        inputs = FusionModel.pipeline_inputs(
            batch["images"],
            ids,
            batch["attention_mask"],
            prompts.get("input_ids"),
            prompts.get("attention_mask"),
        )
        b = ids.shape[0]
        labels = batch.get("labels", torch.full((b,), -1, dtype=torch.long, device=ids.device))
        return inputs, torch.cat([batch["target_ids"], labels[:, None]], dim=1)

    def pipeline_loss(self, output: tuple[Tensor, ...], target: Tensor) -> Tensor:
        """Weighted sum of the three terms on one (micro-)batch; metrics in eval mode."""
        assert self._losses is not None, "setup() builds the losses"
        out = FusionOutput(*output)
        if self._decode_position is not None:  # greedy decoding through the pipeline
            self._decoded.append(next_tokens(out.logits, self._decode_position, self.vocab_size))
            return torch.zeros((), device=out.image_features.device)
        target_ids, labels = target[:, :-1], target[:, -1]
        contrastive_fn, mml_fn = self._losses
        scale = out.logit_scale[0]
        cap = caption_loss(out.logits, target_ids, loss_parallel=isinstance(out.logits, DTensor))
        cap = comm.to_local(cap)
        con = contrastive_fn(out.image_features, out.text_features, scale)
        mml = mml_fn(
            out.image_features, out.text_features, out.momentum_image, out.momentum_text, scale
        )
        assert isinstance(con, Tensor) and isinstance(mml, Tensor)
        lc = self.loss_config
        total = lc.contrastive_weight * con + lc.caption_weight * cap + mml
        terms = torch.stack([con.detach(), cap.detach(), mml.detach()]).float().cpu()
        self._terms += torch.cat([terms, torch.ones(1)])
        if not self.training and self._metrics is not None and self._prompts:
            self._metrics.update(out, target_ids, labels, self._digit_classes)
        return total

    def forward(self, batch: dict[str, Tensor]) -> FusionOutput:
        """All blocks in order (needs every block on this rank: pipeline_parallel 1)."""
        inputs, _ = self.pipeline_inputs(batch)
        return self._run(inputs)

    def _run(self, state: tuple[Tensor, ...]) -> FusionOutput:
        assert self.blocks is not None
        if self.head is None or len(self.blocks) == 0:
            raise RuntimeError("generation and forward() need pipeline_parallel=1 (all blocks).")
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
        self._stepped_at = self.trainer.global_step  # restored on resume

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After a batch that ended with an optimizer step (``global_step`` moved: once per
        ``accumulate_grad_batches`` batches, whichever strategy accumulates), the rank holding
        the head clamps the logit scale and takes one EMA step (``Head.after_optimizer_step``)."""
        step = self.trainer.global_step
        if step != self._stepped_at:
            self._stepped_at = step
            if self.head is not None:
                self.head.after_optimizer_step()
        self._log_terms("train")

    def on_validation_epoch_start(self) -> None:
        self._start_eval()

    def on_test_epoch_start(self) -> None:
        self._start_eval()

    def _start_eval(self) -> None:
        self._terms.zero_()
        if self._metrics is not None:
            self._metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _log_terms(self, prefix: str) -> None:
        sums = penv.from_last_stage(self.trainer, self._terms.clone(), self.head is not None)
        sums = penv.dp_sum(self.trainer, sums)
        self._terms.zero_()
        for i, name in enumerate(TERMS):
            self.log(
                f"{prefix}/{name}",
                sums[i] / sums[-1].clamp(min=1),
                batch_size=1,
                prog_bar=prefix == "train" and name != "mml",
            )

    def _log_eval(self, prefix: str) -> None:
        self._log_terms(prefix)
        if self._metrics is None or not self._prompts:
            return
        values = torch.zeros(len(EVAL_METRICS))
        if self.head is not None:
            computed = self._metrics.compute()
            values = torch.tensor([computed[n] for n in EVAL_METRICS])
        values = penv.from_last_stage(self.trainer, values, self.head is not None)
        for name, value in zip(EVAL_METRICS, values, strict=True):
            self.log(f"{prefix}/{name}", value, batch_size=1, prog_bar=name == "zero_shot_acc")

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, images: Tensor, max_length: int) -> Tensor:
        """Greedy captions ``[B, max_length]`` from ``<bos>`` (pipeline_parallel 1 only)."""
        ids = torch.zeros(images.shape[0], max_length, dtype=torch.long, device=images.device)
        return self._greedy({"images": images, "input_ids": ids})

    def _greedy(self, batch: dict[str, Tensor]) -> Tensor:
        """Greedy captions of ``batch``'s images (its ``input_ids`` give the shape), through the
        pipeline when the strategy runs one (batch size divisible by its micro-batches)."""
        tok = self._tokenizer
        bos, eos, pad = (tok.bos_id, tok.eos_id, tok.pad_id) if tok else (1, 2, 0)
        pipelined = penv.pipeline_parallel(self._trainer) > 1
        step = self._pipelined_next_token if pipelined else self._local_next_token
        return greedy_decode(step, batch, bos=bos, eos=eos, pad=pad)

    def _local_next_token(self, step: dict[str, Tensor], position: int) -> Tensor:
        inputs = FusionModel.pipeline_inputs(
            step["images"], step["input_ids"], step["attention_mask"]
        )
        return next_tokens(self._run(inputs).logits, position, self.vocab_size)

    def _pipelined_next_token(self, step: dict[str, Tensor], position: int) -> Tensor:
        """One forward-only schedule; the last stage picks the tokens (:meth:`pipeline_loss`
        in decode mode) and broadcasts them to its pipeline peers."""
        pipeline = self.trainer.strategy.pipeline  # type: ignore[attr-defined]
        self._decode_position, self._decoded = position, []
        try:
            pipeline.eval_step(step)
        finally:
            self._decode_position = None
        owner = self.head is not None
        b = step["input_ids"].shape[0]
        nxt = torch.cat(self._decoded) if owner else torch.zeros(b, dtype=torch.long)
        return penv.from_last_stage(self.trainer, nxt, owner)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> list[dict[str, Any]]:
        """Greedy captions of a batch of images, with the digit each names."""
        ids = self.generate(batch["images"], batch["input_ids"].shape[1])
        labels = batch.get("labels")
        rows = []
        for i, row in enumerate(ids.tolist()):
            caption = self._tokenizer.decode(row) if self._tokenizer else str(row)
            item: dict[str, Any] = {
                "caption": caption,
                "digit": named_digit(row, self._digit_classes),
            }
            if labels is not None:
                item["label"] = int(labels[i])
            rows.append(item)
        return rows

    @torch.no_grad()
    def generate_accuracy(self, dataloader: Any) -> float | None:
        """Fraction of images whose greedy caption names their digit first (dp-summed)."""
        if self._tokenizer is None:
            return None
        was_training = self.training
        self.eval()
        hits = torch.zeros(2)
        for batch in dataloader:
            ids = self._greedy({k: v.to(self.device) for k, v in batch.items()})
            named = torch.tensor([named_digit(r, self._digit_classes) for r in ids.tolist()])
            hits += torch.tensor([float((named == batch["labels"]).sum()), float(len(named))])
        self.train(was_training)
        hits = penv.dp_sum(self._trainer, hits)
        return float(hits[0] / hits[1].clamp(min=1))

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> Any:
        """AdamW, weight decay by role (:func:`~lightning_mmpar.models.fusion.weight_decay_split`:
        none on biases, norms, positional/class embeddings, gates and the logit scale), with
        linear warm-up and cosine decay per step."""
        params = dict(self.named_parameters())
        decay_names, no_decay_names = weight_decay_split(self)
        decay = [params[n] for n in decay_names]
        no_decay = [params[n] for n in no_decay_names]
        o = self.optim
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o.lr,
            foreach=False,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, penv.warmup_cosine(o, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
