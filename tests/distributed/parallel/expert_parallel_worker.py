"""Rank body of the expert-parallel checks (importable by spawned processes).

Reference (stated once, used by every case): rank ``r``'s loss is
``L_r = sum(y_r * w_r) + aux_r`` on its own tokens ``x_r``; the ep world backpropagates every
``L_r`` on its own rank. The single-process layer (same full weights, seed 0) run on ``x_r``
gives ``y_r``, ``aux_r``, the counts, ``dL_r/dx_r`` and ``dL_r/d router`` directly (they depend
on rank ``r``'s tokens only). An expert weight receives gradients from every rank's tokens, so
its reference is ``sum_r dL_r/dW`` restricted to the block the ep rank holds. The locality
checks (``check_placement``, ``check_locality``) state their references in their docstrings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_mmpar.models import MoEConfig, MoEFeedForward
from lightning_mmpar.parallel.comm import to_local
from lightning_mmpar.parallel.experts import apply_expert_parallel

DIM = 16
EXPERT_WEIGHTS = ("experts.w_gate", "experts.w_up", "experts.w_down")
SWIGLU = ("w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class Case:
    """One layer configuration and each rank's token layout ``(batch, seq, padded tail)``."""

    name: str
    config: dict[str, Any]
    shapes: tuple[tuple[int, int, int], ...]
    bias_off: int | None = None
    """Expert whose aux-free selection bias is -1: no rank ever routes to it."""
    grouped_mm: bool | None = None


CASES = (
    Case("top2_capacity", dict(top_k=2, capacity_factor=1.0), ((2, 6, 1), (3, 5, 2))),
    Case(
        "top1_dropless_zero_expert",
        dict(top_k=1, capacity_factor=None, load_balancing="aux_free"),
        ((2, 7, 0), (1, 4, 1)),
        bias_off=3,
    ),
    Case(
        "top2_dropless_shared_empty_rank",
        dict(top_k=2, capacity_factor=None, num_shared_experts=1),
        ((2, 5, 1), (1, 3, 3)),  # rank 1: padding only
        grouped_mm=False,
    ),
    Case(
        "top1_capacity", dict(top_k=1, capacity_factor=1.0, min_capacity=1), ((3, 4, 0), (2, 6, 2))
    ),
)


def build(case: Case) -> MoEFeedForward:
    torch.manual_seed(0)
    base = dict(num_experts=4, ffn_width=32, router_dim=8, z_loss_weight=1e-2)
    cfg = MoEConfig(**{**base, **case.config})
    layer = MoEFeedForward(DIM, cfg)
    if case.bias_off is not None:
        layer.expert_bias[:, case.bias_off] = -1.0
    layer.grouped_mm = case.grouped_mm
    return layer


