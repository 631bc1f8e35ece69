"""FP8 layers: exact emulation vs torch._scaled_mm on CPU, scaling, policy, run-time switch."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mmpar.precision import (
    E4M3,
    E5M2,
    CastMeta,
    Float8Linear,
    FP8Policy,
    convert_to_fp8,
    detect_backend,
    fp8_matmul,
    fp8_modules,
    set_precision,
)


def _reference_scaled_mm() -> bool:
    """Whether ATen's CPU ``_scaled_mm`` takes its reference path (scale the fp8 operands,
    fp32 matmul), which the emulation reproduces bit for bit. On CPUs where oneDNN has native
    FP8 kernels (AVX512-FP16 / AMX) it rounds differently, within one fp32 ulp or so."""
    torch.manual_seed(3)
    a, b = (torch.randn(8, 16) * 9).to(E4M3), (torch.randn(16, 8) * 3).to(E4M3)
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)
    ref = torch._scaled_mm(
        a, b.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32
    )
    return torch.equal(ref, (a.float() * sa) @ (b.float() * sb))


REFERENCE_PATH = _reference_scaled_mm()


def assert_same(emulated: torch.Tensor, scaled_mm: torch.Tensor) -> None:
    """Bitwise where ATen uses its reference path, else within 4 fp32 ulps of the largest
    entry (native oneDNN FP8 kernels accumulate in another order)."""
    if REFERENCE_PATH:
        assert torch.equal(emulated, scaled_mm)
    else:
        tol = 4 * torch.finfo(torch.float32).eps * scaled_mm.abs().max().item()
        torch.testing.assert_close(emulated, scaled_mm, rtol=0, atol=tol)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 7))


@pytest.mark.parametrize("pow2", [True, False])
def test_emulation_equals_scaled_mm_bitwise(pow2: bool) -> None:
    a, b = _mlp(), _mlp()
    convert_to_fp8(a, FP8Policy(backend="emulate", power_of_two_scales=pow2))
    convert_to_fp8(b, FP8Policy(backend="scaled_mm", power_of_two_scales=pow2))
    assert fp8_modules(b)["0"].backend == "scaled_mm"
    for step in range(3):  # exercises the delayed-scaling history
        x = torch.randn(3, 5, 24) * (1 + step)
        ya, yb = a(x), b(x)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert_same(ya, yb)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert pa.grad is not None and pb.grad is not None
            assert_same(pa.grad, pb.grad)


def test_fp8_matmul_formats_against_scaled_mm() -> None:
    torch.manual_seed(1)
    qa = (torch.randn(33, 48) * 20).to(E4M3)
    qg = (torch.randn(33, 17) * 1000).to(E5M2)
    qb = (torch.randn(48, 17) * 3).to(E4M3)
    ia, ib = torch.tensor(0.37), torch.tensor(1.9)
    for x, y in ((qa, qb), (qg, qb.t())):
        ref = torch._scaled_mm(
            x, y.t().contiguous().t(), scale_a=ia, scale_b=ib, out_dtype=torch.float32
        )
        assert_same(fp8_matmul(x, ia, y, ib, torch.float32, "emulate"), ref)


def test_fp8_is_close_to_fp32_but_not_equal() -> None:
    ref, f8 = _mlp(), _mlp()
    convert_to_fp8(f8, FP8Policy(backend="emulate"))
    x = torch.randn(16, 24)
    err = ((f8(x) - ref(x)).norm() / ref(x).norm()).item()
    assert 0 < err < 0.1


def test_delayed_scaling_saturation_and_overflow_counted() -> None:
    meta = CastMeta(E4M3, FP8Policy(history_len=3, overflow_ratio=2.0))
    x = torch.linspace(-1, 1, 101)
    q, inv = meta.cast(x)  # empty history: scales from its own amax, no clamping
    assert int(meta.saturated) == 0 and float(meta.amax) == 1.0
    assert float(inv) == 2.0**-8  # 448 / 1 rounded down to a power of two: 256
    q, inv = meta.cast(x * 4)  # delayed: still scaled for amax 1 -> clamps, overflow event
    assert int(meta.saturated) > 0 and int(meta.overflow) == 1
    assert float(q.float().abs().max()) == 448.0  # clamped to the format's max, not NaN
    assert meta.history.tolist() == [4.0, 1.0, 0.0]
    meta.cast(torch.tensor([1.0, float("nan")]))
    assert int(meta.nonfinite) == 1 and meta.history.tolist() == [4.0, 1.0, 0.0]


def test_counters_reset_after_a_cast_stay_on_the_casts_device() -> None:
    """A per-step reset after the first cast keeps the counters where the amax history moved
    (found on an H200: the reset made them CPU tensors, the next GPU cast raised a device
    mismatch); the meta device stands in for a GPU here."""
    meta = CastMeta(E4M3, FP8Policy())
    x = torch.randn(4, 16, device="meta")
    meta.cast(x)
    meta.reset_stats()
    assert {t.device.type for t in (meta.amax, meta.saturated, meta.overflow)} == {"meta"}
    meta.cast(x)  # raised before: saturated (cpu) += sat (meta)
    assert meta.saturated.device.type == "meta"


def test_policy_patterns_pin_modules_and_switch_at_run_time() -> None:
    model = nn.ModuleDict(
        {
            "vision": nn.Linear(8, 8),
            "layers": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)),
        }
    )
    policy = FP8Policy(backend="emulate", keep_high_precision=("vision", "layers.0", "layers.2"))
    weight = model["layers"][1].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before conversion
    assert convert_to_fp8(model, policy) == ["layers.1"]
    mods = fp8_modules(model)
    assert {n: m.precision for n, m in mods.items()} == {
        "vision": "bf16",
        "layers.0": "bf16",
        "layers.1": "fp8",
        "layers.2": "bf16",
    }
    assert mods["layers.1"].weight is weight  # parameters shared, optimizer still valid
    x = torch.randn(4, 8)
    model["layers"](x).sum().backward()
    opt.step()
    assert set_precision(model, "bf16") == ["layers.1"]
    lin = mods["layers.1"]
    expect = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
    assert torch.equal(lin(x), expect)
    assert set_precision(model, "fp8") == ["layers.1"]  # pinned ones stay
    assert set_precision(model, "fp8", ["vision"], force=True) == ["vision"]
    with pytest.raises(ValueError, match="precision"):
        set_precision(model, "fp16")  # type: ignore[arg-type]


def test_backend_detection_on_cpu() -> None:
    info = detect_backend("auto")
    if not torch.cuda.is_available():
        assert info.name == "emulate" and "no FP8-capable GPU" in info.reason
    assert info.torchao_available == (importlib.util.find_spec("torchao") is not None)
    if not info.torchao_available:
        with pytest.raises(ValueError, match="pip install torchao"):
            convert_to_fp8(_mlp(), FP8Policy(backend="torchao"))


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"history_len": 0}, "history_len"),
        ({"overflow_ratio": 0.5}, "overflow_ratio"),
        ({"backend": "te"}, "backend"),
        ({"high_precision": "fp16"}, "high_precision"),
    ],
)
def test_policy_validation(kwargs: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        FP8Policy(**kwargs)  # type: ignore[arg-type]


def test_fp8_training_decreases_loss() -> None:
    model = _mlp()
    convert_to_fp8(model, FP8Policy(backend="emulate"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 24), torch.randn(64, 7)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    stats = fp8_modules(model)["0"].fp8_stats()
    assert stats["grad"]["amax"] > 0 and stats["input"]["nonfinite"] == 0


def test_deepcopy_and_repr() -> None:
    m = Float8Linear.from_linear(nn.Linear(4, 4), FP8Policy(), "emulate")
    assert "precision=fp8" in repr(copy.deepcopy(m))
