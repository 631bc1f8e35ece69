"""The collective checks of ``gpu_check.py``: every public helper of
:mod:`lightning_mmpar.parallel.comm` on the strategy's groups at world size 1, results checked,
then the same collectives once through ``torch.distributed`` (the backend's own kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback


class CollectiveProbe(Callback):
    """At the end of training (the strategy's process group live): :func:`collective_checks`."""

    result: dict[str, Any] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.result = collective_checks(trainer.strategy, pl_module.device)


def _check(fn: Any) -> dict[str, Any]:
    """``{"ok": bool, "detail": str}`` of ``fn()`` (``True`` or a reason) or its exception."""
    try:
        got = fn()
    except Exception as err:  # recorded per helper: the check goes on
        got = f"{type(err).__name__}: {err}"
    return {"ok": got is True, "detail": "ok" if got is True else str(got)}


def _refused(fn: Any) -> Any:
    """``True`` when ``fn()`` raises torch's ``ValueError`` about the rank (no peer), else why."""
    try:
        fn()
    except ValueError as err:
        return True if "rank" in str(err) else f"ValueError without a rank: {err}"
    return "no ValueError at world size 1"


def _helper_cases(g: Any, t: torch.Tensor, backend: str | None) -> dict[str, Callable[[], Any]]:
    """Each helper of ``comm`` on group ``g`` at size 1: a call returning ``True`` or why not."""
    from lightning_mmpar.parallel import comm

    def a2a() -> bool:
        x = t.clone().requires_grad_(True)
        y = comm.all_to_all_single(x, [8], [8], g)
        y.sum().backward()
        return x.grad is not None and torch.equal(y.detach(), t) and torch.equal(x.grad, t * 0 + 1)

    def reduced(op: Any) -> Callable[[], Any]:
        return lambda: torch.equal(comm.all_reduce(t.clone(), op, g), t)

    device = "cuda" if backend is not None and "nccl" in backend else "cpu"
    cases: dict[str, Callable[[], Any]] = {
        "is_distributed": lambda: comm.is_distributed() is (backend is not None),
        "group_size": lambda: comm.group_size(g) == 1,
        "group_rank": lambda: comm.group_rank(g) == 0,
        "group_device": lambda: comm.group_device(g).type == device,
        "to_local": lambda: comm.to_local(t) is t,
        **{f"all_reduce[{op}]": reduced(op) for op in ("sum", "max", "min", "avg")},
        "broadcast": lambda: torch.equal(comm.broadcast(t.clone(), 0, g), t),
        "all_gather": lambda: [x.tolist() for x in comm.all_gather(t, g)] == [t.tolist()],
        "all_gather_objects": lambda: comm.all_gather_objects({"a": 1}, g) == [{"a": 1}],
        "all_to_all_counts": lambda: torch.equal(comm.all_to_all_counts(t, g), t),
        "all_to_all_single": a2a,
        "barrier": lambda: [comm.barrier(g)] == [None],  # type: ignore[func-returns-value]
    }
    if backend is not None:  # point-to-point: no peer at world size 1, must refuse
        cases["send_object"] = lambda: _refused(lambda: comm.send_object(1, 0, g))
        cases["recv_object"] = lambda: _refused(lambda: comm.recv_object(0, g))
    return cases


def collective_checks(strategy: Any, device: torch.device) -> dict[str, Any]:
    """Every public helper of :mod:`lightning_mmpar.parallel.comm` on the world group and each
    of the strategy's dp / tp / pp groups, results checked; then the same collectives once
    through ``torch.distributed`` on the world group (the backend itself)."""
    import torch.distributed as dist

    from lightning_mmpar.parallel import comm

    groups: dict[str, Any] = {"world": None}
    if comm.is_distributed():
        groups |= {d: strategy.parallel_dims.get_mesh(d).get_group() for d in ("dp", "tp", "pp")}
    backend = str(dist.get_backend()) if comm.is_distributed() else None
    t = torch.arange(8, dtype=torch.float32, device=device)
    helpers = {
        f"{gname}.{name}": _check(fn)
        for gname, g in groups.items()
        for name, fn in _helper_cases(g, t, backend).items()
    }
    raw: dict[str, Any] = {}
    if comm.is_distributed():  # the backend's own kernels, on the group's device
        x = torch.arange(8, dtype=torch.float32, device=comm.group_device())

        def same(op: Callable[[torch.Tensor], Any]) -> Callable[[], bool]:
            return lambda: (op(y := torch.zeros_like(x)), torch.equal(y, x))[1]

        raw = {
            k: _check(same(op))
            for k, op in {
                "all_reduce": lambda y: dist.all_reduce(y.copy_(x)),
                "broadcast": lambda y: dist.broadcast(y.copy_(x), 0),
                "all_gather_into_tensor": lambda y: dist.all_gather_into_tensor(y, x),
                "reduce_scatter_tensor": lambda y: dist.reduce_scatter_tensor(y, x),
                "all_to_all_single": lambda y: dist.all_to_all_single(y, x),
                "barrier": lambda y: (dist.barrier(), y.copy_(x)),
            }.items()
        }
    failed = {k: v["detail"] for k, v in {**helpers, **raw}.items() if not v["ok"]}
    return {
        "backend": backend,
        "groups": list(groups),
        "helpers": helpers,
        "raw": raw,
        "failed": failed,
    }
