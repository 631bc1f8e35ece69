"""The stability callbacks' trainer matrix: an ordinary user LightningModule (an MLP with a
LayerNorm, none of the package's models) with faults, in every trainer the callbacks support.

Trainers: one device, Lightning ``ddp`` (2 ranks), Lightning ``ModelParallelStrategy`` with the
user's own ``fully_shard`` on an unnamed mesh (dp 2), ``ModelParallelStrategy`` tp2 x dp2 (the
user's ``parallelize_module`` + ``fully_shard``, 4 ranks), ``mm_parallel`` (dp 4, DDP). Callbacks:
:class:`GradientDriftMonitor` alone (``on_drift="resync"``) or with
:class:`FP8FallbackCallback`. Faults on the last rank: a norm-weight perturbation before step 2
and a NaN gradient (the loss's gradient) at step 4. Importable by spawned processes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn

from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor
from lightning_mmpar.parallel.comm import to_local
from lightning_mmpar.testing import quiet_trainer

PERTURB_STEP, NAN_STEP = 2, 4


class _NanGrad(torch.autograd.Function):
    """Identity whose backward returns NaN: a NaN gradient on this rank only."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return torch.full_like(g, float("nan"))


class UserNet(pl.LightningModule):
    """A user's module: Linear 16->32, LayerNorm, GELU, Linear 32->1; ``mode`` is how the user
    parallelises it in ``configure_model`` (``plain``, ``fsdp``: ``fully_shard`` on a mesh of
    their own without dimension names, ``tp_fsdp``: colwise/rowwise TP, the LayerNorm replicated
    over tp, ``fully_shard`` on the data-parallel mesh)."""

    def __init__(self, mode: str = "plain", fault_rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 1)
        self.mode, self.fault_rank = mode, fault_rank
        self.fired: set[str] = set()
        self.losses: list[float] = []
        self._done = False

    def configure_model(self) -> None:
        if self._done or self.mode == "plain":
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self._done = True
        if self.mode == "fsdp":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # no dimension names
            for m in (self.fc1, self.norm, self.fc2, self):
                fully_shard(m, mesh=mesh)
            return
        from torch.distributed.tensor import Replicate, distribute_module
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        plan = {
            "fc1": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
            "fc2": RowwiseParallel(input_layouts=Replicate()),
        }
        parallelize_module(self, tp, plan)  # type: ignore[arg-type]
        distribute_module(self.norm, tp)  # parameters Replicate over tp
        for m in (self.fc1, self.norm, self.fc2, self):
            fully_shard(m, mesh=dp)

    def _armed(self, kind: str, step: int) -> bool:
        rank = dist.get_rank() if dist.is_initialized() else 0
        hit = self.trainer.global_step == step and rank == self.fault_rank
        return hit and kind not in self.fired

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if self._armed("nan", NAN_STEP):
            self.fired.add("nan")
            loss = _NanGrad.apply(loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._armed("perturb", PERTURB_STEP):
            self.fired.add("perturb")
            with torch.no_grad():
                to_local(self.norm.weight).view(-1)[3] += 1e-2

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


class MemLogger(Logger):
    """Keeps every ``log_metrics`` call (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "mem"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


class NormProbe(pl.Callback):
    """Last in ``callbacks``: the global norm of the gradients the optimizer is about to use."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        from torch.distributed.tensor import DTensor

        sq = 0.0
        for p in pl_module.parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                sq += float(g.double().square().sum())
        self.norms.append(math.sqrt(sq))


def _strategy(trainer_kind: str) -> tuple[Any, int, str]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mmpar import MultimodalParallelStrategy

    if trainer_kind == "single":
        return "auto", 1, "plain"
    if trainer_kind == "ddp":
        return "ddp", 2, "plain"
    if trainer_kind == "fsdp":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2, "fsdp"
    if trainer_kind == "tp2dp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), 4, "tp_fsdp"
    # the strategy's own non-finite guard runs after the callbacks: it skips the NaN step
    # that the monitor alone only reports (the fallback callback redoes it before the guard)
    return MultimodalParallelStrategy(data_parallel="ddp", on_nonfinite="skip"), 4, "plain"


def _record(r: Any) -> dict[str, Any]:
    v = r.values
    return {
        "kind": r.kind,
        "step": r.step,
        "rank": r.rank,
        "param": r.param,
        "group": r.group,
        "drifting": v.get("drifting_ranks"),
        "ref": v.get("reference_rank"),
        "ambiguous": v.get("ambiguous"),
    }


def matrix_case(root: str, trainer_kind: str, fallback: bool) -> dict[str, Any]:
    """One fit of :class:`UserNet` with both faults; what the matrix assertions need."""
    from tests.distributed.callbacks.stability_worker import loader

    strategy, devices, mode = _strategy(trainer_kind)
    model = UserNet(mode, fault_rank=devices - 1)
    mon = GradientDriftMonitor(log_dir=root, on_drift="report" if fallback else "resync")
    probe, logger = NormProbe(), MemLogger()
    cbs: list[pl.Callback] = [mon, *([FP8FallbackCallback()] if fallback else []), probe]
    trainer = quiet_trainer(
        strategy=strategy,
        devices=devices,
        max_steps=6 if fallback else 5,
        callbacks=cbs,
        logger=logger,
        log_every_n_steps=1,
        default_root_dir=root,
    )
    trainer.fit(model, loader())
    fb = next((c for c in cbs if isinstance(c, FP8FallbackCallback)), None)
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "records": [_record(r) for r in mon.anomalies.records],
        "groups": {g.name: (len(g.params), g.skipped) for g in mon.groups},
        "losses": model.losses,
        "local": {n: to_local(p).detach().clone() for n, p in model.named_parameters()},
        "counters": dict(fb.counters) if fb else {},
        "logged": [r["stability/grad_norm"] for r in logger.rows if "stability/grad_norm" in r],
        "probe": probe.norms,
    }


