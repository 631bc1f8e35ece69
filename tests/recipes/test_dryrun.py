"""``python -m lightning_mmpar.recipes.dryrun`` in-process: every rank of the CPU recipe set up on
the fake process group and the meta device, its measured state bytes equal to the planner's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import yaml
from torch.distributed.tensor import DTensor

from lightning_mmpar.layout.memory import StateBytes
from lightning_mmpar.recipes import dryrun
from lightning_mmpar.recipes.partition import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def cpu_reports() -> list[dryrun.RankReport]:
    """Every rank of the CPU recipe (tp 2 x pp 2, 4 ranks), set up one after the other."""
    planned = dryrun.plan_layout(load_recipe(str(RECIPES / "clip_llama_cpu.yaml")), 4)
    return [dryrun.report_rank(planned, rank) for rank in range(4)]


def test_cpu_recipe_ranks_match_the_planner_exactly(cpu_reports: list[dryrun.RankReport]) -> None:
    for r in cpu_reports:
        assert r.mismatches() == [], (r.rank, r.mismatches())
        assert r.measured.parameters == r.predicted.parameters > 0
        assert r.measured.optimizer == r.predicted.optimizer > 0
        assert r.blocks == r.predicted_blocks
    # pp rank 0 holds the vision tower, pp rank 1 the language model and head (the YAML's
    # equal partition of 9 blocks into 2 stages)
    assert [r.coords["pp"] for r in cpu_reports] == [0, 0, 1, 1]
    assert cpu_reports[0].blocks == list(range(5)) and cpu_reports[2].blocks == [5, 6, 7, 8]
    assert not dist.is_initialized()  # each rank's fake group destroyed


def test_vocab_parallel_gradient_is_the_explained_difference(
    cpu_reports: list[dryrun.RankReport],
) -> None:
    """The CPU recipe trains its embeddings at dp 1: the vocab-parallel embedding's gradient
    comes back whole, which the planner counts and a set-up without backward cannot see."""
    first, last = cpu_reports[0], cpu_reports[2]
    assert first.full_grad_extra > 0 and first.measured.gradients < first.predicted.gradients
    assert first.measured.gradients + first.full_grad_extra == first.predicted.gradients
    assert last.full_grad_extra == 0 and last.measured.gradients == last.predicted.gradients
    lines = dryrun.format_rank(first)
    assert any("explained: vocab-parallel" in line for line in lines)
    assert not any("MISMATCH" in line for line in lines)


def test_predictions_are_labelled_as_such(cpu_reports: list[dryrun.RankReport]) -> None:
    lines = dryrun.format_rank(cpu_reports[0])
    assert any(line.startswith("  activations predicted") for line in lines)
    assert any("collectives of one step, predicted" in line for line in lines)
    assert cpu_reports[0].comm["tp.all_reduce"] > 0 and cpu_reports[0].activations > 0


def test_decoder_is_tensor_parallel_under_the_strategy_set_up() -> None:
    """The strategy's own set-up (trainer, mesh, ``configure_model``) reaches ``parallelize``:
    the decoder's projections are sharded over tp (a module set up without its trainer applied
    its plan at tp 1 and left them whole)."""
    config = load_recipe(str(RECIPES / "clip_llama_cpu.yaml"))
    trainer, module = dryrun.build_rank(config, 4, 2)  # pp rank 1: the decoder
    try:
        chunk = trainer.strategy.pipeline.chunks[0]
        sharded = [
            p
            for n, p in chunk.named_parameters()
            if "q_proj" in n and isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names
        ]
        assert sharded and all(p.to_local().shape[0] * 2 == p.shape[0] for p in sharded)
        assert all(p.is_meta for p in module.parameters())  # nothing materialised
    finally:
        dist.destroy_process_group()


def _write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_refuses_a_layout_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_recipe(str(RECIPES / "clip_llama_cpu.yaml"))
    config["trainer"]["strategy"]["init_args"]["tensor_parallel"] = 3  # 4 heads, 64 wide
    assert dryrun.main(["--config", _write(tmp_path, config), "--gpus", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dryrun: refused:")
    assert "tensor-parallel size (3)" in err[0]
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("argv", "why"),
    [(["--ranks", "4"], "--ranks"), (["--gpus", "0"], "--gpus"), (["--gpus", "6"], "divide")],
)
def test_refuses_bad_arguments(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(RECIPES / "clip_llama_cpu.yaml")
    assert dryrun.main(["--config", config, *argv]) == 2
    assert why in capsys.readouterr().err


def test_main_prints_every_rank_and_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    assert dryrun.main(["--config", str(RECIPES / "clip_llama_cpu.yaml"), "--ranks", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 (tp 1" in out and "1 of 1 ranks agree with the planner" in out
    assert "the strategy's stage plan:" in out


def test_mismatch_is_reported() -> None:
    state = StateBytes(10, 4, 12)
    report = dryrun.RankReport(
        rank=0,
        coords={"pp": 0},
        measured=state,
        predicted=StateBytes(10, 4, 16),
        blocks=[0, 1],
        predicted_blocks=[0, 2],
        full_grad_extra=0,
        activations=0,
        comm={"dp.all_gather": 7, "dp.all_reduce": 3},
        seconds=0.0,
        comm_measured={"dp.all_gather": 5, "dp.all_reduce": 1},
        comm_set_up={"dp.all_gather": 6, "dp.all_reduce": 3},
        comm_explained={"dp.all_reduce": 2},
    )
    assert report.mismatches() == [
        "blocks [0, 1] vs predicted [0, 2]",
        "optimizer 12 vs predicted 16",
        "dp.all_gather 5 vs predicted 6",
    ]
    lines = dryrun.format_rank(report)
    assert any("dp.all_reduce" in line and "explained" in line for line in lines)
    assert any(line.startswith("  MISMATCH") for line in dryrun.format_rank(report))
    assert dryrun._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("recipe", ["clip_llama_8gpu", "clip_llama_moe_8gpu"])
def test_real_size_recipe_ranks_match_the_planner_exactly(recipe: str) -> None:
    """A shipped 8-GPU YAML at its real size (a 2B-parameter decoder, tp 4 x pp 2): the first
    rank of each pipeline rank, measured state bytes equal to the planner's, no mismatch."""
    planned = dryrun.plan_layout(load_recipe(str(RECIPES / f"{recipe}.yaml")), 8)
    for rank in (0, 4):
        r = dryrun.report_rank(planned, rank)
        assert r.coords["pp"] == rank // 4 and r.mismatches() == [], (recipe, rank, r)
        assert r.measured == r.predicted and r.measured.parameters > 2**26


