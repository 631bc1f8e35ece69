"""The recipe's training path equals the fusion model's own forward (one process, no Trainer).

The module registers the model's pipeline blocks; ``FusionModel.forward`` builds the same blocks
again. The losses are written out here from the loss modules, so a divergence between the two
paths (a stream, a head, the logit scale) fails these tests.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_mmpar.data.digits import DigitsCaptions
from lightning_mmpar.losses.caption import caption_loss
from lightning_mmpar.losses.contrastive import ContrastiveLoss
from lightning_mmpar.losses.mml import MMLLoss
from lightning_mmpar.models.fusion import FusionOutput
from lightning_mmpar.parallel.pipeline import PipelineChunk
from lightning_mmpar.plans.fusion import checkpoint_units
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.options import FinetuneConfig, LossConfig
from lightning_mmpar.topology import ParallelDims
from tests.recipes import recipe_faults_worker as rw


@pytest.fixture(scope="module")
def data() -> DigitsCaptions:
    digits = DigitsCaptions(image_size=16, batch_size=8)
    digits.setup()
    return digits


def make_module(data: DigitsCaptions, monkeypatch: pytest.MonkeyPatch) -> ClipLlamaModule:
    torch.manual_seed(0)
    fusion = rw.tiny_fusion()
    module = ClipLlamaModule(
        fusion=fusion,
        finetune=FinetuneConfig(train_vision=True, train_decoder_layers=1),
        loss=LossConfig(contrastive_weight=0.7, caption_weight=3.0),
        vocab_size=data.vocab_size,
    )
    module._trainer = SimpleNamespace(datamodule=data)  # type: ignore[assignment]
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)
    module.configure_model()
    module.setup("fit")
    return module


def written_out_loss(out: FusionOutput, target_ids: Tensor, config: LossConfig) -> Tensor:
    scale = out.logit_scale[0]
    con = ContrastiveLoss()(out.image_features, out.text_features, scale)
    mml = MMLLoss(config=config.mml)(
        out.image_features, out.text_features, out.momentum_image, out.momentum_text, scale
    )
    cap = caption_loss(out.logits, target_ids)
    assert isinstance(con, Tensor) and isinstance(mml, Tensor)
    return config.contrastive_weight * con + config.caption_weight * cap + mml


def gradients(module: ClipLlamaModule, loss: Tensor) -> dict[str, Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_training_step_equals_model_forward_and_losses(
    data: DigitsCaptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = make_module(data, monkeypatch)
    batch: dict[str, Any] = next(iter(data.val_dataloader()))
    module.train()
    step_loss = module.training_step(batch, 0)
    step_grads = gradients(module, step_loss)
    inputs, target = module.pipeline_inputs(batch)  # the strategy's pp = 1 path
    chunk_loss = module.pipeline_loss(PipelineChunk(module.pipeline_blocks())(*inputs), target)
    model = module.fusion_model
    out = model(batch["images"], batch["input_ids"], batch["attention_mask"])
    model_loss = written_out_loss(out, batch["target_ids"], module.loss_config)
    assert torch.equal(step_loss, model_loss) and torch.equal(chunk_loss, model_loss)
    model_grads = gradients(module, model_loss)
    assert step_grads.keys() == model_grads.keys() and len(step_grads) > 20
    for name, grad in step_grads.items():
        assert torch.equal(grad, model_grads[name]), name
    # the loss sees every stream: the caption term is not the whole story
    assert not torch.allclose(model_loss, 3.0 * caption_loss(out.logits, batch["target_ids"]))


def test_eval_outputs_equal_and_ema_heads_are_the_models(
    data: DigitsCaptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = make_module(data, monkeypatch)
    batch: dict[str, Any] = next(iter(data.val_dataloader()))
    module.eval()
    with torch.no_grad():
        got = module(batch)
        prompts = data.class_prompts()
        want = module.fusion_model(
            batch["images"],
            batch["input_ids"],
            batch["attention_mask"],
            prompts["input_ids"],
            prompts["attention_mask"],
        )
    assert got.class_features.shape == (10, 16) and got.class_features.abs().sum() > 0
    for name, a, b in zip(FusionOutput._fields, got, want, strict=True):
        assert torch.equal(a, b), name
    head = module.head
    assert head is not None and head.momentum is module.fusion_model.momentum_heads
    assert any("momentum" in k for k in module.state_dict())  # checkpointed with the blocks
    with torch.no_grad():
        module.fusion_model.image_head.weight.add_(1.0)
    before = head.momentum.state_dict()["image_head.weight"].clone()
    head.ema_update()
    moved = head.momentum.state_dict()["image_head.weight"]
    torch.testing.assert_close(moved, before + (1 - module.loss_config.mml.momentum))


def test_generate_is_a_greedy_loop_over_the_model(
    data: DigitsCaptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = make_module(data, monkeypatch).eval()
    images, length = next(iter(data.val_dataloader()))["images"][:4], 6
    tok = data.tokenizer
    got = module.generate(images, length)
    ids = torch.full((4, length), tok.pad_id)
    ids[:, 0] = tok.bos_id
    done = torch.zeros(4, dtype=torch.bool)
    with torch.no_grad():
        for t in range(1, length):
            mask = (torch.arange(length) < t).long().expand(4, -1)
            logits = module.fusion_model(images, ids, mask).logits
            ids[:, t] = torch.where(done, tok.pad_id, logits[:, t - 1, : tok.vocab_size].argmax(-1))
            done |= ids[:, t] == tok.eos_id
    assert torch.equal(got, ids)


def test_logged_terms_are_those_of_the_same_step() -> None:
    """The run summary and the progress bar read ``train/<term>`` in their batch-end hooks,
    which run before the module's: the terms are logged right after backward, so each step's
    ``train_loss`` is the weighted sum of that step's own terms (they lagged one step)."""
    data = rw.digits()
    module = rw.tiny_module(data.vocab_size)
    rec = rw.fit(module, rw.batches(data, 3))
    c = module.loss_config
    for loss, terms in zip(rec.losses, rec.terms, strict=True):
        total = (
            c.contrastive_weight * terms["contrastive"]
            + c.caption_weight * terms["caption"]
            + c.mml.weight * terms["mml"]
        )
        # rel 1e-4: the steps' losses differ by > 1e-2, so a one-step lag cannot pass
        assert total == pytest.approx(loss, rel=1e-4), (rec.losses, rec.terms)


