"""DCP checkpoints of the MoE recipe module across expert-parallel sizes (issue 10).

In one 4-process world: train ep 2 x dp 4 (FSDP2, expert weights sharded over edp 2) for one
step and save; resume that checkpoint at ep 1 (FSDP2 on dp 4) and save again; resume that at
ep 4 (DDP). Each resume restores every parameter, buffer and AdamW moment bitwise (full tensors
compared with the ep 2 run's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.testing import quiet_trainer
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import recipe_faults_worker as rw

CHAIN = (
    ("ep2", {"expert_parallel": 2}),
    ("ep1", {"expert_parallel": 1}),
    ("ep4", {"expert_parallel": 4, "data_parallel": "ddp"}),
)


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(module: Any, optimizer: Any) -> dict[str, Tensor]:
    """Every parameter, buffer and AdamW moment as a full tensor (collective: every rank)."""
    out = {n: _full(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    names = {id(p): n for n, p in module.named_parameters()}
    for p, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}/{key}"] = _full(state[key])
    return out


def world(rank: int, world_size: int, root: str, digits: Any) -> dict[str, Any]:
    local = [pm.dp_slice(b, world_size, rank) for b in rw.batches(digits, 1)]  # dp = world
    states: dict[str, dict[str, Tensor]] = {}
    previous: str | None = None
    for name, args in CHAIN:
        module = pm.build(digits.vocab_size, "moe")
        trainer = quiet_trainer(
            strategy=MultimodalParallelStrategy(**args),
            devices=world_size,
            max_steps=1,
            use_distributed_sampler=False,
            limit_val_batches=0,
        )
        # first layout: one training step; the others: a zero-step fit that only restores
        trainer.fit(module, DataLoader(local, batch_size=None), ckpt_path=previous)
        states[name] = full_state(module, trainer.optimizers[0])
        previous = str(Path(root) / f"{name}.ckpt")
        trainer.save_checkpoint(previous)
    if rank != 0:
        return {}
    ref = states["ep2"]
    diffs = {
        key: max(float((ref[n].float() - t.float()).abs().max()) for n, t in s.items())
        for key, s in states.items()
        if key != "ep2"
    }
    keys = {key: sorted(s) == sorted(ref) for key, s in states.items()}
    return {"diffs": diffs, "same_keys": keys, "count": len(ref)}