@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_set_up_collectives_are_measured_and_agree(engine: str) -> None:
    """The CPU recipe at tp 2 x pp 2 x dp 2 (8 ranks), a rank of each pipeline rank: the
    collectives the set-up fixes, measured from the built model (FSDP2's unit all-gathers and
    reduce-scatters from its parameter groups, the all-reduce of what no unit manages - the
    head's 0-dim parameters -, DDP's gradient all-reduce), equal to the planner's part of
    ``comm_bytes`` for the same purposes. Under ``ddp`` the trained vocab-parallel embedding's
    gradient is all-reduced whole: the planner's extra bytes, explained."""
    config = load_recipe(str(RECIPES / "clip_llama_cpu.yaml"))
    config["trainer"]["strategy"]["init_args"]["data_parallel"] = engine
    planned = dryrun.plan_layout(config, 8)
    assert planned.layout.dp == 2
    reports = [dryrun.report_rank(planned, rank) for rank in (0, 4)]
    for rank, r in zip((0, 4), reports, strict=True):
        assert r.mismatches() == [], (engine, rank, r.mismatches())
        keys = {"dp.all_reduce"} if engine == "ddp" else {"dp.all_gather", "dp.reduce_scatter"}
        if engine == "fsdp" and r.coords["pp"] == 1:
            keys.add("dp.all_reduce")  # the 0-dim parameters, replicated
        assert r.comm_measured.keys() == keys, (engine, rank, r.comm_measured)
        for key, got in r.comm_measured.items():
            assert got + r.comm_explained.get(key, 0) == r.comm_set_up[key] > 0
            assert r.comm_set_up[key] <= r.comm[key], (engine, rank, key)  # a part of it
        lines = dryrun.format_rank(r)
        assert sum("(its set-up part)" in line for line in lines) == len(keys)
    first = reports[0]
    if engine == "ddp":  # pp rank 0 holds the embedding: its whole gradient, explained
        assert first.comm_explained["dp.all_reduce"] > 0
        assert first.comm_measured["dp.all_reduce"] < first.comm_set_up["dp.all_reduce"]
    else:
        assert first.comm_explained == {}


def _noncolocated(tp: int, pp: int, vision: int = 1, engine: str = "ddp") -> dict[str, Any]:
    """The CPU recipe with its vision tower on ``vision`` ranks of their own
    (``vision_ranks``, ``vision_data_parallel=engine``) beside tp x pp language ranks."""
    config = load_recipe(str(RECIPES / "clip_llama_cpu.yaml"))
    args = config["trainer"]["strategy"]["init_args"]
    args.update(tensor_parallel=tp, pipeline_parallel=pp, vision_ranks=vision)
    args.update(vision_data_parallel=engine)
    config["trainer"]["devices"] = tp * pp + vision
    return config