def test_aux_free_moe_bias_moves_after_each_optimizer_step() -> None:
    """The recipe module runs the aux-loss-free balancing step after each optimizer step (and
    only then): the bias of every MoE layer moves by the step rate, the pending load is cleared."""
    from lightning_mmpar.models import MoEConfig, MoEFeedForward

    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_width=32,
        router_dim=8,
        load_balancing="aux_free",
        bias_update_rate=0.01,
    )
    digits = rw.digits()
    module = rw.tiny_module(digits.vocab_size, moe=moe)
    rw.fit(module, rw.batches(digits, 2), accumulate=2)  # one optimizer step over 2 batches
    layers = [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    assert len(layers) == 3  # the adapter's FFN and both decoder layers
    for layer in layers:  # one step of +-rate per expert (0 exactly at the mean load)
        moved = layer.expert_bias.abs()
        assert bool(((moved - 0.01).abs() < 1e-7).any()), layer.expert_bias
        assert bool((((moved - 0.01).abs() < 1e-7) | (moved == 0)).all()), layer.expert_bias
        assert not layer.pending_load.any()


def test_plan_options_and_their_deprecated_name(data: DigitsCaptions) -> None:
    """``plan`` (``model.plan:``) holds the fusion plan's options; ``tensor_parallel`` is its
    deprecated name (warned, kept under ``plan`` in the hyper-parameters, refused next to a
    different ``plan``); the module's plan checkpoints nothing unless asked, and the deprecated
    ``activation_checkpointing`` asks for the strategy's ``"layers"``."""
    from lightning_mmpar.plans import FusionPlanOptions, TensorParallelOptions

    fusion = rw.tiny_fusion()
    module = ClipLlamaModule(fusion=fusion, plan=FusionPlanOptions(vl_combine="all_gather"))
    assert module.plan_options.vl_combine == "all_gather"
    assert "tensor_parallel" not in module.hparams and "plan" in module.hparams
    with pytest.warns(DeprecationWarning, match="model.tensor_parallel is deprecated"):
        old = ClipLlamaModule(fusion=fusion, tensor_parallel=FusionPlanOptions(vocab_multiple=16))
    assert old.plan_options.vocab_multiple == 16 and "tensor_parallel" not in old.hparams
    assert old.hparams["plan"] == FusionPlanOptions(vocab_multiple=16)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="give one of them"):
        ClipLlamaModule(
            fusion=fusion,
            plan=FusionPlanOptions(vocab_multiple=16),
            tensor_parallel=TensorParallelOptions(vocab_multiple=32),
        )
    with pytest.warns(DeprecationWarning, match="tp_options is deprecated: use plan_options"):
        assert old.tp_options is old.plan_options
    old._trainer = SimpleNamespace(datamodule=data)  # type: ignore[assignment]
    old.configure_model()
    plan = old.parallel_plan(ParallelDims(world_size=1))
    assert plan.root is old.fusion_model and plan.checkpointing is None
    assert plan.layers == checkpoint_units(old.fusion_model)
    with pytest.warns(DeprecationWarning):
        options = FusionPlanOptions(activation_checkpointing=True)
    asked = ClipLlamaModule(fusion=fusion, plan=options)
    asked._trainer = SimpleNamespace(datamodule=data)  # type: ignore[assignment]
    asked.configure_model()  # no mm_parallel: the module applies its plan, checkpointing too
    units = [asked.fusion_model.get_submodule(p) for p in checkpoint_units(asked.fusion_model)]
    assert all(getattr(u, "_mmpar_block_options", False) for u in units)
    assert asked.parallel_plan(ParallelDims(world_size=1)).checkpointing == "layers"


