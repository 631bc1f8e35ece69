"""Tiny pretrained towers written to disk, and the 4-process world that loads them.

:func:`write_towers` writes, offline, what a user brings: an open_clip ViT directory
(``open_clip_config.json`` + ``open_clip_model.safetensors``, the layout open_clip's
``local-dir:`` schema reads) and a transformers Llama directory (``save_pretrained``, safetensors)
holding a word-level ``PreTrainedTokenizerFast`` trained on the digits captions. The recipe's
module loads them (``model.pretrained``) in :func:`world` at tp 2 x pp 2, dp 2 (FSDP) x tp 2 and
pp 2 x dp 2 (FSDP), each run recording what every rank read and the first training steps' losses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.data.digits import TEMPLATES, DigitsCaptions, fill
from lightning_mmpar.losses.mml import MMLConfig
from lightning_mmpar.models.adapter import AdapterConfig
from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.models.language import LanguageConfig
from lightning_mmpar.recipes.options import (
    FinetuneConfig,
    LossConfig,
    OptimConfig,
    PretrainedConfig,
)
from tests.recipes import recipe_faults_worker as rw

VOCAB = 64  # the Llama checkpoint's rows (the word tokenizer has fewer ids)
OPEN_CLIP_CFG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {
        "image_size": 16,
        "patch_size": 8,
        "width": 32,
        "layers": 2,
        "head_width": 16,
        "mlp_ratio": 2.0,
    },
    "text_cfg": {"context_length": 8, "vocab_size": 32, "width": 16, "heads": 2, "layers": 1},
}
STEPS = 2


def write_towers(root: Path) -> dict[str, str]:
    """Write the tiny open_clip and Llama directories under ``root``; returns their paths."""
    import open_clip  # noqa: F401 - registers the model classes
    from open_clip.model import CLIP
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(123)
    vision, language = root / "open_clip", root / "llama"
    vision.mkdir(parents=True)
    clip = CLIP(**OPEN_CLIP_CFG)
    with torch.no_grad():  # non-trivial norms, biases and embeddings
        for p in clip.parameters():
            p.add_(0.05 * torch.randn_like(p))
    preprocess = {"mean": [0.5] * 3, "std": [0.25] * 3}
    config = {"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": preprocess}
    (vision / "open_clip_config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in clip.state_dict().items()}
    save_file(state, str(vision / "open_clip_model.safetensors"))

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=500.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    )
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(0.05 * torch.randn_like(p))
    llama.save_pretrained(str(language), safe_serialization=True)
    special = ["<pad>", "<bos>", "<eos>", "<unk>"]
    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [fill(t, c) for t in TEMPLATES for c in range(10)]
    words.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=special))
    PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    ).save_pretrained(str(language))
    return {"vision": str(vision), "language": str(language)}


def data(towers: dict[str, str]) -> DigitsCaptions:
    out = DigitsCaptions(
        image_size=16, batch_size=rw.BATCH, max_length=rw.TEXT_LENGTH, tokenizer=towers["language"]
    )
    out.setup()
    return out


class CheckedModule(rw.SeededModule):
    """Records, right after loading (the plan's step after TP, before the pipeline cut and
    FSDP), the error of every shard read against ``full`` (:func:`shard_errors`), when ``full``
    is set; reads deferred until FSDP sharded the parameters are checked when fitting starts
    (:class:`AtStart`)."""

    full: dict[str, Tensor] | None = None
    shard_errors: dict[str, float] | None = None

    def load_towers(self, dims: Any) -> None:
        super().load_towers(dims)
        if self.full is not None and self.load_report is not None:
            self.shard_errors = shard_errors(self, self.full)


def module(towers: dict[str, str], vocab_size: int, **optim: Any) -> CheckedModule:
    """The recipe module over the written towers: the YAML's tower sizes are left at their
    defaults (the files replace them), the 1.5 freezing policy (frozen ViT, first two decoder
    layers trained), joint attention on (its extras start fresh)."""
    return CheckedModule(
        fusion=FusionConfig(
            language=LanguageConfig(joint_attention=True, text_temperature=1.0),
            adapter=AdapterConfig(heads=2, width=32, ffn_width=48, dropout=0.0),
            contrastive_dim=16,
        ),
        finetune=FinetuneConfig(),
        loss=LossConfig(caption_weight=3.0, mml=MMLConfig(weight=0.4)),
        optim=OptimConfig(lr=1e-3, warmup_steps=1, min_lr_ratio=1.0, **optim),
        pretrained=PretrainedConfig(**towers),
        vocab_size=vocab_size,
    )


def references(towers: dict[str, str]) -> dict[str, Tensor]:
    """Full tensors as open_clip and transformers load them, under the fusion model's names
    (``vision.*`` / ``language.*``)."""
    import open_clip
    from transformers import LlamaForCausalLM

    clip = open_clip.create_model(f"local-dir:{towers['vision']}", load_weights=True)
    llama = LlamaForCausalLM.from_pretrained(towers["language"], local_files_only=True)
    out = {f"vision.{k}": v for k, v in clip.visual.state_dict().items()}
    for k, v in llama.state_dict().items():
        out[f"language.{k.removeprefix('model.')}"] = v
    return out


def _key(name: str) -> str:
    key = name.replace("attn.in_proj.weight", "attn.in_proj_weight")
    return key.replace("attn.in_proj.bias", "attn.in_proj_bias")


def shard_errors(net: Any, full: dict[str, Tensor], names: list[str] | None = None) -> dict:
    """``max |local - full[slice]|`` of every parameter the load report says was read (of
    ``names`` only, when given)."""
    assert net.load_report is not None
    model = net.fusion_model
    out = {}
    for name, (shape, index) in net.load_report.read.items():
        if names is not None and name not in names:
            continue
        param = model.get_parameter(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        want = full[_key(name)].reshape(shape)[index]
        out[name] = float((local.detach() - want).abs().max()) if want.numel() else 0.0
    return out


def gathered_errors(net: Any, full: dict[str, Tensor], names: list[str]) -> dict[str, float]:
    """``max |full_tensor() - checkpoint|`` of ``names`` (a collective: every rank, same
    names): the shards every rank filled after FSDP put together."""
    model = net.fusion_model
    out = {}
    for name in names:
        param = model.get_parameter(name)
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        want = full[_key(name)].reshape(whole.shape)
        out[name] = float((whole.detach() - want).abs().max())
    return out


class AtStart(Callback):
    """Records, when fitting starts (after the pipeline cut and FSDP), every rank's shard
    errors (at load; for reads deferred until after FSDP, its local shards and the gathered
    ``full_tensor()`` of each), its load report and the local bytes of the tower parameters it
    holds."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = pl_module.fusion_model
        towers = {id(p) for t in (model.vision, model.language) for p in t.parameters()}
        held = 0  # what the LightningModule holds (a dropped placeholder stays in model.vision)
        for p in pl_module.parameters():
            if id(p) in towers:
                local = p.to_local() if isinstance(p, DTensor) else p
                held += local.numel() * local.element_size()
        report = pl_module.load_report
        errors = dict(pl_module.shard_errors or {})
        if report.deferred:  # filled after FSDP: each rank's shard, and all of them together
            errors |= shard_errors(pl_module, pl_module.full, report.deferred)
            gathered = gathered_errors(pl_module, pl_module.full, report.deferred)
            errors |= {f"{n} (gathered)": e for n, e in gathered.items()}
        self.out = {
            "errors": errors,
            "deferred": report.deferred,
            "read": sorted(report.read),
            "placeholders": report.placeholders,
            "fresh": report.fresh,
            "bytes_read": report.bytes_read,
            "held": held,
            "stages": report.stages,
        }


