"""Precision and memory options: validation, block selection, checkpointing's recomputation,
FSDP2 policies, FP8 conversion keeping hooks, and FP8Training in a Trainer (one process; the
multi-process parity of each option is tests/distributed/parallel/test_memory_options.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.callbacks import DriftConfig, FallbackConfig, FP8Training
from lightning_mmpar.parallel.activation import apply_block_options, select_blocks
from lightning_mmpar.parallel.fsdp_options import MemoryOptions
from lightning_mmpar.precision import Float8Linear, FP8Policy, convert_to_fp8

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mixed_precision": "fp16"}, "mixed_precision ('fp16') must be 'bf16'"),
        ({"mixed_precision": {"param_dtype": "half"}}, "mixed_precision['param_dtype'] ('half')"),
        ({"mixed_precision": {"params": "bfloat16"}}, "a dict with keys from"),
        ({"activation_checkpointing": "decoder"}, "unknown block kind(s) ['decoder']"),
        ({"activation_checkpointing": 0}, "activation_checkpointing (0) as a number"),
        ({"activation_checkpointing": True}, "activation_checkpointing (True) as a number"),
        ({"compile_blocks": "no_such_backend"}, "compile_blocks ('no_such_backend') is not"),
        ({"offload_optimizer": "yes"}, "offload_optimizer ('yes') must be True or False"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MemoryOptions(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        MultimodalParallelStrategy(**kwargs)


def test_combinations_are_refused() -> None:
    with pytest.raises(
        ValueError, match=re.escape("data_parallel='ddp'; set data_parallel='fsdp'")
    ):
        MultimodalParallelStrategy(mixed_precision="bf16", data_parallel="ddp")
    with pytest.raises(ValueError, match=re.escape("offload_optimizer=True is an FSDP2 policy")):
        MultimodalParallelStrategy(offload_optimizer=True, data_parallel="none")
    with pytest.raises(ValueError, match="expert_parallel=2"):
        MultimodalParallelStrategy(mixed_precision="bf16", expert_parallel=2)
    strategy = MultimodalParallelStrategy(mixed_precision="bf16")
    with pytest.raises(ValueError, match=re.escape("Trainer(precision='bf16-true')")):
        Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-true")


def test_fsdp_policies() -> None:
    kwargs = MemoryOptions(mixed_precision="bf16", offload_optimizer=True).fsdp_kwargs(
        torch.device("cpu")
    )
    mp = kwargs["mp_policy"]
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
    assert kwargs["offload_policy"].pin_memory is False  # pinned memory needs CUDA
    custom = MemoryOptions(mixed_precision={"param_dtype": "float16", "output_dtype": "float32"})
    mp = custom.fsdp_kwargs(torch.device("cpu"))["mp_policy"]
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) == (
        torch.float16,
        None,
        torch.float32,
    )
    assert MemoryOptions().fsdp_kwargs(torch.device("cpu")) == {}
    assert not MemoryOptions(activation_checkpointing="all").needs_fsdp


class Block(nn.Module):
    """A block that counts its forward runs (recomputation runs it again)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.runs = 0

    def forward(self, x: Tensor) -> Tensor:
        self.runs += 1
        return self.drop(torch.tanh(self.fc(x))) + x


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(k) for k in ("vision", "aligner", "language", "language")))


def test_block_selection() -> None:
    blocks = list(_blocks())
    assert select_blocks(blocks, "all") == [0, 1, 2, 3]
    assert select_blocks(blocks, 2) == [1, 3]
    assert select_blocks(blocks, 3) == [2]
    assert select_blocks(blocks, ["vision", "language"]) == [0, 2, 3]
    assert select_blocks(blocks, "aligner") == [1]
    assert select_blocks(blocks, None) == []
    with pytest.raises(ValueError, match=re.escape("matches no block: the model's block kinds")):
        select_blocks(blocks, "head")


def _step(model: nn.Module) -> tuple[Tensor, dict[str, Tensor], int]:
    saved = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal saved
        saved += 1
        return t

    torch.manual_seed(1)
    x = torch.randn(4, 8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x).square().sum()
    out.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, saved


def test_checkpointing_recomputes_exactly_and_saves_less() -> None:
    plain, ckpt = _blocks(), _blocks()
    assert apply_block_options(list(ckpt), "language") == [2, 3]
    assert apply_block_options(list(ckpt), "language") == [2, 3]  # a second call wraps nothing
    assert [getattr(b, "_mmpar_block_options", False) for b in ckpt] == [False, False, True, True]
    out_p, grads_p, saved_p = _step(plain)
    out_c, grads_c, saved_c = _step(ckpt)
    assert torch.equal(out_p, out_c)  # dropout masks replayed
    assert grads_p.keys() == grads_c.keys()
    for k in grads_p:
        assert torch.equal(grads_p[k], grads_c[k]), k
    assert [b.runs for b in plain] == [1, 1, 1, 1]
    assert [b.runs for b in ckpt] == [1, 1, 2, 2]  # recomputed in backward
    assert saved_c < saved_p, (saved_c, saved_p)
    assert list(ckpt.state_dict()) == list(plain.state_dict())  # names unchanged


