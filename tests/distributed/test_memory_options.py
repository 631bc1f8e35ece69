"""Precision and memory options of ``mm_parallel`` against the same options at one process.

One world of 1 process and one of 2 (gloo, CPU) train the toy transformer for 5 steps each
under every option (:mod:`memory_options_worker`):

* activation checkpointing (all blocks, every 2nd block, by kind) is exact: at one process the
  losses, first-step gradients and final weights equal the run without it bit for bit; at dp2
  and tp2 they match the one-process run as the parity suite's layouts do (loss 1e-5 relative,
  gradients 1e-5 of each tensor's largest entry, weights 5e-4 absolute);
* FSDP2 CPU offload (``CPUOffloadPolicy``) is exact at one process and at parity tolerance at dp2;
* ``torch.compile`` per block with ``backend="aot_eager"`` (AOTAutograd's traced graphs run
  eagerly: the same capture as inductor without its C++ code generation, which would take
  minutes on 2 CPU cores) stays within the parity tolerance of eager mode;
* FSDP2 mixed precision (BF16 parameters and compute, FP32 reduction) at dp2 against one
  process with the same policy: losses are BF16 numbers (the toy's loss is computed from BF16
  logits), so they agree to one BF16 unit in the last place (2**-7 relative), the FP32
  first-step gradients to two BF16 units of each tensor's largest entry (dp ranks run half
  batches: BF16 products are rounded in another order), and BF16 compute really happened (the
  losses differ from FP32). Final weights are not compared: after 5 AdamW steps a gradient
  entry near 0 whose sign the rounding flips moves by ~lr per step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mmpar.testing import spawn

sys.path.insert(0, str(Path(__file__).parent))
import memory_options_worker as mw

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
WEIGHT_ATOL = 5e-4
BF16_ULP = 2.0**-7  # relative spacing of BF16 numbers (8 significant bits)
MP_GRAD_RTOL = 2 * BF16_ULP  # two BF16 units of each tensor's largest entry

ONE = {
    "base": {},
    "ac_all": {"activation_checkpointing": "all"},
    "offload": {"offload_optimizer": True},
    "compile": {"compile_blocks": "aot_eager"},
    "mp": {"mixed_precision": "bf16"},
}
TWO = {
    "dp2_ac_kind": {"activation_checkpointing": ["language"]},
    "tp2_ac_every2": {"tp": 2, "activation_checkpointing": 2},
    "dp2_offload": {"offload_optimizer": True},
    "dp2_compile": {"compile_blocks": "aot_eager"},
    "dp2_mp": {"mixed_precision": "bf16"},
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


def check(name: str, run: dict[str, Any], ref: dict[str, Any], weight_atol: float) -> None:
    assert len(run["losses"]) == mw.STEPS, name
    rel = _loss_rel(run, ref)
    assert rel < LOSS_RTOL, f"{name}: loss differs by {rel:.2e} (relative)"
    assert run["grads"].keys() == ref["grads"].keys(), name
    for k, g in ref["grads"].items():
        err = ((run["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err < GRAD_RTOL, f"{name}: gradient of {k} differs by {err:.2e}"
    for k, w in ref["weights"].items():
        torch.testing.assert_close(run["weights"][k], w, rtol=0, atol=weight_atol, msg=name)
    print(f"{name}: max relative loss difference {rel:.2e}")


def test_checkpointing_is_exact_and_keeps_parity(one: dict[str, Any], two: dict[str, Any]) -> None:
    base, ac = one["base"], one["ac_all"]
    assert ac["wrapped"] == list(range(6)) and base["wrapped"] == []
    assert ac["losses"] == base["losses"]  # bit for bit
    for k in base["grads"]:
        assert torch.equal(ac["grads"][k], base["grads"][k]), k
    for k in base["weights"]:
        assert torch.equal(ac["weights"][k], base["weights"][k]), k
    assert two["dp2_ac_kind"]["wrapped"] == [1, 2, 3, 4]  # the "language" blocks
    assert two["tp2_ac_every2"]["wrapped"] == [1, 3, 5]  # the 2nd, 4th and 6th block
    check("dp2 checkpointing by kind", two["dp2_ac_kind"], base, WEIGHT_ATOL)
    check("tp2 checkpointing every 2nd block", two["tp2_ac_every2"], base, WEIGHT_ATOL)


def test_offload_parity(one: dict[str, Any], two: dict[str, Any]) -> None:
    assert one["offload"]["offload"] == ["CPUOffloadPolicy"]
    assert two["dp2_offload"]["offload"] == ["CPUOffloadPolicy"]
    assert one["offload"]["fsdp_units"] > 0  # sharded at one process too
    check("offload at 1 process vs none", one["offload"], one["base"], 0.0)
    check("dp2 offload", two["dp2_offload"], one["offload"], WEIGHT_ATOL)


def test_compile_parity(one: dict[str, Any], two: dict[str, Any]) -> None:
    assert one["compile"]["wrapped"] == list(range(6))
    check("compiled (aot_eager) vs eager", one["compile"], one["base"], WEIGHT_ATOL)
    check("dp2 compiled", two["dp2_compile"], one["compile"], WEIGHT_ATOL)


def test_mixed_precision_parity(one: dict[str, Any], two: dict[str, Any]) -> None:
    mp, dp2 = one["mp"], two["dp2_mp"]
    assert mp["mp"] == dp2["mp"] == ["torch.bfloat16"]
    assert mp["param_dtypes"] == dp2["param_dtypes"] == ["torch.float32"]  # FP32 master weights
    assert _loss_rel(mp, one["base"]) > 1e-4  # BF16 compute changed the numbers
    rel = _loss_rel(dp2, mp)
    assert rel <= BF16_ULP, f"dp2 bf16: loss differs by {rel:.2e} (relative)"
    assert dp2["grads"].keys() == mp["grads"].keys()
    err = 0.0
    for k, g in mp["grads"].items():
        assert dp2["grads"][k].dtype == torch.float32, k  # FP32 gradients (FP32 reduction)
        scale = g.abs().max().clamp_min(1e-12)
        err = max(err, ((dp2["grads"][k] - g).abs().max() / scale).item())
    assert err <= MP_GRAD_RTOL, f"dp2 bf16: first-step gradients differ by {err:.2e}"
    print(f"dp2 bf16 vs 1 process bf16: loss {rel:.2e}, first-step gradients {err:.2e} (relative)")
