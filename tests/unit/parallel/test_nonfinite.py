"""Non-finite inputs, losses and gradients never reach the weights or a checkpoint (issue 15,
item 5): the strategy's ``on_nonfinite`` check, :class:`NonFiniteGuard` and the checkpoint
guard on one process. The pipeline case (loss on the last stage only) and the checkpoint guard
in a real 2-rank run are in tests/recipes/test_recipe_faults.py.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_mmpar import MultimodalParallelStrategy
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.finite import (
    NonFiniteGuard,
    _grads_finite,
    _holders,
    _nonfinite_flags,
    nonfinite_weights,
)
from lightning_mmpar.testing import quiet_trainer

NAN = float("nan")


def test_on_nonfinite_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^on_nonfinite='ignore' is not a valid choice: pass "):
        MultimodalParallelStrategy(on_nonfinite="ignore")  # type: ignore[arg-type]
    assert MultimodalParallelStrategy(on_nonfinite="off").nonfinite is None
    guard = MultimodalParallelStrategy().nonfinite
    assert guard is not None and guard.mode == "raise"


def _net(grad: float = 1.0) -> nn.Linear:
    net = nn.Linear(2, 2)
    for p in net.parameters():
        p.grad = torch.full_like(p, grad)
    return net


def _names(net: nn.Module) -> Any:
    return lambda: {id(p): n for n, p in net.named_parameters()}


def _check(guard: NonFiniteGuard, net: nn.Module, **kw: Any) -> Any:
    return guard.check(net.parameters(), _names(net), step=7, **kw)


def test_guard_names_step_batch_inputs_loss_and_gradients() -> None:
    guard, net = NonFiniteGuard("raise"), _net()
    guard.observe_batch({"x": torch.ones(3), "ids": torch.arange(3)}, 4)
    guard.observe_loss(torch.tensor(1.0))
    assert _check(guard, net) is None  # clean: the step goes ahead, gradients untouched
    assert all(p.grad is not None for p in net.parameters())
    # accumulation window of 2: batch 5 clean, batch 6 with a NaN input and a NaN loss
    net.bias.grad[1] = float("inf")  # type: ignore[index]
    guard.observe_batch({"x": torch.ones(3)}, 5)
    guard.observe_loss(torch.tensor(1.0))
    guard.observe_batch({"x": torch.tensor([1.0, NAN])}, 6)
    guard.observe_loss(torch.tensor(NAN))
    msg = (
        "Non-finite training step at global step 7, batch [6]: non-finite loss on rank 0 (batch "
        "6); non-finite gradients on ranks [0] (rank 0: bias); non-finite inputs on rank 0 "
        "(batch 6). The optimizer step did not run"
    )
    with pytest.raises(RuntimeError, match="^" + re.escape(msg)):
        _check(guard, net)
    # the window was consumed: the next step starts clean
    net = _net()
    assert _check(guard, net) is None


def test_flags_are_one_fused_pass_and_float16_is_widened() -> None:
    """Plain tensors pass through without a per-tensor copy (``to_locals`` returns the list
    itself); a float16 tensor whose norm overflows float16 but whose entries are finite is not
    flagged, a float16 inf is."""
    grads = [torch.ones(3), torch.full((2,), NAN), torch.zeros(0)]
    assert comm.to_locals(grads) is grads
    assert _nonfinite_flags(grads).tolist() == [False, True, False]
    big = torch.full((4,), 60000.0, dtype=torch.float16)  # norm 120000 > float16's max
    inf = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    assert _nonfinite_flags([big, inf, torch.ones(2)]).tolist() == [False, True, False]


def _bucketed(net: nn.Module, fill: float = 1.0, extra: int = 0) -> Tensor:
    """Every gradient of ``net`` a view of one flat buffer of the parameters' dtype (torch DDP's
    bucket under ``gradient_as_bucket_view``) with ``extra`` entries beyond them; the buffer."""
    params = list(net.parameters())
    flat = torch.full((sum(p.numel() for p in params) + extra,), fill, dtype=params[0].dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def test_bucketed_gradients_are_checked_through_their_bucket() -> None:
    """The fast check reads the one buffer the gradients view, once (a gradient of its own is
    read as itself); when it fails the names come from the per-gradient flags, and a NaN in
    the buffer outside every gradient is a false alarm they clear: the step goes ahead."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    flat = _bucketed(net, extra=1)
    grads = [p.grad for p in net.parameters()]
    assert [h is flat for h in _holders(grads)] == [True]  # type: ignore[arg-type]
    own = torch.ones(2)
    assert [h is flat for h in _holders([own, *grads])] == [False, True]  # type: ignore[list-item]
    guard = NonFiniteGuard("raise")
    assert _check(guard, net) is None
    flat[-1] = NAN  # in the buffer, in no gradient
    assert not bool(_grads_finite(grads))  # type: ignore[arg-type]
    assert _check(guard, net) is None
    net[1].weight.grad[0, 1] = float("inf")  # type: ignore[index]
    msg = (
        "Non-finite training step at global step 7, a batch of this step: non-finite gradients "
        "on ranks [0] (rank 0: 1.weight). The optimizer step did not run"
    )
    with pytest.raises(RuntimeError, match="^" + re.escape(msg)):
        _check(guard, net)


