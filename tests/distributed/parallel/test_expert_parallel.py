"""Expert parallelism of one MoE layer: ep = 2 in a real gloo world vs the single-process layer.

One 2-process world (``expert_parallel_worker.run``) runs every case: top-1 / top-2, capacity
with dropping and dropless, uneven token counts and padding per rank, an expert no rank routes
to, a rank whose tokens are all padding, shared experts, grouped matmul and the loop. Each
compares outputs, aux loss, expert counts and the gradients of the input, the router and every
expert weight with the single-process reference (its definition: the worker's docstring), then
checks the invalid set-ups, a DCP round trip ep 2 -> ep 1 and DeepSpeed's ``MoE`` at ep_size 2
as an oracle. Expert locality in the same world: a custom placement against the
single-process layer, group-limited routing against the layer with the same ``locality_mask``,
and the dispatch byte counters against a hand count. The other tests need no process group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.experts import (
    AllToAllDispatcher,
    _chunk_order,
    expert_parallel_block,
)
from lightning_mmpar.testing import spawn
from tests.distributed.parallel import expert_parallel_worker as worker

RTOL = 1e-5


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(worker.run, 2, timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c.name for c in worker.CASES])
def test_ep2_matches_single_process(world: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(world):
        got = result[case]
        worst = max(got["errors"].values())
        assert worst <= RTOL, (rank, got["errors"])
        assert not got["missing_grads"], got["missing_grads"]
        assert got["counts_equal"] and got["received_equal"], (rank, got["received"])
        assert got["local_shape"] == (2, worker.DIM, 32)  # this rank's block of 2 of 4 experts
        assert got["full_equal"]  # the DTensor holds the full [E, D, F] weight


@pytest.mark.distributed
def test_cases_cover_what_they_claim(world: list[dict[str, Any]]) -> None:
    """Each case exercises its feature: dropping happens, an expert and a rank stay empty."""
    assert sum(r["top2_capacity"]["dropped"] for r in world) > 0
    assert sum(r["top1_capacity"]["dropped"] for r in world) > 0
    assert all(r["top1_dropless_zero_expert"]["dropped"] == 0 for r in world)
    # expert 3 (rank 1's second local expert) receives nothing from any rank
    assert world[1]["top1_dropless_zero_expert"]["received"][:, 1].sum() == 0
    # rank 1 routes no token at all (padding only), yet rank 0's tokens reach its experts
    empty = [r["top2_dropless_shared_empty_rank"]["received"] for r in world]
    assert empty[0][1].sum() == 0 and empty[1][1].sum() == 0 and empty[1][0].sum() > 0


@pytest.mark.distributed
def test_invalid_setups_and_checkpoint(world: list[dict[str, Any]]) -> None:
    messages = world[0]["errors"]
    assert "num_experts (3)" in messages["indivisible"] and "ep = 2" in messages["indivisible"]
    assert "ep_size (4)" in messages["ep_size"] and "size (2)" in messages["ep_size"]
    assert "'w_gate'" in messages["twice"] and "once" in messages["twice"]
    assert "2 dims" in messages["mesh_2d"] and "mesh['ep']" in messages["mesh_2d"]
    assert "expert_dispatch" in messages["no_hook"]
    for name in ("placement_counts", "placement_range"):
        assert "exactly num_experts / ep = 2" in messages[name], messages[name]
    assert (
        "[0, 0, 0, 1]" in messages["placement_counts"] and "[3, 1]" in messages["placement_counts"]
    )
    assert (
        "2 entries" in messages["placement_length"]
        and "num_experts = 4" in messages["placement_length"]
    )
    assert "locality_groups (3)" in messages["groups"] and "ep size (2)" in messages["groups"]
    assert "locality_mask" in messages["no_mask"]
    assert all(r["checkpoint_diff"] == 0.0 for r in world)


def test_expert_block_placement_and_errors() -> None:
    assert list(expert_parallel_block(8, 4, 1)) == [2, 3]
    assert list(expert_parallel_block(4, 1, 0)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"num_experts \(6\).*ep = 4"):
        expert_parallel_block(6, 4, 0)
    with pytest.raises(ValueError, match=r"ep_rank \(2\)"):
        expert_parallel_block(4, 2, 2)


def test_chunk_order_is_expert_major() -> None:
    """Rows from 2 sources x 2 local experts, arrival (s, e) -> compute order (e, s)."""
    received = torch.tensor([[2, 1], [0, 3]])  # s0: e0 x2, e1 x1; s1: e0 x0, e1 x3
    rows = ["s0e0a", "s0e0b", "s0e1", "s1e1a", "s1e1b", "s1e1c"]
    order = _chunk_order(received).tolist()
    assert [rows[i] for i in order] == ["s0e0a", "s0e0b", "s0e1", "s1e1a", "s1e1b", "s1e1c"]
    received = torch.tensor([[1, 2], [2, 1]])
    rows = ["s0e0", "s0e1a", "s0e1b", "s1e0a", "s1e0b", "s1e1"]
    order = _chunk_order(received).tolist()
    assert [rows[i] for i in order] == ["s0e0", "s1e0a", "s1e0b", "s0e1a", "s0e1b", "s1e1"]


def test_dispatcher_without_process_group_is_local() -> None:
    """ep = 1 (no process group): the dispatcher calls ``compute`` on every token, unchanged."""
    tokens, counts = torch.randn(5, 3), torch.tensor([2, 0, 3])
    seen: list[torch.Tensor] = []

    def compute(t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        seen.append(c)
        return t * 2

    out = AllToAllDispatcher(3, None)(tokens, counts, compute)
    assert torch.equal(out, tokens * 2) and torch.equal(seen[0], counts)
    with pytest.raises(ValueError, match=r"tokens_per_expert has 2 counts.*num_experts = 3"):
        AllToAllDispatcher(3, None)(tokens, counts[:2], compute)
    with pytest.raises(ValueError, match=r"sums to 4 but tokens has 5 rows"):
        AllToAllDispatcher(3, None)(tokens, torch.tensor([1, 0, 3]), compute)


def test_all_to_all_validates_splits() -> None:
    t = torch.randn(4, 2)
    assert comm.all_to_all_single(t, [4], [4]) is t and comm.all_to_all_counts(t) is t
    with pytest.raises(ValueError, match=r"input_split_sizes \(\[3\]\).*rows \(4\)"):
        comm.all_to_all_single(t, [4], [3])


@pytest.mark.distributed
def test_matches_deepspeed_moe_ep2(world: list[dict[str, Any]]) -> None:
    """Oracle: ``deepspeed.moe.layer.MoE`` (ep_size 2, no dropping) with the same weights."""
    if world[0]["deepspeed"] is None:
        pytest.skip("deepspeed is not installed")
    for rank, result in enumerate(world):
        for k, got in result["deepspeed"].items():
            assert got["y"] <= RTOL and got["l_aux"] <= RTOL, (rank, k, got)
            assert got["counts_equal"], (rank, k)


@pytest.mark.distributed
def test_byte_counters_match_hand_count(world: list[dict[str, Any]]) -> None:
    """No groups: each rank is its own group; both counters = kept routes to the other rank's
    experts * D * 4 bytes (fp32), from the single-process reference's routing."""
    crossing = 0
    for result in world:
        for case in worker.CASES:
            sent, across, expected = result[case.name]["bytes"]
            assert sent == across == expected, (case.name, sent, across, expected)
            crossing += expected
    assert crossing > 0


@pytest.mark.distributed
def test_custom_placement_matches_single_process(world: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world):
        got = result["placement"]
        assert max(got["errors"].values()) <= RTOL, (rank, got["errors"])
        assert got["logical_ids"] == [1, 3, 0, 2] and got["placement"] == [1, 0, 1, 0]
        assert got["kept_physical"] and got["kept_logical"] and got["full_equal"]


@pytest.mark.distributed
def test_group_limited_routing_stays_local(world: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world):
        got = result["locality"]
        assert max(got["errors"].values()) <= RTOL, (rank, got["errors"])
        own = [e // 2 == rank for e in range(4)]
        assert got["mask"] == own
        assert all(n == 0 for n, mine in zip(got["routed"], own, strict=True) if not mine)
        assert sum(got["routed"]) > 0 and got["received"][1 - rank].sum() == 0
        assert got["bytes"] == (0, 0)
        # one group spanning both ranks: routing unchanged, bytes cross ranks but not groups
        assert got["one_error"] <= RTOL
        assert got["one_bytes"][0] > 0 and got["one_bytes"][1] == 0