def inputs(case: Case, rank: int) -> tuple[torch.Tensor, ...]:
    """``x [B, S, D]``, ``modality [B, S]``, ``padding_mask [B, S]``, loss weight ``[B, S, D]``."""
    batch, seq, pad = case.shapes[rank]
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, seq, DIM, generator=g)
    modality = torch.randint(0, 2, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    if pad:
        mask[-1, seq - pad :] = True
    return x, modality, mask, torch.randn(batch, seq, DIM, generator=g)


def step(layer: MoEFeedForward, case: Case, rank: int) -> dict[str, Any]:
    """Forward and backward of ``L_rank`` (see module docstring); detached results."""
    x, modality, mask, weight = inputs(case, rank)
    x.requires_grad_()
    y = layer(x, modality, mask)
    aux = layer.aux_loss
    ((y * weight).sum() + aux).backward()
    grads = {n: to_local(p.grad).clone() for n, p in layer.named_parameters() if p.grad is not None}
    stats = {m: {k: v.clone() for k, v in asdict(s).items()} for m, s in layer.last_stats.items()}
    return dict(y=y.detach(), aux=aux.detach(), x_grad=x.grad, grads=grads, stats=stats)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (exact shape match required)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def check_case(case: Case, rank: int, mesh: Any) -> dict[str, Any]:
    refs = [step(build(case), case, r) for r in range(2)]
    ref = refs[rank]
    layer = apply_expert_parallel(build(case), mesh)
    got = step(layer, case, rank)
    block = slice(2 * rank, 2 * rank + 2)
    errors = {"y": rel(got["y"], ref["y"]), "aux": rel(got["aux"], ref["aux"])}
    errors["x_grad"] = rel(got["x_grad"], ref["x_grad"])
    for name, grad in got["grads"].items():
        if name in EXPERT_WEIGHTS:
            summed = sum(r["grads"][name] for r in refs)[block]
            errors[f"grad.{name}"] = rel(grad, summed)
        else:
            errors[f"grad.{name}"] = rel(grad, ref["grads"][name])
    missing = set(ref["grads"]) - set(got["grads"])
    counts_equal = got["stats"].keys() == ref["stats"].keys() and all(
        torch.equal(got["stats"][m][k], ref["stats"][m][k])
        for m in ref["stats"]
        for k in ("tokens", "tokens_per_expert", "kept_per_expert")
    )
    # every rank's kept routes per expert of this rank's block, as the reference routes them
    none = torch.zeros(4, dtype=torch.long)
    kept = [sum((s["kept_per_expert"] for s in r["stats"].values()), none) for r in refs]
    expected_received = torch.stack([k[block] for k in kept])
    dispatcher = layer.expert_dispatch
    # hand count of the dispatch bytes: this rank's kept routes to the other rank's experts
    other = sum(int(n) for e, n in enumerate(kept[rank]) if e not in range(block.start, block.stop))
    return dict(
        bytes=(dispatcher.bytes_sent, dispatcher.bytes_across_groups, other * DIM * 4),
        errors=errors,
        missing_grads=sorted(missing),
        counts_equal=counts_equal,
        received=dispatcher.last_received,
        received_equal=torch.equal(dispatcher.last_received, expected_received),
        dropped=sum(float(s["dropped_fraction"]) for s in got["stats"].values()),
        local_shape=tuple(to_local(layer.experts.w_gate).shape),
        full_equal=torch.equal(
            layer.experts.w_gate.full_tensor(), build(case).experts.w_gate.detach()
        ),
    )


def check_errors(mesh: Any) -> dict[str, str]:
    """ValueError messages of invalid set-ups (no communication happens before they raise)."""
    messages = {}
    attempts = {
        "indivisible": lambda: apply_expert_parallel(
            MoEFeedForward(DIM, MoEConfig(num_experts=3, top_k=1)), mesh
        ),
        "ep_size": lambda: apply_expert_parallel(build(CASES[0]), mesh, ep_size=4),
        "twice": lambda: apply_expert_parallel(apply_expert_parallel(build(CASES[0]), mesh), mesh),
        "mesh_2d": lambda: apply_expert_parallel(
            build(CASES[0]), init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
        ),
        "no_hook": lambda: apply_expert_parallel(torch.nn.Linear(2, 2), mesh),
        "placement_counts": lambda: apply_expert_parallel(
            build(CASES[0]), mesh, placement=[0, 0, 0, 1]
        ),
        "placement_range": lambda: apply_expert_parallel(
            build(CASES[0]), mesh, placement=[0, 1, 2, 1]
        ),
        "placement_length": lambda: apply_expert_parallel(build(CASES[0]), mesh, placement=[0, 1]),
        "groups": lambda: apply_expert_parallel(build(CASES[0]), mesh, locality_groups=3),
        "no_mask": lambda: apply_expert_parallel(_without_mask(), mesh, locality_groups=2),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as err:
            messages[name] = str(err)
        else:
            messages[name] = "no error"
    return messages


def _without_mask() -> MoEFeedForward:
    layer = build(CASES[0])
    del layer.locality_mask
    return layer


def check_placement(rank: int, mesh: Any) -> dict[str, Any]:
    """Custom placement ``[1, 0, 1, 0]`` (rank 0 holds logical experts 1, 3; rank 1: 0, 2) vs
    the single-process layer in logical order: same outputs, aux loss, input and router grads;
    the expert grads and counts are those of the logical experts now held (physical order)."""
    case = CASES[0]
    refs = [step(build(case), case, r) for r in range(2)]
    ref, order = refs[rank], [1, 3, 0, 2]
    layer = apply_expert_parallel(build(case), mesh, placement=[1, 0, 1, 0])
    got = step(layer, case, rank)
    index = torch.tensor(order)
    held = index[2 * rank : 2 * rank + 2]
    errors = {k: rel(got[k], ref[k]) for k in ("y", "aux", "x_grad")}
    errors["grad.router_proj"] = rel(
        got["grads"]["router_proj.weight"], ref["grads"]["router_proj.weight"]
    )
    errors["grad.router_gate"] = rel(
        got["grads"]["router_gate"], ref["grads"]["router_gate"][:, index]
    )
    for name in EXPERT_WEIGHTS:
        errors[f"grad.{name}"] = rel(got["grads"][name], sum(r["grads"][name] for r in refs)[held])
    dispatcher = layer.expert_dispatch
    kept = {m: s["kept_per_expert"] for m, s in got["stats"].items()}
    return dict(
        errors=errors,
        logical_ids=dispatcher.logical_ids,
        placement=dispatcher.placement,
        kept_physical=all(
            torch.equal(k, ref["stats"][m]["kept_per_expert"][index]) for m, k in kept.items()
        ),
        kept_logical=all(
            torch.equal(dispatcher.to_logical(k), ref["stats"][m]["kept_per_expert"])
            for m, k in kept.items()
        ),
        full_equal=torch.equal(
            layer.experts.w_gate.full_tensor(), build(case).experts.w_gate.detach()[index]
        ),
    )


def check_locality(rank: int, mesh: Any) -> dict[str, Any]:
    """``locality_groups = 2`` at ep 2 (each rank its own group) vs the single-process layer
    whose ``locality_mask`` allows this rank's block only (the function group-limited routing
    defines); then ``locality_groups = 1`` (one group: routing unchanged, nothing crosses)."""
    case, block = CASES[0], slice(2 * rank, 2 * rank + 2)
    ref_layer = build(case)
    ref_layer.locality_mask.zero_()
    ref_layer.locality_mask[block] = True
    ref = step(ref_layer, case, rank)
    layer = apply_expert_parallel(build(case), mesh, locality_groups=2)
    got = step(layer, case, rank)
    errors = {k: rel(got[k], ref[k]) for k in ("y", "aux", "x_grad")}
    for name, grad in got["grads"].items():  # experts: only this rank's own tokens reach them
        errors[f"grad.{name}"] = rel(
            grad, ref["grads"][name][block] if name in EXPERT_WEIGHTS else ref["grads"][name]
        )
    kept = sum(s["kept_per_expert"] for s in got["stats"].values())
    one = apply_expert_parallel(build(case), mesh, locality_groups=1)
    one_ref = step(build(case), case, rank)
    one_got = step(one, case, rank)
    d, d1 = layer.expert_dispatch, one.expert_dispatch
    return dict(
        errors=errors,
        mask=layer.locality_mask.tolist(),
        routed=kept.tolist(),
        received=d.last_received,
        bytes=(d.bytes_sent, d.bytes_across_groups),
        one_error=rel(one_got["y"], one_ref["y"]),
        one_bytes=(d1.bytes_sent, d1.bytes_across_groups),
    )


def check_checkpoint(mesh: Any) -> float:
    """DCP save at ep 2, load into the unsharded layer (ep 1) on every rank: max abs diff."""
    sharded = apply_expert_parallel(build(CASES[0]), mesh)
    with torch.no_grad():
        for p in sharded.parameters():
            p.mul_(1.5)  # differ from a fresh build
    path = [tempfile.mkdtemp(prefix="ep_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(sharded.state_dict(), checkpoint_id=path[0])
    plain = build(CASES[0])
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    plain.load_state_dict(state)
    full = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t)
        for n, t in sharded.state_dict().items()
    }
    diff = max(
        float((plain.state_dict()[n].float() - t.float()).abs().max()) for n, t in full.items()
    )
    dist.barrier()  # every rank has read the files
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    return diff


class _SwiGLU(torch.nn.Module):
    """One expert as DeepSpeed's ``Experts`` runs it: ``(silu(x Wg) * (x Wu)) Wd``, ``[..., D]``."""

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
        super().__init__()
        self.w_gate, self.w_up, self.w_down = (
            torch.nn.Parameter(w.clone()) for w in (w_gate, w_up, w_down)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


def check_deepspeed(rank: int, mesh: Any) -> dict[str, Any] | None:
    """``deepspeed.moe.layer.MoE`` at ep_size 2 (no dropping, no noise, same gate and expert
    weights, one modality, equal token counts per rank as its dropless capacity needs) vs ours.

    Known convention (docs/experts.md): DeepSpeed's top-2 ``l_aux`` counts first choices only,
    so it is compared with our Switch loss on the first choices.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError:
        return None
    from lightning_mmpar.models.moe_routing import load_balancing_loss

    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, Any] = {}
    for k in (1, 2):
        case = Case(f"ds_top{k}", dict(top_k=k, capacity_factor=None, z_loss_weight=0.0), ())
        ours = build(case)
        full = {n.split(".")[-1]: ours.get_parameter(n).detach() for n in EXPERT_WEIGHTS}
        g = torch.Generator().manual_seed(200 + rank)
        x = torch.randn(2, 6, DIM, generator=g)
        ds = MoE(
            DIM,
            _SwiGLU(*(full[n][0] for n in SWIGLU)),
            num_experts=4,
            ep_size=2,
            k=k,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        ds.set_deepspeed_parallelism()
        with torch.no_grad():
            gate = ds.deepspeed_moe.gate.wg.weight
            gate.copy_(ours.router_gate[0] @ ours.router_proj.weight)
            for i, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
                for n in SWIGLU:
                    getattr(expert, n).copy_(full[n][2 * rank + i])
        y_ds, l_aux, counts = ds(x)
        apply_expert_parallel(ours, mesh)
        y = ours(x)
        d = ours.route(x, None, None).decisions["text"]
        first = load_balancing_loss(d.probs, d.experts[:, :1], 4)
        out[f"top{k}"] = dict(
            y=rel(y.detach(), y_ds.detach()),
            l_aux=rel(first.detach(), l_aux.detach()),
            counts_equal=torch.equal(ours.last_stats["text"].tokens_per_expert, counts.long()),
        )
    return out


def run(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results: dict[str, Any] = {c.name: check_case(c, rank, mesh) for c in CASES}
    results["placement"] = check_placement(rank, mesh)
    results["locality"] = check_locality(rank, mesh)
    results["errors"] = check_errors(mesh)
    results["checkpoint_diff"] = check_checkpoint(mesh)
    results["deepspeed"] = check_deepspeed(rank, mesh)
    return results