def test_float16_bucket_is_widened_and_a_view_of_another_dtype_is_read_as_itself() -> None:
    """A float16 bucket whose norm overflows float16 with finite entries passes, an inf in it
    is named; a gradient viewing a buffer of another dtype is checked as
    itself, not through that buffer (``torch.view_as_real``)."""
    net = nn.Linear(2, 2).half()
    flat = _bucketed(net, fill=60000.0)  # norm 147,000 > float16's max
    guard = NonFiniteGuard("raise")
    assert _check(guard, net) is None
    flat[-1] = float("inf")
    with pytest.raises(RuntimeError, match=r"non-finite gradients on ranks \[0\] \(rank 0: bias\)"):
        _check(guard, net)
    pairs = torch.zeros(3, dtype=torch.complex64)
    grad = torch.view_as_real(pairs)  # float32 [3, 2] viewing a complex64 buffer
    pairs[1] = complex(NAN, 0.0)
    assert grad._base is pairs and [h is grad for h in _holders([grad])] == [True]
    assert not bool(_grads_finite([grad]))


def test_dtensor_gradients_are_read_through_their_local_shards_bucket(
    one_process_world: None,
) -> None:
    """DTensor gradients (tensor parallelism, FSDP2) whose local shards view one buffer (FSDP2's
    reduce-scatter output) are checked through that buffer; a NaN in one shard is named."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    net = nn.Linear(2, 3)
    flat = _bucketed(net)
    for p in net.parameters():
        p.grad = DTensor.from_local(p.grad, mesh, [Shard(0)], run_check=False)  # type: ignore[arg-type]
    grads = [p.grad for p in net.parameters()]
    assert [h is flat for h in _holders(grads)] == [True]  # type: ignore[arg-type]
    guard = NonFiniteGuard("raise")
    assert _check(guard, net) is None
    flat[0] = NAN
    with pytest.raises(
        RuntimeError, match=r"non-finite gradients on ranks \[0\] \(rank 0: weight\)"
    ):
        _check(guard, net)


def test_non_finite_inputs_alone_are_not_acted_on_and_a_redo_replaces_flags() -> None:
    guard, net = NonFiniteGuard("raise"), _net()
    guard.observe_batch({"unused": torch.tensor([NAN])}, 0)
    guard.observe_loss(torch.tensor(1.0))
    assert _check(guard, net) is None  # a non-finite field no layer uses does no harm
    guard.observe_batch(torch.ones(2), 1)
    guard.observe_loss(torch.tensor(NAN))
    guard.observe_batch(torch.ones(2), 1)  # FP8FallbackCallback's redo of batch 1: now clean
    guard.observe_loss(torch.tensor(1.0))
    assert _check(guard, net) is None


def test_under_a_grad_scaler_overflowing_gradients_are_the_scalers() -> None:
    guard, net = NonFiniteGuard("raise"), _net(grad=float("inf"))
    guard.observe_batch(torch.ones(2), 0)
    guard.observe_loss(torch.tensor(1.0))
    assert _check(guard, net, check_grads=False) is None
    guard.observe_loss(torch.tensor(float("inf")))  # a non-finite loss still counts
    with pytest.raises(RuntimeError, match=r"non-finite loss on rank 0 \(batch 0\)"):
        _check(guard, net, check_grads=False)


def test_skip_leaves_weights_and_optimizer_state_untouched() -> None:
    guard, net = NonFiniteGuard("skip"), _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    opt.step()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    state = {k: v["exp_avg"].clone() for k, v in opt.state.items()}
    for p in net.parameters():
        p.grad = torch.full_like(p, NAN)
    guard.observe_batch(torch.ones(2), 3)
    with pytest.warns(UserWarning, match=r"^Skipped the optimizer step at global step 7, batch"):
        report = _check(guard, net)
    assert report is not None and report.grads == {0: ["weight", "bias"]} and not report.losses
    assert guard.skipped == 1 and all(p.grad is None for p in net.parameters())
    opt.step()
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n])
    assert all(torch.equal(opt.state[k]["exp_avg"], v) for k, v in state.items())


def test_nonfinite_weights_names_the_parameters() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert nonfinite_weights(net) == {}
    with torch.no_grad():
        net[1].weight[0, 1] = float("-inf")
    assert nonfinite_weights(net) == {0: ["1.weight"]}


def test_checkpoint_with_nan_weights_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    strategy, net = MultimodalParallelStrategy(), nn.Linear(2, 2)
    with torch.no_grad():
        net.bias[0] = NAN
    strategy.model = net
    target = tmp_path / "last.ckpt"
    msg = (
        f"Refusing to save checkpoint {target} at global step 3: non-finite weights (rank 0: "
        "bias). Nothing was written"
    )
    with pytest.raises(RuntimeError, match="^" + re.escape(msg)):
        strategy.save_checkpoint({"global_step": 3}, target)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------ a plain LightningModule, in a Trainer
class Linear(LightningModule):
    """``(B, 2)`` inputs; batch 1 holds a NaN; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(2, 1)
        self.after: list[Tensor] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.layer(batch).square().mean()

    def on_train_batch_end(self, *args: Any) -> None:
        self.after.append(self.layer.weight.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


DATA = [torch.ones(4, 2), torch.tensor([[1.0, NAN]] * 4), torch.ones(4, 2)]


@pytest.fixture
def one_process_world() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_trainer_raise_and_skip(one_process_world: None) -> None:
    """Before the fix the NaN batch made every later weight NaN and the run ended normally."""
    module = Linear()
    trainer = quiet_trainer(
        strategy=MultimodalParallelStrategy(),
        devices=1,
        max_epochs=1,
        use_distributed_sampler=False,
    )
    with pytest.raises(RuntimeError, match=r"global step 1, batch \[1\]: non-finite loss on rank"):
        trainer.fit(module, DataLoader(DATA, batch_size=None))  # type: ignore[arg-type]
    assert torch.equal(module.layer.weight, module.after[0])  # as after step 1
    module = Linear()
    strategy = MultimodalParallelStrategy(on_nonfinite="skip")
    trainer = quiet_trainer(
        strategy=strategy, devices=1, max_epochs=1, use_distributed_sampler=False
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Skipped the optimizer step")
        trainer.fit(module, DataLoader(DATA, batch_size=None))  # type: ignore[arg-type]
    assert torch.equal(module.after[1], module.after[0])
    assert not torch.equal(module.after[2], module.after[1])
    assert module.after[2].isfinite().all() and trainer.global_step == 3
    assert float(trainer.callback_metrics["nonfinite_skipped_steps"]) == 1.0
