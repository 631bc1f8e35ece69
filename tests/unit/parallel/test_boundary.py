"""Stage boundaries packed into one buffer per dtype (issue 32 item 2): exact values, dtypes
and gradients through pack / unpack; nothing packed where nothing merges."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpar.parallel.pipeline.boundary import BoundaryLayout


def _boundary() -> tuple[torch.Tensor, ...]:
    """The fusion model's boundary kinds: float32 hidden states and tokens, a bf16 tensor (under
    autocast), int64 positions, a bool mask, a 0-dim scalar and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 3, 4, generator=g),
        torch.arange(6).reshape(2, 3),
        torch.randn(2, 5, generator=g).bfloat16(),
        torch.randn(2, 2, 4, generator=g),
        torch.tensor([[True, False, True], [False, False, True]]),
        torch.tensor(1.5),
        torch.zeros(2, 0),
        torch.randn(3, generator=g).bfloat16(),
        torch.tensor([7, 8]),
    )


def test_one_buffer_per_dtype_with_exact_values_and_dtypes() -> None:
    tensors = _boundary()
    layout = BoundaryLayout.of(tensors)
    assert layout is not None
    wire = layout.pack(tensors)
    assert [b.dtype for b in wire] == [torch.float32, torch.int64, torch.bfloat16, torch.bool]
    assert [b.numel() for b in wire] == [24 + 16 + 1 + 0, 6 + 2, 10 + 3, 6]
    back = layout.unpack(wire)
    assert len(back) == len(tensors)
    for got, want in zip(back, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_gradients_flow_back_through_the_buffers() -> None:
    """Each boundary tensor's gradient, sent back as the float buffer's, equals the one it gets
    unpacked; tensors without gradients (integers, a float that needs none) stay without."""
    h = torch.randn(2, 3, requires_grad=True)
    t = torch.randn(4, requires_grad=True)
    mask = torch.ones(2, 3)  # a float that needs no gradient
    ids = torch.tensor([1, 2])
    layout = BoundaryLayout.of((h * 2, ids, t + 1, mask))
    assert layout is not None and layout.groups == ((0, 2, 3), (1,))
    wire = layout.pack((h * 2, ids, t + 1, mask))
    received = tuple(b.detach().requires_grad_(b.is_floating_point()) for b in wire)
    x = layout.unpack(received)
    loss = (x[0] ** 2).sum() + (x[2] * 3).sum() + (x[3] * x[0]).sum() + x[1].sum()
    loss.backward()
    (grad,) = (b.grad for b in received if b.is_floating_point())
    torch.autograd.backward(wire[0], grad)
    assert torch.allclose(h.grad, 2 * (2 * (h * 2) + mask))
    assert torch.equal(t.grad, torch.full((4,), 3.0))
    assert received[1].grad is None


@pytest.mark.parametrize(
    "tensors",
    [
        (torch.zeros(2), torch.zeros(2, dtype=torch.int64)),  # every dtype once
        (torch.zeros(3),),
    ],
)
def test_nothing_to_merge_is_not_packed(tensors: tuple[torch.Tensor, ...]) -> None:
    assert BoundaryLayout.of(tensors) is None


def test_a_dtensor_boundary_is_left_to_torch() -> None:
    from torch.distributed.tensor import DTensor

    class Fake(DTensor):  # isinstance only: no mesh needed
        def __new__(cls) -> Fake:
            return torch.Tensor._make_subclass(cls, torch.zeros(2))  # type: ignore[return-value]

    assert BoundaryLayout.of((Fake(), torch.zeros(2))) is None


def test_shapes_other_than_the_layouts_are_refused() -> None:
    layout = BoundaryLayout.of((torch.zeros(2, 3), torch.zeros(4)))
    assert layout is not None
    with pytest.raises(ValueError, match=r"shapes \(\(2, 3\), \(5,\)\)"):
        layout.pack((torch.zeros(2, 3), torch.zeros(5)))
    with pytest.raises(ValueError, match="2 buffers for 1 groups"):
        layout.unpack((torch.zeros(10), torch.zeros(1)))
