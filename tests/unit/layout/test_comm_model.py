"""The communication and state-memory model (issue 12): lightning_mmpar.layout.comm / memory /
model and plans.fusion_cost, hand-checked on small specs and pinned to the bytes counted on the
recipe's tiny fusion model (tests/recipes/test_parity_matrix.py counts them on every rank of
every measured layout; the figures here are its rank-0 counts)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from lightning_mmpar.layout.comm import comm_bounds, comm_bytes, world_dim
from lightning_mmpar.layout.memory import local_shape, shard_dim, stage_blocks, state_bytes
from lightning_mmpar.layout.model import Boundary, ModelSpec, ParamSpec
from lightning_mmpar.layout.stages import BlockSpec
from lightning_mmpar.layout.value import LayoutSpec, ParallelLayout, validate
from lightning_mmpar.models.moe_routing import MoEConfig
from lightning_mmpar.plans.fusion_cost import fusion_model_spec
from tests.recipes import recipe_faults_worker as rw

VOCAB = 39  # rw.digits().vocab_size (padded to 40 by the recipe: vocab_multiple 8)


def blocks(n: int) -> tuple[BlockSpec, ...]:
    return tuple(BlockSpec(f"b{i}", "language", 1.0, 1.0, 1.0, 1.0) for i in range(n))


def spec(*params: ParamSpec, n: int = 2, **kw: Any) -> ModelSpec:
    return ModelSpec(blocks=blocks(n), params=params, **kw)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tp": 0}, ["tensor_parallel (0)", "use 1"]),
        ({"dp": 4, "ep": 3}, ["expert_parallel (3)", "data-parallel size (4", "[1, 2, 4]"]),
        ({"schedule": "2f2b"}, ["schedule ('2f2b')", "interleaved_1f1b"]),
        ({"precision": "16"}, ["precision ('16')", "bf16-mixed"]),
        ({"pp": 2, "virtual": 2}, ["virtual_pipeline (2)", "interleaved_1f1b"]),
        (
            {"dp": 2, "data_parallel": "none"},
            ["data_parallel ('none')", "2 data-parallel", "'ddp'"],
        ),
        ({"pp": 2, "partition": "ratio:1:1"}, ["partition 'ratio:1:1'", "ratio:V:A:D"]),
        ({"micro_batches": True}, ["micro_batches (True)", "positive integer"]),
    ],
)
def test_layout_errors_name_field_value_and_fix(fields: dict, words: list[str]) -> None:
    """:func:`validate` (the strategy's check) refuses them; so does the deprecated
    ``LayoutSpec`` on construction, with the same message."""
    with pytest.raises(ValueError) as err:
        validate(ParallelLayout(**fields))
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(ValueError) as old, pytest.warns(DeprecationWarning, match="LayoutSpec"):
        LayoutSpec(**fields)
    assert str(old.value) == str(err.value)


def test_layout_spec_sizes_and_strategy_args() -> None:
    lay = ParallelLayout(
        tp=2,
        pp=2,
        dp=4,
        ep=2,
        virtual=2,
        micro_batches=4,
        micro_batch_size=2,
        accumulate=3,
        schedule="interleaved_1f1b",
        partition=(1, 2, 5),
    )
    assert (lay.world, lay.edp, lay.local_batch, lay.global_batch) == (16, 2, 8, 96)
    assert lay.strategy_args() == {
        "tensor_parallel": 2,
        "pipeline_parallel": 2,
        "expert_parallel": 2,
        "virtual_pipeline": 2,
        "micro_batches": 4,
        "schedule": "interleaved_1f1b",
        "partition": [1, 2, 5],
    }
    assert ParallelLayout(dp=2, data_parallel="ddp").strategy_args() == {"data_parallel": "ddp"}
    assert [
        world_dim(ParallelLayout(**k)) for k in ({"tp": 2}, {"dp": 4, "ep": 4}, {"tp": 2, "dp": 2})
    ] == ["tp", "dp", "world"]


def test_ddp_all_reduces_every_trainable_gradient_per_step() -> None:
    """DDP: one all-reduce of every trainable gradient held, once per optimizer step (torch's
    DDP skips it while accumulating); frozen parameters move nothing; plus the step's fixed
    small collectives."""
    w = ParamSpec("w", (6, 5), 0, None, True)
    frozen = ParamSpec("f", (7,), 1, None, False)
    b = ParamSpec("b", (), 1, None, True)
    lay = ParallelLayout(dp=2, data_parallel="ddp", accumulate=3)
    got = comm_bytes(spec(w, frozen, b), lay)
    # per step: grads (30 + 1) * 4, the guard 2 * 24; per batch: logged pair 8, term sums 48
    assert got == {"dp.all_reduce": 124 + 3 * (8 + 48), "dp.all_gather": 48, "dp.broadcast": 24}
    assert state_bytes(spec(w, frozen, b), lay, {}) == state_bytes(
        spec(w, frozen, b), ParallelLayout(dp=1), {}
    )
    st = state_bytes(spec(w, frozen, b), lay, {})
    assert (st.parameters, st.gradients, st.optimizer) == (152, 124, 2 * 124 + 2 * 4)


def test_clipping_under_ddp_over_the_world_takes_the_local_norm() -> None:
    """``ddp_covers_world``: torch's DDP over every rank (tp = pp = ep = 1, no vision ranks)
    leaves the same gradients on every rank, so clipping all-reduces no norm; every other
    layout with replicas all-reduces the squared norm (8 bytes) once per step."""
    from lightning_mmpar.layout.comm import ddp_covers_world

    w = ParamSpec("w", (6, 5), 0, None, True)
    ddp = {"dp": 2, "data_parallel": "ddp", "clip": True}
    assert ddp_covers_world(ParallelLayout(**ddp))
    assert comm_bytes(spec(w), ParallelLayout(**ddp))["dp.all_reduce"] == 120 + 8 + 48
    others = [
        ParallelLayout(dp=2, clip=True),  # FSDP2: each rank holds a shard's gradient
        ParallelLayout(tp=2, **ddp),  # the package's all-reduce; tp shards differ
        ParallelLayout(**ddp, vision_ranks=1),  # the world is larger than dp
    ]
    for lay in others:
        assert not ddp_covers_world(lay), lay
        assert comm_bytes(spec(w), lay).get(f"{world_dim(lay)}.all_reduce", 0) >= 8, lay
    assert not ddp_covers_world(ParallelLayout(dp=1, data_parallel="ddp"))  # no replicas


def test_fsdp_pads_the_shard_dim_and_holds_torch_chunks() -> None:
    """FSDP2 at dp 2: ``[3, 5]`` has no even dim, so dim 0 is padded to 4 rows (the all-gather
    and reduce-scatter move 4 x 5); rank 0 holds 2 rows, rank 1 one; ``[3, 4, 6]`` shards its
    largest even dim, unpadded; 0-dim parameters stay whole and are all-reduced."""
    odd = ParamSpec("odd", (3, 5), 0, None, True)
    even = ParamSpec("even", (3, 4, 6), 1, None, False)
    scalar = ParamSpec("s", (), 1, None, True)
    lay = ParallelLayout(dp=2)
    assert shard_dim((3, 5), 2) == 0 and shard_dim((3, 4, 6), 2) == 2 and shard_dim((4, 3), 2) == 0
    assert [local_shape(odd, lay, {"dp": r}) for r in (0, 1)] == [(2, 5), (1, 5)]
    assert local_shape(even, lay, {"dp": 1}) == (3, 4, 3) and local_shape(scalar, lay, {}) == ()
    got = comm_bytes(spec(odd, even, scalar), lay)
    assert got["dp.all_gather"] == 2 * (80 + 288) + 48  # forward + backward, then the guard
    assert got["dp.reduce_scatter"] == 80  # trainable only
    assert got["dp.all_reduce"] == 4 + 8 + 48
    st = [state_bytes(spec(odd, even, scalar), lay, {"dp": r}) for r in (0, 1)]
    assert [s.parameters for s in st] == [40 + 144 + 4, 20 + 144 + 4]
    assert [s.optimizer for s in st] == [2 * 44 + 8, 2 * 24 + 8]


def test_tensor_parallel_shards_and_full_or_partial_gradients() -> None:
    """tp shards ``tp_dim``; a vocab-parallel embedding's gradient comes back whole; experts
    split dim 0 over ep and FSDP over edp; a Partial gradient is reduced only for clipping."""
    col = ParamSpec("col", (8, 4), 0, 0, True)
    emb = ParamSpec("emb", (8, 4), 0, 0, True, full_grad=True)
    temp = ParamSpec("t", (2,), 0, None, True, partial_grad=True)
    expert = ParamSpec("e", (4, 6, 2), 0, None, True, expert=True)
    lay = ParallelLayout(tp=2)
    st = state_bytes(spec(col, emb, temp, n=1), lay, {})
    assert (st.parameters, st.gradients) == (64 + 64 + 8, 64 + 128 + 8)
    assert st.optimizer == 2 * (64 + 64 + 8) + 3 * 4
    assert local_shape(expert, ParallelLayout(dp=4, ep=2), {"edp": 1}) == (1, 6, 2)
    clipped = comm_bytes(spec(temp, n=1), ParallelLayout(tp=2, clip=True))
    assert clipped["tp.all_reduce"] == 8 + 8  # the temperature's gradient, the squared norm
    assert "tp.all_reduce" not in comm_bytes(spec(temp, n=1), lay)


def test_pipeline_sends_boundaries_and_receives_float_gradients() -> None:
    """pp 2, 2 blocks: rank 0 sends block 0's outputs per forward pass (two per micro-batch:
    the gradient cache's forward-only pass) and receives the floating-point ones' gradients."""
    outs = (Boundary(100, True), Boundary(8, False))
    model = spec(n=2, boundaries=(outs, ()))
    lay = ParallelLayout(pp=2, micro_batches=2, micro_batch_size=3)
    assert stage_blocks(model, lay, 1) == [1]
    zero, one = comm_bytes(model, lay, 0), comm_bytes(model, lay, 1)
    assert zero["pp.send"] == one["pp.recv"] == 2 * 6 * 108
    assert zero["pp.recv"] == one["pp.send"] == 6 * 100
    assert zero["pp.broadcast"] == 24 + 48 + 8  # loss (3 float64), terms, SIGTERM flag


@pytest.fixture(scope="module")
def tiny() -> Any:
    return rw.tiny_module(VOCAB)


@pytest.fixture(scope="module")
def tiny_vision_dp() -> Any:
    return rw.tiny_module(VOCAB, vision_parallel="dp")


MEASURED = {  # rank 0 of tests/recipes/test_parity_matrix.py's counts (batch 8, T = 12)
    "dp2 ddp": (
        ParallelLayout(dp=2, data_parallel="ddp", micro_batch_size=4),
        {"dp.all_gather": 3168, "dp.all_reduce": 190748, "dp.broadcast": 8},
    ),
    "tp2": (
        ParallelLayout(tp=2, micro_batch_size=8),
        {"tp.all_gather": 48, "tp.all_reduce": 463904, "tp.broadcast": 8},
    ),
}


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_fusion_spec_matches_counted_bytes(tiny: Any, name: str) -> None:
    lay, want = MEASURED[name]
    assert comm_bytes(fusion_model_spec(tiny, lay, rw.TEXT_LENGTH), lay) == want


def test_fusion_spec_per_decoder_layer_and_state(tiny: Any) -> None:
    """tp 2: each joint-attention decoder layer all-reduces o_proj and down_proj per text
    stream (4 forward), the q/k/v/gate/up input gradients per stream (10) and the image
    tokens' k/v gradients (2) in backward; state bytes of dp 2 DDP as measured."""
    model = fusion_model_spec(tiny, ParallelLayout(tp=2), rw.TEXT_LENGTH)
    decoder = next(i for i, b in enumerate(model.blocks) if b.kind == "language")
    phases = [c.phase for c in model.collectives[decoder]]
    assert (phases.count("forward"), phases.count("backward")) == (4, 12)
    assert {c.kind for c in model.collectives[decoder]} == {"all_reduce"}
    lay = ParallelLayout(dp=2, data_parallel="ddp", micro_batch_size=4)
    st = state_bytes(fusion_model_spec(tiny, lay, rw.TEXT_LENGTH), lay, {"dp": 1})
    assert (st.parameters, st.gradients, st.optimizer) == (191708, 188636, 377544)


def test_moe_counts_exact_token_dispatch_bounded() -> None:
    """ep 2 (dp 2, FSDP): 3 MoE layers (adapter: T tokens per sample; 2 decoder layers: both
    streams and, under joint attention with a vision router, the N image tokens: 2 T + N)
    exchange 4 int64 expert counts each (exact) and dispatch k = 2 copies of each token
    (routing-dependent: expectation and [0, high]); expert weights split over ep. Every other
    key as without experts (the parity run counts them: tests/recipes)."""
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_width=32,
        router_dim=8,
        capacity_factor=None,
        aux_loss_weight=0.0,
        z_loss_weight=0.0,
    )
    lay = ParallelLayout(dp=2, ep=2, micro_batch_size=4)
    module = rw.tiny_module(VOCAB, moe=moe)
    model = fusion_model_spec(module, lay, rw.TEXT_LENGTH)
    bounds = comm_bounds(model, lay)
    vision = module.fusion_config.vision
    n_img = (vision.image_size // vision.patch_size) ** 2  # joint attention routes [img; h; ht]
    assert n_img == 4
    rows = 4 * (12 + 2 * (24 + n_img)) * 2  # samples * tokens routed * k: 544 rows of 32 floats
    assert bounds["ep.all_to_all"] == (3 * 32, 3 * 32)
    assert bounds["ep.all_to_all_v"] == (0, 2 * 3 * rows * 128)  # 2 phases x (1 + ep) x rows
    assert comm_bytes(model, lay)["ep.all_to_all_v"] == 2 * 2 * rows * 128
    assert all(low == high for k, (low, high) in bounds.items() if k != "ep.all_to_all_v")
    st = state_bytes(model, lay, {"dp": 0, "edp": 0, "ep": 0})
    assert (st.parameters, st.gradients, st.optimizer) == (146772, 145236, 290764)  # measured
    assert {p.name.rsplit(".", 1)[-1] for p in model.params if p.expert} == {
        "w_gate",
        "w_up",
        "w_down",
    }


def test_pure_functions_are_fast(tiny: Any) -> None:
    """The planner calls comm_bytes / state_bytes for hundreds of layouts."""
    lay = ParallelLayout(tp=2, pp=2, dp=2, micro_batches=4, micro_batch_size=2)
    model = fusion_model_spec(tiny, lay, rw.TEXT_LENGTH)
    start = time.perf_counter()
    for _ in range(200):
        comm_bytes(model, lay, 1)
        state_bytes(model, lay, {"pp": 1, "dp": 1})
    assert time.perf_counter() - start < 1.0


def test_expert_weights_move_over_edp() -> None:
    """dp 4 = edp 2 x ep 2: an expert weight ``[4, 6, 2]`` keeps 2 experts per rank; FSDP2
    gathers / reduce-scatters that ``[2, 6, 2]`` over edp (forward, backward) as its own unit;
    under DDP it is all-reduced over edp once per batch. ep == dp (edp 1): nothing moves."""
    expert = ParamSpec("e", (4, 6, 2), 0, None, True, expert=True)
    model = spec(expert, n=1)
    fsdp = comm_bytes(model, ParallelLayout(dp=4, ep=2, accumulate=3))
    assert (fsdp["edp.all_gather"], fsdp["edp.reduce_scatter"]) == (3 * 2 * 96, 3 * 96)
    ddp = comm_bytes(model, ParallelLayout(dp=4, ep=2, data_parallel="ddp", accumulate=3))
    assert ddp["edp.all_reduce"] == 3 * 96 and "edp.all_gather" not in ddp
    assert not any(k.startswith("edp") for k in comm_bytes(model, ParallelLayout(dp=4, ep=4)))


def test_partial_gradients_over_tp() -> None:
    """``sum_over_tp`` (a tower data-parallel inside tp): the local gradient is summed over tp
    after every backward (its FSDP shard under FSDP). ``partial_grad`` (a Partial gradient):
    all-reduced over tp in backward when FSDP shards the parameter (its reduce-scatter needs
    it Replicate), else only when clipping reads it."""
    tower = ParamSpec("v", (6, 4), 0, None, True, sum_over_tp=True)
    norm = ParamSpec("n", (8,), 0, None, True, partial_grad=True)
    model = spec(tower, norm, n=1)
    got = comm_bytes(model, ParallelLayout(tp=2, accumulate=2))
    assert got["tp.all_reduce"] == 2 * 96  # the tower; the norm's stays Partial (no clip)
    assert comm_bytes(model, ParallelLayout(tp=2, clip=True))["tp.all_reduce"] == 96 + 32 + 8
    sharded = comm_bytes(model, ParallelLayout(tp=2, dp=2, accumulate=2, clip=True))
    assert sharded["tp.all_reduce"] == 2 * (48 + 32)  # per batch: FSDP shard, whole norm


def test_layouts_the_strategy_refuses_raise(tiny: Any, tiny_vision_dp: Any) -> None:
    """No byte count for a layout that cannot run: the error names the option and the fix."""
    lay = ParallelLayout(tp=2, micro_batch_size=3, vision_parallel="dp")
    model = fusion_model_spec(tiny_vision_dp, lay, rw.TEXT_LENGTH)
    with pytest.raises(ValueError, match=r"of each batch \(data.batch_size 3\) .*by tensor_paral"):
        comm_bytes(model, lay)
    sp = ParallelLayout(tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel \(True\).*\(11 tokens\).*tp \(2\)"):
        comm_bytes(fusion_model_spec(tiny, sp, 11), sp)
    with pytest.raises(ValueError, match="expert_parallel"):
        fusion_model_spec(tiny, ParallelLayout(dp=2, ep=2), rw.TEXT_LENGTH)  # no MoE layers


def test_fusion_spec_vision_dp_sequence_parallel_and_bf16(tiny: Any, tiny_vision_dp: Any) -> None:
    """vision dp: one tp all-gather of the ViT output (``[5, 32]`` per image) on the last ViT
    block, the stem's and blocks' gradients summed over tp (the counted rank-0 bytes of the
    parity layout), ``1 / tp`` of the images across ViT stage boundaries. Sequence parallel:
    the two text streams cross stage boundaries sharded; norms get Partial gradients.
    bf16-true: 2-byte parameters and activations."""
    lay = ParallelLayout(tp=2, micro_batch_size=8, vision_parallel="dp")
    model = fusion_model_spec(tiny_vision_dp, lay, rw.TEXT_LENGTH)
    assert comm_bytes(model, lay) == {
        "tp.all_gather": 5168,
        "tp.all_reduce": 519840,
        "tp.broadcast": 8,
    }
    summed = {p.name.split(".", 2)[2].split(".")[0] for p in model.params if p.sum_over_tp}
    assert summed == {"conv1", "ln_pre", "class_embedding", "positional_embedding", "block"}
    assert model.boundaries[0][0].bytes_per_sample == 5 * 32 * 4 // 2  # stem -> layer0
    assert model.boundaries[1][0].bytes_per_sample == 5 * 32 * 4  # after the gather
    sp = ParallelLayout(tp=2, sequence_parallel=True)
    model = fusion_model_spec(tiny, sp, rw.TEXT_LENGTH)
    bridge = next(i for i, b in enumerate(model.blocks) if b.name == "bridge")
    assert [x.bytes_per_sample for x in model.boundaries[bridge]][2:4] == [768, 768]
    assert sum(p.partial_grad for p in model.params) == 4 + 2 * 3 + 1  # norms, gates, temps
    half = fusion_model_spec(tiny, ParallelLayout(precision="bf16-true"), rw.TEXT_LENGTH)
    assert {p.element_size for p in half.params} == {2}
    assert half.boundaries[0][0].bytes_per_sample == 5 * 32 * 2


@pytest.mark.parametrize(
    "lay",
    [
        ParallelLayout(dp=2, data_parallel="ddp", micro_batch_size=4),
        ParallelLayout(tp=2, dp=2, micro_batch_size=4, accumulate=2, clip=True),
        ParallelLayout(pp=2, dp=2, micro_batches=2, micro_batch_size=2),
    ],
    ids=["dp2 ddp", "tp2 x dp2 fsdp clip", "pp2 x dp2 fsdp"],
)
def test_comm_parts_split_every_key_by_purpose(tiny: Any, lay: ParallelLayout) -> None:
    """``comm_parts``: each key's purposes sum to ``comm_bytes``; the gradient reduce is
    ``ddp`` or ``fsdp`` by the engine, the logging all-reduce its own; under pp the boundary
    sends are ``boundary``; every purpose is named (the dry run compares the set-up ones)."""
    from lightning_mmpar.layout.comm import SET_UP_PURPOSES, comm_parts

    model = fusion_model_spec(tiny, lay, rw.TEXT_LENGTH)
    for pp_rank in range(lay.pp):
        parts = comm_parts(model, lay, pp_rank)
        assert {k: sum(v.values()) for k, v in parts.items()} == comm_bytes(model, lay, pp_rank)
        assert all(why and n > 0 for v in parts.values() for why, n in v.items()), parts
        assert parts["dp.all_reduce"]["logging"] == lay.accumulate * (8 + 48)
        engine = "ddp" if lay.data_parallel == "ddp" else "fsdp"
        set_up = {w for v in parts.values() for w in v} & set(SET_UP_PURPOSES)
        assert engine in set_up and ({"ddp", "fsdp"} - {engine}).isdisjoint(set_up), parts
        if engine == "fsdp":
            assert parts["dp.all_gather"]["fsdp"] > 0 and parts["dp.reduce_scatter"]["fsdp"] > 0
        if lay.pp > 1:
            assert set(parts["pp.send"]) == {"boundary"}