def test_two_vision_ranks_all_reduce_the_tower_gradients() -> None:
    """2 vision ranks beside one language rank: each vision rank all-reduces its tower's
    trainable gradients once per step (measured from the tower it holds), the planner's
    ``vision.all_reduce``; under ``vision_data_parallel: fsdp`` it holds half the tower's
    bytes (each block's FSDP2 shards) and its all-gathers and reduce-scatter, measured from
    the units, are the planner's (``vision_comm_bytes``), every count agreeing."""
    planned = dryrun.plan_layout(_noncolocated(1, 1, vision=2), 3)
    r = dryrun.report_rank(planned, 2)
    assert r.coords == {"vision": 1} and r.mismatches() == [], r.mismatches()
    assert r.comm_measured == r.comm_set_up == {"vision.all_reduce": r.measured.gradients}
    assert r.measured.gradients > 0
    sharded = dryrun.plan_layout(_noncolocated(1, 1, vision=2, engine="fsdp"), 3)
    assert sharded.layout.vision_data_parallel == "fsdp"
    f = dryrun.report_rank(sharded, 2)
    assert f.mismatches() == [], f.mismatches()
    assert set(f.comm_measured) == {"vision.all_gather", "vision.reduce_scatter"}
    # the CPU recipe's tower splits evenly over 2 ranks: no padding, exactly half each
    assert f.comm_measured["vision.reduce_scatter"] == r.measured.gradients
    assert f.comm_measured["vision.all_gather"] == 2 * r.measured.parameters
    assert 2 * f.measured.gradients == r.measured.gradients
    assert 2 * f.measured.optimizer < r.measured.optimizer + 4096  # moments halved, steps kept
    assert not dist.is_initialized()


def test_vision_ranks_dry_run_agrees_with_the_planner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1 vision rank + tp 2 (3 ranks): the language ranks hold the blocks after the tower,
    the vision rank a full copy of it, each count equal to the planner's; the vision rank's
    transfer bytes per step are printed beside them (predicted)."""
    assert dryrun.main(["--config", _write(tmp_path, _noncolocated(2, 1))]) == 0
    out = capsys.readouterr().out
    assert "+ 1 vision" in out and "3 of 3 ranks agree with the planner" in out
    assert "rank 2 (vision 0)" in out and "  blocks: 0-3 (planner: 0-3)" in out
    assert out.count("  blocks: 4-8 (planner: 4-8)") == 2  # both tp ranks: no tower block
    assert "tower transfer of one step, predicted (bytes): embeddings out" in out


def test_vision_ranks_pipeline_stages_and_bytes_match_the_planner() -> None:
    """1 vision rank + pp 2: the language stages cut the blocks where the planner does (the
    engine's parameterless ``TowerInlet`` is block 0 of both), a vision rank's parameter,
    gradient and optimizer bytes are the whole tower's, and its transfer bytes are the
    planner's ``tower_cost``: embeddings out to the one first-stage rank, their gradient and
    the pixels in."""
    from lightning_mmpar.layout.towers_cost import split_towers

    planned = dryrun.plan_layout(_noncolocated(1, 2), 3)
    assert planned.gpus == 3 and planned.layout.world == 2
    reports = [dryrun.report_rank(planned, rank) for rank in range(3)]
    assert [r.mismatches() for r in reports] == [[], [], []]
    assert [r.blocks for r in reports] == [[4, 5], [6, 7, 8], [0, 1, 2, 3]]
    vision = reports[2]
    tower = sum(p.numel * p.element_size for p in split_towers(planned.spec)[0].params)
    assert vision.coords == {"vision": 0}
    assert vision.measured.parameters == vision.measured.gradients == tower
    assert vision.measured.optimizer > 2 * tower  # AdamW: two moments and a step each
    moved = vision.transfer
    assert moved["embeddings out"] == moved["gradients in"] > 0  # tp 1: one receiver
    assert moved["pixels in"] == 3 * 32 * 32 * 4 * planned.layout.global_batch
    assert not dist.is_initialized()


def test_vision_ranks_that_leave_no_whole_language_layout_are_refused() -> None:
    with pytest.raises(ValueError, match="vision_ranks 1"):
        dryrun.plan_layout(_noncolocated(2, 2), 4)  # 3 language ranks for tp 2 x pp 2
