"""Generation with a key/value cache, captions at every layout, and evaluation with a short last
batch and class recall.

Oracles: transformers' ``LlamaForCausalLM.generate(use_cache=True)`` on the language tower
(tokens and per-step scores), the fusion model's full forward (logits of every prefix), the
uncached greedy loop, and one process for the 2-process layouts (``generation_worker``: pp 2 and
tp 2 ``predict`` JSONL, pp 2 ``validate`` with a last batch of 5 under 2 micro-batches, FSDP2
at dp 2 cached and uncached captions; the same at tp 2 x pp 2 in a 4-rank world).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mmpar.models.convert import import_llama, llama_config
from lightning_mmpar.models.decoding import DecodeCache, decode_block, language_decode_step
from lightning_mmpar.models.language import LanguageConfig, LanguageModel
from lightning_mmpar.models.moe_routing import MoEConfig
from lightning_mmpar.recipes.metrics import ClassRecall
from lightning_mmpar.testing import spawn
from tests.builders import fake_trainer
from tests.recipes import generation_worker as gw
from tests.recipes import recipe_faults_worker as rw

ATOL = 1e-5


def _module(moe: MoEConfig | None = None) -> Any:
    data = rw.digits()
    module = rw.tiny_module(data.vocab_size, moe=moe)
    module._trainer = SimpleNamespace(datamodule=data)
    module.configure_model()
    module.setup("predict")
    return module.eval(), data


def test_language_cache_equals_transformers_generate() -> None:
    """Prefill of a 4-token prompt (causal mask among new positions), then one token per step:
    the tokens and every step's logits equal ``LlamaForCausalLM.generate(use_cache=True)``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LanguageConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    hf = LlamaForCausalLM(llama_config(cfg)).eval()
    with torch.no_grad():  # larger weights: well-separated argmaxes
        for p in hf.parameters():
            p.mul_(20.0) if p.ndim > 1 else None
    _, state = import_llama(hf)
    ours = LanguageModel(cfg).eval()
    ours.load_state_dict(state)
    prompt = torch.randint(3, 40, (3, 4))
    new = 8
    want = hf.generate(
        prompt,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    cache, step, tokens, logits = DecodeCache(), prompt, [prompt], []
    with torch.no_grad():
        for _ in range(new):
            out = language_decode_step(ours, step, cache)[:, -1]
            step = out.argmax(-1, keepdim=True)
            tokens.append(step)
            logits.append(out)
    assert torch.equal(torch.cat(tokens, 1), want.sequences)
    assert len(cache.layers) == 2 and cache.length == 4 + new - 1
    for got, ref in zip(logits, want.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-5)


def test_cached_fusion_logits_equal_the_full_forward() -> None:
    """Teacher-forced over real captions: the cached decode (vision, projector and image keys
    once) gives each prefix's last logits of ``FusionModel.forward`` on that prefix; vision
    blocks run at the prefill only."""
    module, data = _module()
    batch = next(iter(data.val_dataloader()))
    images, ids = batch["images"][:4], batch["input_ids"][:4, :5]
    blocks, cache, calls, decoding = module.pipeline_blocks(), DecodeCache(), [], [True]
    module.fusion_model.vision.transformer.resblocks[0].register_forward_hook(
        lambda *a: calls.append(1) if decoding[0] else None
    )
    with torch.no_grad():
        for t in range(1, ids.shape[1] + 1):
            state: tuple[torch.Tensor, ...] = (images,) if t == 1 else ()
            for block in blocks:
                state = decode_block(block, state, ids[:, t - 1 : t], cache)
            cache.advance(1)
            decoding[0] = False
            mask = torch.ones(4, t, dtype=torch.long)
            full = module.fusion_model(images, ids[:, :t], mask).logits[:, -1]
            torch.testing.assert_close(state[0][:, -1], full, atol=ATOL, rtol=1e-5)
            decoding[0] = True
    assert len(calls) == 1 and cache.length == ids.shape[1]


def test_generate_cached_equals_uncached_and_refusals() -> None:
    module, data = _module()
    images = next(iter(data.val_dataloader()))["images"][:4]
    cached = module.generate(images, 8)
    assert torch.equal(cached, module.generate(images, 8, use_cache=False))
    assert cached.shape == (4, 8) and (cached[:, 0] == data.tokenizer.bos_id).all()
    module.train()
    with pytest.raises(ValueError, match=r"use_cache=True.*training mode"):
        module.generate(images, 4, use_cache=True)
    moe = MoEConfig(num_experts=2, top_k=1, ffn_width=16, router_dim=8)
    module, _ = _module(moe)
    with pytest.raises(ValueError, match=r"use_cache=True.*mixture-of-experts"):
        module.generate(images, 4, use_cache=True)
    assert module.generate(images[:2], 4).shape == (2, 4)  # None: uncached for MoE


def test_class_recall_hand_computed() -> None:
    """Labels ``[0, 0, 1, 2]``; captions 0 and 1 are identical (same class), image 2 is
    closer to caption 3 (label 2) than to its own (label 1)."""
    e = torch.eye(3)
    text = torch.stack([e[0], e[0], e[1], e[2]])
    image = torch.stack([e[0], e[0], F.normalize(0.6 * e[1] + 0.8 * e[2], dim=0), e[2]])
    metric = ClassRecall(ks=(1, 2), sync_on_compute=False)
    metric.update(image[:2], text[:2], torch.tensor([0, 0]))
    metric.update(image[2:], text[2:], torch.tensor([1, 2]))
    got = {k: float(v) for k, v in metric.compute().items()}
    assert got == {
        "i2t_class_recall@1": 0.75,
        "i2t_class_recall@2": 1.0,
        "t2i_class_recall@1": 1.0,
        "t2i_class_recall@2": 1.0,
    }
    with pytest.raises(ValueError, match="labels"):
        metric.update(image, text, torch.tensor([0, 1]))


def _reference(root: Path) -> dict[str, Any]:
    """One process: predict, cached/uncached captions and validate (``gw.run``)."""
    return gw.run("auto", 1, root, validate=True)


def test_predict_and_short_batch_eval_at_pp2_and_tp2_equal_one_process(tmp_path: Path) -> None:
    got = spawn(gw.world, 2, str(tmp_path), timeout=600)
    want = _reference(tmp_path / "one")
    rows = [json.loads(x) for x in (tmp_path / "one/captions.rank0.jsonl").read_text().splitlines()]
    assert len(rows) == gw.SAMPLES and rows == want["rows"]
    assert torch.equal(want["cached"], want["uncached"])
    for layout in ("pp2", "tp2"):
        for rank in range(2):
            path = tmp_path / layout / f"captions.rank{rank}.jsonl"
            assert [json.loads(x) for x in path.read_text().splitlines()] == rows, (layout, rank)
            assert torch.equal(got[rank][layout]["cached"], want["cached"]), (layout, rank)
    for rank in range(2):
        assert torch.equal(got[rank]["pp2"]["uncached"], want["cached"]), rank
        fsdp = got[rank]["fsdp2"]
        assert fsdp["sharded"], rank
        mine = want["cached"][4 * rank : 4 * rank + 4]
        assert torch.equal(fsdp["cached"], mine) and torch.equal(fsdp["uncached"], mine), rank
    metrics = want["metrics"]
    assert {"val/i2t_class_recall@1", "val/t2i_class_recall@5", "val_loss"} <= metrics.keys()
    for rank in range(2):
        pp2 = got[rank]["pp2"]["metrics"]
        for key, value in metrics.items():
            assert pp2[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, key)


def test_predict_decode_and_short_batch_eval_at_tp2_pp2_equal_one_process(tmp_path: Path) -> None:
    """Tensor and pipeline parallel together (4 ranks): captions (JSONL of every rank, cached
    and uncached) and validation metrics equal one process."""
    got = spawn(gw.world_tp2_pp2, 4, str(tmp_path), timeout=600)
    want = _reference(tmp_path / "one")
    rows = [json.loads(x) for x in (tmp_path / "one/captions.rank0.jsonl").read_text().splitlines()]
    for rank in range(4):
        path = tmp_path / "tp2_pp2" / f"captions.rank{rank}.jsonl"
        assert [json.loads(x) for x in path.read_text().splitlines()] == rows, rank
        assert torch.equal(got[rank]["cached"], want["cached"]), rank
        assert torch.equal(got[rank]["uncached"], want["cached"]), rank
        for key, value in want["metrics"].items():
            assert got[rank]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_run_summary_prints_class_recall_apart_from_per_pair(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_mmpar.recipes.summary import RunSummary

    caplog.set_level(logging.INFO)
    trainer: Any = fake_trainer(
        tmp_path,
        sanity_checking=False,
        callback_metrics={
            "val/i2t_recall@1": torch.tensor(0.181),
            "val/i2t_class_recall@1": torch.tensor(0.925),
        },
    )
    summary = RunSummary(plots=False)
    summary.on_fit_start(trainer, None)  # type: ignore[arg-type]
    summary.on_validation_end(trainer, None)  # type: ignore[arg-type]
    summary.on_fit_end(trainer, None)  # type: ignore[arg-type]
    assert summary.summary["retrieval"]["i2t_class_recall@1"] == pytest.approx(0.925)
    printed = caplog.text
    assert "retrieval per pair (own caption)  i2t_recall@1 18.1%" in printed, printed
    assert "retrieval by class (same digit)   i2t_class_recall@1 92.5%" in printed, printed