def run(towers: dict[str, str], strategy: Any, rank: int, dp: int) -> dict[str, Any]:
    """Fit :data:`STEPS` steps on fixed batches (dp rank ``rank`` of ``dp`` takes its rows)."""
    digits = data(towers)
    full = references(towers)
    batches = rw.batches(digits, STEPS)
    n = rw.BATCH // dp
    mine = [{k: v[rank * n : (rank + 1) * n] for k, v in b.items()} for b in batches]
    net = module(towers, digits.vocab_size)
    net.full = full
    at_start = AtStart()
    rec = rw.fit(net, mine, strategy=strategy, devices=4, callbacks=[at_start])
    vision = [p for p in net.fusion_model.vision.parameters() if p.requires_grad]
    return {**at_start.out, "losses": rec.losses, "trainable_vision": len(vision)}


def world(rank: int, world_size: int, towers: dict[str, str]) -> dict[str, Any]:
    """tp 2 x pp 2 (1F1B, 2 micro-batches), dp 2 (FSDP) x tp 2, then pp 2 x dp 2 (FSDP;
    Megatron order: dp rank ``rank % 2``, stage ``rank // 2``)."""
    out: dict[str, Any] = {"rank": rank}
    tp2pp2 = MultimodalParallelStrategy(tensor_parallel=2, pipeline_parallel=2, micro_batches=2)
    out["tp2pp2"] = run(towers, tp2pp2, 0, 1)
    dist.barrier()
    fsdp = MultimodalParallelStrategy(tensor_parallel=2, data_parallel="fsdp")
    out["dp2tp2"] = run(towers, fsdp, rank // 2, 2)
    dist.barrier()
    pp_fsdp = MultimodalParallelStrategy(pipeline_parallel=2, micro_batches=2, data_parallel="fsdp")
    out["pp2dp2"] = run(towers, pp_fsdp, rank % 2, 2)
    return out


if __name__ == "__main__":  # python tests/recipes/pretrained_worker.py DIR (docs/quickstart.md)
    import sys

    print(json.dumps(write_towers(Path(sys.argv[1]))))
