"""Single-process checks of the losses against outside oracles (open_clip, transformers)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from lightning_mmpar.losses.caption import caption_loss, plain_caption_loss
from lightning_mmpar.losses.contrastive import ContrastiveLoss, LogitScale, contrastive_logits
from lightning_mmpar.losses.mml import (
    MMLConfig,
    MMLLoss,
    MomentumHeads,
    ema_update,
    kl_to_targets,
    momentum_copy,
)


def _features(n: int = 6, d: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    text = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    return image, text


def _loss_and_grads(
    loss_fn: nn.Module, bias: float | None, **kwargs: bool
) -> tuple[torch.Tensor, ...]:
    image, text = (t.clone().requires_grad_() for t in _features())
    scale = LogitScale(init_scale=10.0)
    loss = loss_fn(image, text, scale(), logit_bias=bias, **kwargs)
    loss = loss["contrastive_loss"] if isinstance(loss, dict) else loss
    loss.backward()
    assert image.grad is not None and text.grad is not None
    assert scale.log_scale.grad is not None
    return loss.detach(), image.grad, text.grad, scale.log_scale.grad


@pytest.mark.parametrize("bias", [None, -0.5])
@pytest.mark.parametrize("local_loss", [False, True])
def test_contrastive_matches_open_clip(bias: float | None, local_loss: bool) -> None:
    ours = _loss_and_grads(ContrastiveLoss(local_loss=local_loss), bias)
    oracle = _loss_and_grads(ClipLoss(), bias)
    for a, b in zip(ours, oracle, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours[0].item() > 0


def test_contrastive_dict_and_known_value() -> None:
    # Perfectly aligned orthonormal pairs with scale s: each row is CE of one s among zeros.
    eye = torch.eye(4)
    out = ContrastiveLoss()(eye, eye, 3.0, output_dict=True)
    assert isinstance(out, dict) and list(out) == ["contrastive_loss"]
    expected = -math.log(math.exp(3.0) / (math.exp(3.0) + 3))
    assert out["contrastive_loss"].item() == pytest.approx(expected, rel=1e-6)


def test_contrastive_logits_without_group_are_single_device() -> None:
    image, text = _features()
    per_image, per_text, targets = contrastive_logits(image, text, 2.0, local_loss=True)
    torch.testing.assert_close(per_image, 2.0 * image @ text.T)
    torch.testing.assert_close(per_text, per_image.T)
    assert targets.tolist() == list(range(6))


def test_contrastive_rejects_unpaired_features() -> None:
    with pytest.raises(ValueError, match=r"image_features \(4, 3\) and text_features \(5, 3\)"):
        ContrastiveLoss()(torch.randn(4, 3), torch.randn(5, 3), 1.0)


def test_no_pair_anywhere_gives_zero_on_the_graph_not_nan() -> None:
    """A ragged batch with no image-caption pair (on every rank): InfoNCE and MML are 0 with
    zero gradients (an empty cross-entropy or KL is NaN, and ``0 * NaN`` poisons the total
    even at weight 0: the digits recipe's dp2 run at 4 samples per rank did)."""
    image, text = (torch.zeros(0, 5, requires_grad=True) for _ in range(2))
    scale = LogitScale(init_scale=10.0)
    con = ContrastiveLoss()(image, text, scale())
    mml = MMLLoss()(image, text, image.detach(), text.detach(), scale())
    assert isinstance(con, torch.Tensor) and isinstance(mml, torch.Tensor)
    assert float(con) == 0.0 and float(mml) == 0.0
    (con + mml).backward()
    assert scale.log_scale.grad is not None and float(scale.log_scale.grad) == 0.0


def test_unweighted_coupled_terms_are_not_computed() -> None:
    """Both weights 0 (a caption-only recipe): the coupled term is 0 on the features' graph
    and neither term is computed (nothing gathered, nothing counted for logging)."""
    from lightning_mmpar.recipes.losses import RecipeLoss
    from lightning_mmpar.recipes.options import LossConfig

    image, text = (t.clone().requires_grad_() for t in _features())
    loss = RecipeLoss(LossConfig(contrastive_weight=0.0, mml=MMLConfig(weight=0.0)), None)
    got = loss.coupled((image, text, image.detach(), text.detach(), torch.full((6,), 10.0)))
    assert float(got) == 0.0 and got.requires_grad
    assert not loss.terms.any()  # no term computed
    weighted = RecipeLoss(LossConfig(contrastive_weight=1.0, mml=MMLConfig(weight=0.0)), None)
    assert float(weighted.coupled((image, text, image, text, torch.full((6,), 10.0)))) > 0


def test_logit_scale_clamps_the_parameter_not_the_output() -> None:
    scale = LogitScale(init_scale=50.0, max_scale=100.0)
    assert scale().item() == pytest.approx(50.0)
    with torch.no_grad():
        scale.log_scale.fill_(math.log(100.0))
    scale().backward()  # at the cap the scale still has a gradient (CLIP, open_clip)
    assert scale.log_scale.grad is not None and scale.log_scale.grad.item() == pytest.approx(100.0)
    with torch.no_grad():
        scale.log_scale.fill_(10.0)
    assert scale().item() == pytest.approx(math.exp(10.0), rel=1e-6)  # output not clamped
    assert scale.clamp_().log_scale.item() == pytest.approx(math.log(100.0))
    with torch.no_grad():
        scale.log_scale.fill_(-1.0)
    assert scale.clamp_().log_scale.item() == 0.0  # open_clip's lower bound: s >= 1
    assert not LogitScale(learnable=False).log_scale.requires_grad
    with pytest.raises(ValueError, match=r"init_scale \(200.0\) must be in \[1, max_scale=100"):
        LogitScale(init_scale=200.0)


def _heads() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)), nn.Linear(5, 3)