def matrix_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """The matrix cases of one world: 2 ranks (ddp, fsdp) or 4 (tp2dp2, mm_parallel)."""
    kinds = ("ddp", "fsdp") if world == 2 else ("tp2dp2", "mm")
    return {
        f"{kind}/{'fallback' if fb else 'monitor'}": matrix_case(
            str(Path(root) / kind / ("fallback" if fb else "monitor")), kind, fb
        )
        for kind in kinds
        for fb in (False, True)
    }


def _equal(results: list[dict[str, Any]], case: str, ranks: list[int], names: list[str]) -> bool:
    ref = results[ranks[0]][case]["local"]
    return all(torch.equal(results[r][case]["local"][n], ref[n]) for r in ranks[1:] for n in names)


def check_matrix(results: list[dict[str, Any]], kind: str) -> None:
    """The documented behaviour of one trainer (module docstring), on every rank."""
    last = len(results) - 1
    drift = {  # trainer -> (params, group, reference rank, group members) of the perturbation
        "ddp": ({"norm.weight"}, "world", 0, [0, 1]),
        "fsdp": (set(), "", 0, []),  # FSDP shards: no replica, nothing to compare
        "tp2dp2": ({"norm.weight", "norm.bias"}, "tp", 2, [2, 3]),  # replicated over tp
        "mm": ({"norm.weight"}, "world", 0, [0, 1, 2, 3]),  # 4 ranks: a real majority
    }[kind]
    for cb in ("monitor", "fallback"):
        case = f"{kind}/{cb}"
        for r in results:
            res, me = r[case], r[case]["rank"]
            recs = res["records"]
            assert all(math.isfinite(v) for v in res["losses"]), (case, me)
            # perturbation before step 2: found after that step (global step 3), by the
            # members of the replica group only, naming the perturbed rank and parameter
            found = [x for x in recs if x["kind"] == "replica_drift" and x["step"] == 3]
            assert {x["param"] for x in found} == (drift[0] if me in drift[3] else set()), case
            for x in found:
                assert x["group"] == drift[1] and x["drifting"] == [last], (case, x)
                assert x["ref"] == drift[2] and x["ambiguous"] == (len(drift[3]) == 2)
            # the NaN gradient at step 4: reported on every rank (origin on the last rank
            # where the local gradient is observable, i.e. not under FSDP)
            nan = [x for x in recs if x["kind"].startswith("nonfinite")]
            assert nan and {x["step"] for x in nan} == {4}, (case, me)
            local = {x["rank"] for x in nan if x["kind"] == "nonfinite_local_grad"}
            assert local == (set() if kind in ("fsdp", "tp2dp2") or me != last else {last})
            # no false reports: anything else is the NaN step's consequence (monitor alone)
            other = [x for x in recs if x["step"] not in (3, 4) and x["kind"] != "fp8_fallback"]
            assert not other or (cb == "monitor" and kind == "tp2dp2"), (case, other)
            if cb == "fallback":
                want = 1 if kind == "fsdp" else 2  # drift redo (not under FSDP) + NaN redo
                assert res["counters"]["redone_steps"] == want, (case, res["counters"])
                assert len(res["losses"]) == 6
        # replicas equal after recovery; shards never copied over one another
        res0 = results[0][case]
        names = list(res0["local"])
        if cb == "fallback" and kind in ("ddp", "mm"):
            assert _equal(results, case, list(range(len(results))), names), case
        if kind == "fsdp":
            assert not _equal(results, case, [0, 1], ["fc1.weight", "norm.weight"]), case
            assert res0["groups"] == {"world": (0, 6)}
        if kind == "tp2dp2":
            assert res0["groups"] == {"dp": (0, 6), "tp": (3, 3)}
            assert not _equal(results, case, [0, 1], ["fc1.weight"]), case  # tp shards
            if cb == "fallback":
                for pair in ([0, 1], [2, 3]):
                    assert _equal(results, case, pair, ["norm.weight", "norm.bias", "fc2.bias"])
        # stability/grad_norm: one value per step, that step's own norm (clean steps)
        # tp2 x dp2: FSDP2 over a TP shard is a _StridedShard, a shard for numerics.shard_count
        for r in results:
            logged, probe = r[case]["logged"], r[case]["probe"]
            for i in (0, 1, 3, 5) if cb == "fallback" else (0, 1, 2, 3):
                assert logged[i] == pytest.approx(probe[i], rel=1e-6), (case, i, logged, probe)