def test_compile_per_block_keeps_results() -> None:
    plain, compiled, both = _blocks().eval(), _blocks().eval(), _blocks().eval()
    apply_block_options(list(compiled), None, "aot_eager")
    assert apply_block_options(list(both), 2, "aot_eager") == [1, 3]  # checkpointed + compiled
    out_p, grads_p, _ = _step(plain)
    for model in (compiled, both):
        out_c, grads_c, _ = _step(model)
        torch.testing.assert_close(out_c, out_p, rtol=1e-6, atol=0)
        for k in grads_p:
            torch.testing.assert_close(grads_c[k], grads_p[k], rtol=1e-6, atol=1e-7)


def test_fp8_conversion_keeps_forward_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    seen: list[str] = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(type(m).__name__))
    model[0].register_forward_hook(lambda m, args, out: out * 2)
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    ref = model[0].weight.detach().clone()
    convert_to_fp8(model, FP8Policy(backend="emulate", high_precision="fp32"))
    assert isinstance(model[0], Float8Linear) and model[0].weight.data_ptr() != 0
    model[0].precision = "fp32"
    out = model(x)
    torch.testing.assert_close(out, 2 * (x @ ref.T + model[0].bias), rtol=1e-6, atol=1e-6)
    assert seen == ["Float8Linear"]


class TinyLM(LightningModule):
    """Builds its layers in ``configure_model``, as the recipe does."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            self.head = nn.Linear(8, 1)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        assert self.net is not None
        return self.head(self.net(batch)).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_fp8_training_callback(tmp_path: Path) -> None:
    policy = FP8Policy(keep_high_precision=("head",), backend="auto")  # CPU: emulation
    fp8 = FP8Training(policy, FallbackConfig(max_retries=2), DriftConfig(check_every_n_steps=2))
    model = TinyLM()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[fp8],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(torch.randn(12, 8), batch_size=4))
    assert trainer.global_step == 3
    assert fp8.converted == ["net.0", "net.2"]
    assert isinstance(model.head, Float8Linear) and model.head.pinned
    assert model.head.precision == "bf16" and model.net[0].precision == "fp8"  # type: ignore[index]
    assert model.net[0].backend == "emulate"  # type: ignore[index]
    assert fp8.mon.config.check_every_n_steps == 2 and fp8._drive
    assert fp8.counters["attempts"] == 0  # nothing anomalous in 3 clean steps
    with pytest.raises(ValueError, match="give the drift options to one of them"):
        from lightning_mmpar.callbacks import GradientDriftMonitor

        FP8Training(drift=DriftConfig()).setup(
            Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[GradientDriftMonitor()]),
            TinyLM(),
            "fit",
        )


@pytest.mark.parametrize("name", ["1gpu", "8gpu", "16gpu"])
def test_gpu_yamls_document_the_options(name: str) -> None:
    """The commented ``precision.fp8`` section and ``memory`` strategy options of each GPU
    YAML, uncommented, build the callback and the strategy."""
    lines = (RECIPES / f"clip_llama_{name}.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# precision.fp8:"))
    block = [line[2:] for line in lines[start:] if re.match(r"# (precision:|  )", line)]
    args = yaml.safe_load("\n".join(block))["precision"]["fp8"]  # FP8Training's arguments
    policy = FP8Policy(
        **{**args["policy"], "keep_high_precision": tuple(args["policy"]["keep_high_precision"])}
    )
    cb = FP8Training(policy, FallbackConfig(**args["fallback"]), DriftConfig(**args["drift"]))
    assert cb.policy.keeps("blocks.8.lm_head") and cb.policy.keeps("blocks.1.block.mlp.c_fc")
    assert not cb.policy.keeps("blocks.6.layer.mlp.up_proj")  # decoder layers run in FP8
    (memory,) = [line.split("# memory:", 1)[1] for line in lines if "# memory:" in line]
    strategy_args = yaml.safe_load("\n".join(lines))["trainer"]["strategy"]["init_args"]
    MultimodalParallelStrategy(**strategy_args, **yaml.safe_load(memory))


def _saved_activation_mib(spec: Any) -> float:
    """MiB of distinct non-parameter tensors autograd keeps from forward to backward for one
    batch of the toy transformer (256 wide, 4 layers, 128 tokens, batch 8)."""
    from lightning_mmpar.examples.toy_transformer import ToyConfig, ToyTransformer

    torch.manual_seed(0)
    model = ToyTransformer(ToyConfig(dim=256, heads=8, layers=4, seq=128, vocab=512))
    apply_block_options(model.pipeline_blocks(), spec)
    params = {p.data_ptr() for p in model.parameters()}
    kept: dict[tuple[int, Any], int] = {}

    def pack(t: Tensor) -> Tensor:
        kept[(t.data_ptr(), t.shape)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = torch.randint(0, 512, (8, 128))
        for block in model.pipeline_blocks():
            x = block(x)
    x.float().logsumexp(-1).mean().backward()
    return sum(n for (ptr, _), n in kept.items() if ptr not in params) / 2**20


def test_checkpointing_memory_on_the_toy() -> None:
    """Measured: 70.2 MiB kept without checkpointing, 37.1 MiB every 2nd block, 5.0 MiB all
    (the blocks' inputs only); docs/strategy.md."""
    none, half, every = (_saved_activation_mib(s) for s in (None, 2, "all"))
    assert 69 < none < 72 and 36 < half < 38.5 and 4.5 < every < 5.5, (none, half, every)