def test_ema_update_formula_and_extremes() -> None:
    image_head, _ = _heads()
    target = momentum_copy(image_head)
    assert not any(p.requires_grad for p in target.parameters())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with torch.no_grad():
        for p in image_head.parameters():
            p.add_(1.0)
    ema_update(target, image_head, 0.9)
    for name, value in target.state_dict().items():
        expected = 0.9 * before[name] + 0.1 * image_head.state_dict()[name]
        torch.testing.assert_close(value, expected)
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    ema_update(target, image_head, 1.0)
    assert all(torch.equal(v, frozen[k]) for k, v in target.state_dict().items())
    ema_update(target, image_head, 0.0)
    assert all(torch.equal(v, image_head.state_dict()[k]) for k, v in target.state_dict().items())


def test_ema_update_errors() -> None:
    with pytest.raises(ValueError, match=r"only in target \[\], only in source \['bias'\]"):
        ema_update(nn.Linear(2, 2, bias=False), nn.Linear(2, 2), 0.5)
    with pytest.raises(ValueError, match=r"parameter 'weight': target shape \(3, 2\)"):
        ema_update(nn.Linear(2, 3), nn.Linear(2, 2), 0.5)
    with pytest.raises(ValueError, match=r"momentum \(1.5\) must be in \[0, 1\]"):
        ema_update(nn.Linear(2, 2), nn.Linear(2, 2), 1.5)
    with pytest.raises(ValueError, match=r"momentum \(-0.1\)"):
        MMLConfig(momentum=-0.1)
    with pytest.raises(ValueError, match=r"weight \(-1.0\) must be >= 0"):
        MMLConfig(weight=-1.0)


def test_mml_is_zero_for_fresh_copy_and_matches_kl_formula() -> None:
    image_head, text_head = _heads()
    image_embeds, text_embeds = torch.randn(6, 4), torch.randn(6, 5)
    mml = MMLLoss(config=MMLConfig(weight=0.5, momentum=0.5))
    heads = mml.make_heads(image_head, text_head)
    assert isinstance(heads, MomentumHeads) and heads.momentum == 0.5

    def current() -> tuple[torch.Tensor, torch.Tensor]:
        image = F.normalize(image_head(image_embeds), dim=-1)
        return image, F.normalize(text_head(text_embeds), dim=-1)

    fresh = mml(*current(), *heads(image_embeds, text_embeds), 5.0)
    assert isinstance(fresh, torch.Tensor) and abs(fresh.item()) < 1e-6
    with torch.no_grad():
        for p in [*image_head.parameters(), *text_head.parameters()]:
            p.add_(0.3 * torch.randn_like(p))
    image, text = current()
    m_image, m_text = heads(image_embeds, text_embeds)
    assert not m_image.requires_grad
    out = mml(image, text, m_image, m_text, 5.0, output_dict=True)
    assert isinstance(out, dict)

    def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
        p, q = p_logits.softmax(-1), q_logits.softmax(-1)
        return (p * (p.log() - q.log())).sum(-1).mean()

    cur, mom = 5.0 * image @ text.T, 5.0 * m_image @ m_text.T
    expected = 0.5 * (kl(mom, cur) + kl(mom.T, cur.T)) / 2
    torch.testing.assert_close(out["mml_loss"], expected)
    assert out["mml_loss"].item() > 1e-4
    heads.update(image_head, text_head)
    moved = heads(image_embeds, text_embeds)[0]
    assert not torch.allclose(moved, m_image)


