"""Layout-independent losses of the recipe (issue 9): every layout trains one process's loss.

One 2-process world (``layout_losses_worker.world``) against one process, same weights, same
global batches (captions of 4 to 8 scored tokens: every micro-batch and dp shard has its own
token count), 2 AdamW steps then one validation batch, relative 1e-5:

* ``pp2_mb2`` (1F1B) and ``pp2_mb4`` (GPipe): the caption term is the global token mean (not a
  mean of micro-batch means: 2.711 instead of 2.743 before), contrastive / MML negatives are the
  whole batch (gradient cache): logged ``train_loss`` and ``train/<term>`` of both steps, the
  first-step gradient of every parameter, ``val_loss`` and ``val/<term>``;
* ``dp2_mm`` (``mm_parallel`` DDP, the strategy's pp = 1 path) and ``dp2_lightning_ddp``
  (Lightning's DDP: the module's own steps) with 27 and 30 tokens on the two ranks: the same;
* ``pp2_mb2_micro``: ``negatives="micro_batch"`` gives the per-micro-batch value, computed here
  from one process's features, and differs from the global one.

The gradient cache's RNG replay (dropout masks of both passes equal) is checked on one process
in ``tests/unit/losses/test_losses.py``: the recipe's model has no dropout on its feature paths.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from lightning_mmpar.testing import spawn
from tests.recipes import layout_losses_worker as lw
from tests.recipes import recipe_faults_worker as rw

RTOL = 1e-5
LAYOUTS = ("pp2_mb2", "pp2_mb4", "dp2_mm", "dp2_lightning_ddp")


def worst_gradient(got: dict[str, Tensor], want: dict[str, Tensor]) -> tuple[str, float]:
    """The parameter with the largest ``|a - b| / |b|`` (norms; ``|b|`` floored at 1e-6 of the
    largest gradient norm: exact zeros are summation-order noise) and that ratio."""
    floor = 1e-6 * max(float(g.norm()) for g in want.values())
    ratios = {n: float((got[n] - b).norm()) / max(float(b.norm()), floor) for n, b in want.items()}
    name = max(ratios, key=ratios.__getitem__)
    return name, ratios[name]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


def micro_batch_reference(vocab: int) -> dict[str, float]:
    """Step-0 loss and terms with contrastive / MML negatives per half batch (one process)."""
    net = lw.module(vocab)
    net._trainer = SimpleNamespace()  # type: ignore[assignment]
    net.configure_model()
    net.setup("fit")
    net.train()
    batch = lw.data_of(0, 1)[0][0]
    with torch.no_grad():
        out = net(batch)
        cap = net._loss.caption(out.logits, batch["target_ids"])  # type: ignore[union-attr]
        feats = net.pipeline_features(tuple(out), batch["target_ids"])
        halves = [tuple(f[i * 4 : (i + 1) * 4] for f in feats) for i in range(2)]
        net._loss.terms.zero_()  # type: ignore[union-attr]
        coupled = [net.pipeline_batch_loss(h) for h in halves]
        terms = net._loss.terms  # type: ignore[union-attr]
    cfg = net.loss_config
    return {
        "loss": float(cfg.caption_weight * cap + sum(coupled) / 2),
        "train/contrastive": float(terms[0, 0] / terms[1, 0]),
        "train/mml": float(terms[0, 2] / terms[1, 2]),
        "train/caption": float(cap),
    }


@pytest.mark.distributed
def test_losses_equal_one_process_in_every_layout() -> None:
    results = spawn(lw.world, 2, timeout=900)
    vocab = rw.digits().vocab_size
    ref = lw.run(lw.module(vocab), "auto", 1)
    assert len(ref["losses"]) == lw.STEPS and len(ref["terms"]) == lw.STEPS
    assert {"val_loss", "val/caption", "val/contrastive", "val/mml"} <= ref["val"].keys()
    # the data: dp shards and micro-batches with different token counts
    shards = [lw.data_of(r, 2)[0][0]["target_ids"] for r in range(2)]
    assert [int((t[:, 1:] != -100).sum()) for t in shards] == [27, 30]
    for layout in LAYOUTS:
        per_rank = [r[layout] for r in results]
        for rank, got in enumerate(per_rank):
            for step in range(lw.STEPS):
                a, b = got["losses"][step], ref["losses"][step]
                assert close(a, b), (layout, rank, step, a, b)
                for name, value in ref["terms"][step].items():
                    assert close(got["terms"][step][name], value), (layout, rank, step, name)
            for name, value in ref["val"].items():
                assert close(got["val"][name], value), (layout, rank, name, got["val"][name])
        grads: dict[str, Tensor] = {}
        for got in per_rank:  # pipeline ranks hold their own stages' parameters
            grads.update(got["grads"])
        assert grads.keys() == ref["grads"].keys() and len(grads) > 50, layout
        name, ratio = worst_gradient(grads, ref["grads"])
        assert ratio <= RTOL, (layout, name, ratio)
        if layout.startswith("dp2"):
            for got in per_rank:
                assert worst_gradient(got["grads"], ref["grads"])[1] <= RTOL, layout
    # negatives="micro_batch": per-micro-batch contrastive / MML, global caption; not the
    # global value
    want = micro_batch_reference(vocab)
    for got in (r["pp2_mb2_micro"] for r in results):
        assert close(got["losses"][0], want["loss"]), (got["losses"][0], want["loss"])
        for name in ("train/contrastive", "train/mml", "train/caption"):
            assert close(got["terms"][0][name], want[name]), (name, got["terms"][0][name])
        assert abs(got["losses"][0] - ref["losses"][0]) > 1e-3 * abs(ref["losses"][0])


def test_negatives_option_is_validated() -> None:
    from lightning_mmpar.recipes.options import LossConfig

    assert LossConfig().negatives == "global_batch"
    with pytest.raises(ValueError, match="negatives \\('micro'\\) must be 'global_batch'"):
        LossConfig(negatives="micro")  # type: ignore[arg-type]
