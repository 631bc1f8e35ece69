"""Precision and memory options of ``mm_parallel`` against the same options at one process.

One world of 1 process and one of 2 (gloo, CPU) train the toy transformer for 5 steps per run
(:mod:`memory_options_worker`); options are combined to keep the runs few:

* activation checkpointing is exact: at one process (all blocks, with CPU offload) the losses,
  first-step gradients and final weights equal the run without options bit for bit; at dp2 (by
  kind, with offload), tp2 (every 2nd block, compiled) and pp2 (all blocks of both stages) they
  match the one-process run as the parity suite's layouts do (loss 1e-5 relative, gradients
  1e-5 of each tensor's largest entry, weights 5e-4 absolute);
* FSDP2 CPU offload (``CPUOffloadPolicy``) is exact at one process, at parity tolerance at dp2;
* ``torch.compile`` per block with ``backend="aot_eager"`` (AOTAutograd's traced graphs run
  eagerly: the same capture as inductor without its C++ code generation, which would take
  minutes on 2 CPU cores) is within the parity tolerance of eager mode at 1 process and at tp2;
* FSDP2 mixed precision (BF16 parameters and compute, FP32 reduction) at dp2 and pp2 against one
  process with the same policy: the losses are BF16 numbers (the toy's loss comes from BF16
  logits) and agree to one BF16 unit in the last place (2**-7 relative); the FP32 first-step
  gradients and final weights differ from the one-process BF16 run by no more than that run
  differs from FP32 (relative L2 over all tensors: the layout adds no error beyond BF16's own;
  printed); and BF16 compute really happened (the losses differ from FP32);
* ``FP8Training`` (emulated FP8, the head kept in FP32 by policy) at dp2 against one process:
  the first step's gradients agree to 1e-5 (relative L2; power-of-two scales come out equal on
  every rank), later losses to ``FP8_LOSS_RTOL``: each rank's delayed scaling follows the amax
  history of its own half batch (amax is not reduced over dp ranks), so scales may differ;
* the recipe CLI on ``recipes/clip_llama_8gpu.yaml`` with its commented ``precision.fp8``
  callback and ``memory`` options uncommented (model shrunk, tp2) trains 3 steps: FP8 in the
  adapter and decoder layers, the policy's layers pinned, BF16 FSDP2 units, the language blocks
  checkpointed.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_mmpar.testing import spawn
from tests.distributed.parallel import memory_options_worker as mw

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
WEIGHT_ATOL = 5e-4
FP8_LOSS_RTOL = 5e-3  # measured 1.5e-3: each dp rank scales from its own amax history
BF16_ULP = 2.0**-7  # relative spacing of BF16 numbers (8 significant bits)

ONE = {
    "base": {},
    "ac_offload": {"activation_checkpointing": "all", "offload_optimizer": True},
    "compile": {"compile_blocks": "aot_eager"},
    "mp": {"mixed_precision": "bf16"},
    "fp8": {"fp8": True},
}
TWO = {
    "dp2_ac_kind_offload": {"activation_checkpointing": ["language"], "offload_optimizer": True},
    "tp2_ac_every2_compile": {
        "tp": 2,
        "activation_checkpointing": 2,
        "compile_blocks": "aot_eager",
    },
    "pp2_ac_all": {"pp": 2, "activation_checkpointing": "all"},
    "dp2_mp": {"mixed_precision": "bf16"},
    "pp2_mp": {"pp": 2, "mixed_precision": "bf16"},
    "dp2_fp8": {"fp8": True},
    "recipe_8gpu_tp2": {"recipe": "clip_llama_8gpu", "tp": 2},
}


@pytest.fixture(scope="module")
def one() -> dict[str, Any]:
    return spawn(mw.run_all, 1, ONE, timeout=600)[0]


@pytest.fixture(scope="module")
def two() -> dict[str, Any]:
    return spawn(mw.run_all, 2, TWO, timeout=600)[0]


def _loss_rel(run: dict[str, Any], ref: dict[str, Any]) -> float:
    pairs = zip(run["losses"], ref["losses"], strict=True)
    return max(abs(a - b) / abs(b) for a, b in pairs)


def _rel_to_max(run: dict[str, Tensor], ref: dict[str, Tensor]) -> float:
    """Largest difference relative to each tensor's largest entry, over the tensors of ``run``
    (a pipeline rank holds its own stage's)."""
    assert run and set(run) <= set(ref), sorted(set(run) - set(ref))
    return max(
        ((run[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item() for k in run
    )


def _l2_rel(run: dict[str, Tensor], ref: dict[str, Tensor]) -> float:
    """``||run - ref|| / ||ref||`` over all tensors of ``run`` together (a pipeline rank holds
    its own stage's)."""
    assert run and set(run) <= set(ref), sorted(set(run) - set(ref))
    diff = sum(float((r - ref[k]).double().square().sum()) for k, r in run.items())
    norm = sum(float(ref[k].double().square().sum()) for k in run)
    return (diff / norm) ** 0.5


def check(name: str, run: dict[str, Any], ref: dict[str, Any], weight_atol: float) -> None:
    assert len(run["losses"]) == mw.STEPS, name
    rel = _loss_rel(run, ref)
    assert rel < LOSS_RTOL, f"{name}: loss differs by {rel:.2e} (relative)"
    err = _rel_to_max(run["grads"], ref["grads"])
    assert err < GRAD_RTOL, f"{name}: first-step gradients differ by {err:.2e}"
    assert run["weights"] and set(run["weights"]) <= set(ref["weights"]), name
    for k, w in run["weights"].items():
        torch.testing.assert_close(w, ref["weights"][k], rtol=0, atol=weight_atol, msg=name)
    print(f"{name}: max relative loss difference {rel:.2e}")


def test_checkpointing_and_offload_are_exact(one: dict[str, Any]) -> None:
    base, ac = one["base"], one["ac_offload"]
    assert ac["wrapped"] == list(range(6)) and base["wrapped"] == []
    assert ac["offload"] == ["CPUOffloadPolicy"] and ac["fsdp_units"] > 0  # sharded at 1 process
    assert ac["losses"] == base["losses"]  # bit for bit
    assert base["grads"].keys() == ac["grads"].keys()
    for k in base["grads"]:
        assert torch.equal(ac["grads"][k], base["grads"][k]), k
    for k in base["weights"]:
        assert torch.equal(ac["weights"][k], base["weights"][k]), k


def test_checkpointing_offload_compile_keep_parity(
    one: dict[str, Any], two: dict[str, Any]
) -> None:
    base = one["base"]
    dp2, tp2, pp2 = two["dp2_ac_kind_offload"], two["tp2_ac_every2_compile"], two["pp2_ac_all"]
    assert dp2["wrapped"] == [1, 2, 3, 4] and dp2["offload"] == ["CPUOffloadPolicy"]  # language
    assert tp2["wrapped"] == [0, 1, 2, 3, 4, 5]  # every block compiled; 2nd, 4th, 6th checkpointed
    assert pp2["wrapped"] == [0, 1, 2, 3, 4, 5]
    check("dp2 checkpointing by kind + offload", dp2, one["ac_offload"], WEIGHT_ATOL)
    check("tp2 checkpointing every 2nd block + compile", tp2, one["compile"], WEIGHT_ATOL)
    check("pp2 checkpointing all blocks", pp2, base, WEIGHT_ATOL)
    assert one["compile"]["wrapped"] == list(range(6))
    check("compiled (aot_eager) vs eager at 1 process", one["compile"], base, WEIGHT_ATOL)


def test_mixed_precision_parity(one: dict[str, Any], two: dict[str, Any]) -> None:
    mp, dp2, base = one["mp"], two["dp2_mp"], one["base"]
    assert mp["mp"] == dp2["mp"] == ["torch.bfloat16"]
    assert mp["param_dtypes"] == dp2["param_dtypes"] == ["torch.float32"]  # FP32 master weights
    assert all(g.dtype == torch.float32 for g in dp2["grads"].values())  # FP32 reduction
    assert _loss_rel(mp, base) > 1e-4  # BF16 compute changed the numbers
    rel = _loss_rel(dp2, mp)
    assert rel <= BF16_ULP, f"dp2 bf16: loss differs by {rel:.2e} (relative)"
    grads, grads_bf16 = _l2_rel(dp2["grads"], mp["grads"]), _l2_rel(mp["grads"], base["grads"])
    weights, weights_bf16 = (
        _l2_rel(dp2["weights"], mp["weights"]),
        _l2_rel(mp["weights"], base["weights"]),
    )
    print(
        f"dp2 bf16 vs 1 process bf16: loss {rel:.2e}, first-step gradients {grads:.2e} "
        f"(BF16 vs FP32: {grads_bf16:.2e}), weights {weights:.2e} (BF16 vs FP32: "
        f"{weights_bf16:.2e}), relative L2 over all tensors"
    )
    assert grads <= grads_bf16, (grads, grads_bf16)
    assert weights <= weights_bf16, (weights, weights_bf16)
    pp2 = two["pp2_mp"]  # BF16 activations sent between stages; rank 0 holds stage 0
    rel, grads = _loss_rel(pp2, mp), _l2_rel(pp2["grads"], mp["grads"])
    weights = _l2_rel(pp2["weights"], mp["weights"])
    print(
        f"pp2 bf16 vs 1 process bf16: loss {rel:.2e}, stage-0 first-step gradients "
        f"{grads:.2e}, weights {weights:.2e}"
    )
    assert pp2["mp"] == ["torch.bfloat16"] and rel <= BF16_ULP, rel
    assert grads <= grads_bf16 and weights <= weights_bf16, (grads, weights)


def test_fp8_training_parity(one: dict[str, Any], two: dict[str, Any]) -> None:
    fp8, dp2, base = one["fp8"], two["dp2_fp8"], one["base"]
    layers = [f"layers.{i}.{n}" for i in range(4) for n in ("q", "k", "v", "o", "up", "down")]
    assert fp8["fp8"] == dp2["fp8"] == sorted(layers)  # head.out kept in high precision
    assert fp8["fp8_counters"]["attempts"] == dp2["fp8_counters"]["attempts"] == 0
    assert _loss_rel(fp8, base) > 1e-5  # FP8 (emulated) changed the numbers
    rel = _loss_rel(dp2, fp8)
    grads = _l2_rel(dp2["grads"], fp8["grads"])
    grads_fp8 = _l2_rel(fp8["grads"], base["grads"])
    print(
        f"dp2 fp8 vs 1 process fp8: loss {rel:.2e}, first-step gradients {grads:.2e} "
        f"(FP8 vs FP32: {grads_fp8:.2e}), relative L2"
    )
    assert rel <= FP8_LOSS_RTOL, f"dp2 fp8: loss differs by {rel:.2e} (relative)"
    assert grads < GRAD_RTOL, f"dp2 fp8: first-step gradients differ by {grads:.2e}"


def test_recipe_yaml_precision_sections(two: dict[str, Any]) -> None:
    run = two["recipe_8gpu_tp2"]
    assert run["steps"] == 3 and math.isfinite(run["loss"])
    assert run["fp8"] and all(re.match(r"blocks\.\d+\.(adapter|layer)\.", n) for n in run["fp8"])
    assert any(".block." in n for n in run["pinned"]) and any("lm_head" in n for n in run["pinned"])
    assert any(n.endswith(".projector") for n in run["pinned"])
    assert run["counters"]["attempts"] == 0
    assert run["mp"] == ["torch.bfloat16"]
    assert run["checkpointed"] == ["language", "language"]  # the 2 decoder layers