def test_mml_gradient_is_soft_target_cross_entropy() -> None:
    logits = torch.randn(4, 4, requires_grad=True)
    targets = torch.randn(4, 4)
    kl_to_targets(logits, targets).backward()
    soft = -(targets.softmax(-1) * logits.detach().log_softmax(-1)).sum(-1).mean()
    ref_logits = logits.detach().clone().requires_grad_()
    (-(targets.softmax(-1) * ref_logits.log_softmax(-1)).sum(-1).mean()).backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert soft.item() > 0


def test_caption_loss_matches_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7))
    targets[1, 4:] = -100
    targets[2, 2:] = -100
    ours = caption_loss(logits, targets)
    oracle = ForCausalLMLoss(logits, targets, vocab_size=11)
    torch.testing.assert_close(ours, oracle)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_oracle,) = torch.autograd.grad(oracle, logits)
    torch.testing.assert_close(g_ours, g_oracle)
    unshifted = plain_caption_loss(logits, targets, shift=False)
    torch.testing.assert_close(
        unshifted, F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    )


def test_caption_loss_errors() -> None:
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\) must be \[batch, seq, vocab\]"):
        caption_loss(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got a plain torch\.Tensor"):
        caption_loss(torch.randn(2, 5, 7), torch.zeros(2, 5, dtype=torch.long), loss_parallel=True)


class _Towers(nn.Module):
    """Image and text projections with dropout, features for a contrastive batch loss."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(5, 4), nn.Linear(5, 4)
        self.drop = nn.Dropout(0.5)
        self.log_scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        u = F.normalize(self.image(self.drop(x)), dim=-1)
        v = F.normalize(self.text(self.drop(y)), dim=-1)
        return u, v, self.log_scale.exp().expand(x.shape[0])

    def pipeline_batch_coupled(self) -> bool:
        return True

    def pipeline_batch_loss(self, features: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = ContrastiveLoss()(features[0], features[1], features[2][0])
        assert isinstance(loss, torch.Tensor)
        return loss


def test_gradient_cache_gives_the_whole_batch_gradient_with_replayed_dropout() -> None:
    """Gao et al. 2021: a no-grad pass collecting features, the batch loss's gradient on them,
    then per micro-batch ``M * <f_m, g_m>`` averaged over M: the whole batch's gradient, with the
    dropout masks of pass 1 replayed in pass 2 (the features are recomputed exactly)."""
    from lightning_mmpar.parallel import gradient_cache as gc

    torch.manual_seed(0)
    model = _Towers()
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    parts = list(zip(x.split(2), y.split(2), strict=True))
    rng = gc.RNGReplay([model], torch.device("cpu"))
    rng.record()
    with torch.no_grad():
        cached = [model(a, b) for a, b in parts]
    loss, grads = gc.batch_gradients(model, cached)
    rng.replay()
    total = torch.zeros(())
    for m, (a, b) in enumerate(parts):
        features = model(a, b)
        assert all(torch.equal(f, c) for f, c in zip(features, cached[m], strict=True))
        total = total + gc.surrogate(features, grads[m], 4.0) / 4  # the schedule's 1 / M
    total.backward()
    got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    rng.replay()  # pass 1's masks once more, for the whole-batch reference
    whole = [model(a, b) for a, b in parts]
    rng.stop()
    want_loss = model.pipeline_batch_loss(gc.cat_features(whole))
    want_loss.backward()
    assert torch.allclose(loss, want_loss.detach(), rtol=1e-6)
    for g, p in zip(got, model.parameters(), strict=True):
        assert p.grad is not None and torch.allclose(g, p.grad, rtol=1e-5, atol=1e-7)
    assert model.log_scale.grad is not None and model.log_scale.grad.abs() > 0  # via its feature