def test_projector_freezing_and_its_own_rate() -> None:
    """``finetune.train_projector`` freezes the projector; ``optim.lr_projector`` gives it its
    own parameter groups (unset: it stays in the adapter groups at ``lr_adapter``)."""
    from lightning_mmpar.recipes.optim import parameter_groups
    from lightning_mmpar.recipes.options import OptimConfig
    from tests.builders import tiny_fusion_config

    for train, lr in ((False, 0.5), (True, None), (True, 0.5)):
        module = ClipLlamaModule(
            fusion=tiny_fusion_config("recipe"),
            finetune=FinetuneConfig(train_projector=train),
            optim=OptimConfig(lr=1e-3, lr_adapter=2e-3, lr_projector=lr),
            vocab_size=64,
        )
        module._trainer = SimpleNamespace()  # type: ignore[assignment]
        module.configure_model()
        projector = list(module.fusion_model.projector.parameters())
        assert projector and all(p.requires_grad is train for p in projector)
        groups = parameter_groups(module, module.fusion_model, module.optim)
        held = {id(p): g["name"].split(".")[0] for g in groups for p in g["params"]}
        rates = {g["name"]: g["lr"] for g in groups}
        want = None if not train else "projector" if lr is not None else "adapter"
        assert {held.get(id(p)) for p in projector} == {want}
        assert rates.get("projector", lr) == lr and rates["adapter"] == 2e-3


def test_a_rank_with_nothing_to_train_gets_an_empty_optimizer() -> None:
    """A pipeline stage of frozen blocks only (a frozen ViT's) holds no trainable parameter:
    the recipe's optimizer has one empty group (torch refuses an empty parameter list; before,
    fit failed there on every rank: 2 processes, Qwen2-VL, ``partition [3]``, the first stage
    the frozen ViT's stem and two layers, trained equal to one process by hand)."""
    from lightning_mmpar.recipes.optim import recipe_optimizer
    from lightning_mmpar.recipes.options import OptimConfig
    from tests.builders import tiny_fusion_config

    module = ClipLlamaModule(
        fusion=tiny_fusion_config("recipe"), optim=OptimConfig(lr=1e-3), vocab_size=64
    )
    module._trainer = SimpleNamespace(estimated_stepping_batches=4)  # type: ignore[assignment]
    module.configure_model()
    for p in module.parameters():
        p.requires_grad_(False)
    opt = recipe_optimizer(module)["optimizer"]
    assert [(g["name"], g["params"]) for g in opt.param_groups] == [("frozen", [])]
    opt.step()  # nothing to step, no error


def test_overflow_counts_are_logged_cumulatively() -> None:
    """A ragged batch's ``overflow [B, 2]`` (the collator's truncated / dropped samples, which
    travel with the batch from DataLoader workers) is logged as cumulative ``data/truncated``
    and ``data/dropped`` (summed over the dp group: one process here); batches without it
    log nothing."""
    module = rw.tiny_module(rw.digits().vocab_size)
    module._trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace())  # type: ignore[assignment]
    logged: dict[str, float] = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)  # type: ignore[method-assign]
    module.on_train_batch_start({"input_ids": torch.zeros(2, 3)}, 0)
    assert logged == {}
    module.on_train_batch_start({"overflow": torch.tensor([[1, 2], [3, 0]])}, 0)
    module.on_train_batch_start({"overflow": torch.tensor([[0, 1]])}, 1)
    assert logged == {"data/truncated": 4.0, "data/dropped": 3.0}


@pytest.mark.parametrize("kind", ["ragged", "ragged moe", "one image"])
def test_blocks_return_no_views(kind: str) -> None:
    """No block returns a grad-requiring view (a linear layer over 4-d image slots, the
    logit scale's ``expand``, the MoE stream's ``unflatten``): FSDP2 warns on each such output
    that backward may "fail or produce wrong gradients" (8 warnings a dp2 ragged run)."""
    from tests.recipes import parity_matrix_worker as pm
    from tests.recipes import ragged_parity_worker as rp

    if kind == "one image":
        data = rw.digits()
        module, batch = rw.tiny_module(data.vocab_size), rw.batches(data, 1)[0]
    else:
        module = pm.build(rp.VOCAB, "moe" if "moe" in kind else None)
        batch = rp.batches(1)[0]
    module.configure_model()
    module.setup("fit")
    module.train()
    state, _ = module.pipeline_inputs(batch)
    for block in module.pipeline_blocks():
        state = block(*state)
        views = [i for i, t in enumerate(state) if t.requires_grad and t._base is not None]
        assert not views, (type(block).__name__, views)
