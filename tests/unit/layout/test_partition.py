"""Stage partition (lightning_mmpar.layout): every mode against a known optimum or brute force,
virtual stages, every error, the recipe's block specs and the partition CLI."""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_mmpar.layout import (
    BlockSpec,
    Partition,
    compare_modes,
    measure_blocks,
    parse_partition,
    plan_stages,
)
from lightning_mmpar.parallel.pipeline import partition as engine_partition
from lightning_mmpar.recipes import partition as cli

ROOT = Path(__file__).resolve().parents[3]


def spec(
    kind: str,
    flops: float,
    act: float = 0.0,
    params: float = 0.0,
    train: float = 0.0,
    name: str = "b",
) -> BlockSpec:
    return BlockSpec(name, kind, flops, act, params, train)


def fusion_like() -> list[BlockSpec]:
    """4 vision, 2 aligner, 3 language, 1 head."""
    kinds = ["vision"] * 4 + ["aligner"] * 2 + ["language"] * 3 + ["head"]
    return [spec(k, 1.0 + i, name=f"{k}{i}") for i, k in enumerate(kinds)]


def splits(n: int, stages: int) -> list[list[range]]:
    """Every split of ``n`` blocks into ``stages`` non-empty contiguous stages."""
    out = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        out.append([range(bounds[s], bounds[s + 1]) for s in range(stages)])
    return out


def test_equal_is_the_engine_split() -> None:
    blocks = fusion_like()
    for stages in range(1, len(blocks) + 1):
        for pp in (p for p in (1, 2, 3, 4, 5) if stages % p == 0):
            plan = plan_stages(blocks, pp, stages // pp, "equal")
            assert plan.ranges == engine_partition(len(blocks), stages)
            assert plan.num_stages == stages


@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_minimax_modes_equal_brute_force(mode: str) -> None:
    rng = random.Random(0)
    for _ in range(40):
        n, pp, v = rng.randint(2, 8), rng.choice([1, 2, 3]), rng.choice([1, 2])
        if n < pp * v:
            continue
        blocks = [
            spec(
                "language",
                rng.choice([1.0, 2.0, 3.0, rng.random() * 5]),
                act=rng.random(),
                params=rng.random(),
                train=rng.random() * 0.5,
            )
            for _ in range(n)
        ]
        plan = plan_stages(blocks, pp, v, mode, micro_batch_size=2)
        cost = (lambda p: p.stage_flops) if mode == "balanced" else (lambda p: p.stage_bytes)
        candidates = [
            plan_stages(blocks, pp, v, [r.start for r in rs[1:]] or "equal", micro_batch_size=2)
            for rs in splits(n, pp * v)
        ]
        best = min(max(cost(c)) for c in candidates)
        assert max(cost(plan)) == pytest.approx(best, rel=1e-12)
        # tie-break: the least sum of squares among the optimal plans
        optimal = [c for c in candidates if max(cost(c)) <= best * (1 + 1e-9)]
        least = min(sum(x * x for x in cost(c)) for c in optimal)
        assert sum(x * x for x in cost(plan)) == pytest.approx(least, rel=1e-9)


def test_balanced_known_optimum_and_determinism() -> None:
    blocks = [spec("vision", f) for f in (4, 1, 1, 1, 1, 4, 2, 2)]
    plan = plan_stages(blocks, 2, 2, "balanced")
    assert plan.stage_flops == [4, 4, 4, 4]
    assert plan.ranges == [range(0, 1), range(1, 5), range(5, 6), range(6, 8)]
    assert plan.imbalance == 1.0
    assert plan_stages(blocks, 2, 2, "balanced").ranges == plan.ranges
    # equal cuts by count: [4, 1], [1, 1], [1, 4], [2, 2] -> max 5, mean 4
    assert plan_stages(blocks, 2, 2).imbalance == pytest.approx(5 / 4)


def test_memory_counts_optimizer_and_in_flight_micro_batches() -> None:
    # 4 + 3 * 2 = 10 fixed bytes; 1 activation byte per sample
    blocks = [spec("language", 1.0, act=1.0, params=4.0, train=2.0) for _ in range(4)]
    plan = plan_stages(blocks, 2, 1, "equal", micro_batch_size=3)
    # rank 0 holds pp - 0 = 2 micro-batches in flight, rank 1 one
    assert plan.stage_activation_bytes == [2 * 3 * 2, 2 * 3 * 1]
    assert plan.stage_bytes == [20 + 12, 20 + 6]
    # activations dominate: the memory mode gives rank 0 fewer blocks
    heavy = [spec("language", 1.0, act=10.0) for _ in range(6)]
    assert plan_stages(heavy, 2, 1, "memory").ranges == [range(0, 2), range(2, 6)]
    # virtual stages: stage s runs on rank s % pp
    virtual = plan_stages(heavy, 2, 2, "equal")
    assert virtual.stage_activation_bytes == [20 * 2, 20 * 1, 10 * 2, 10 * 1]  # 2, 2, 1, 1 blocks


def test_ratio_splits_each_tower_and_head_counts_as_decoder() -> None:
    plan = plan_stages(fusion_like(), 2, 2, "ratio:2:1:1")
    assert plan.ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 10)]
    assert plan.stage_kinds[-1] == ("language", "head")
    plan = plan_stages(fusion_like(), 3, 2, "ratio:1:2:3")
    assert plan.ranges[3:] == [range(6, 8), range(8, 9), range(9, 10)]
    assert plan.mode == "ratio:1:2:3"
    text_only = [spec("language", 1.0), spec("language", 1.0), spec("head", 1.0)]
    assert plan_stages(text_only, 2, 1, "ratio:0:0:2").ranges == [range(0, 2), range(2, 3)]


def test_explicit_boundaries_and_mixed_towers() -> None:
    plan = plan_stages(fusion_like(), 2, 1, [5])
    assert plan.ranges == [range(0, 5), range(5, 10)]
    assert plan.stage_kinds == [("vision", "aligner"), ("aligner", "language", "head")]
    assert plan.boundaries == [5] and plan.mode == "[5]"
    assert plan_stages(fusion_like(), 2, 2, "3, 5,8").boundaries == [3, 5, 8]


def test_parse_partition() -> None:
    assert parse_partition("balanced") == Partition("balanced")
    assert parse_partition(" ratio:2:3:3 ", 8) == Partition("ratio", ratio=(2, 3, 3))
    assert parse_partition([4, 9], 3) == Partition("explicit", boundaries=(4, 9))
    assert parse_partition("[4, 9]") == Partition("explicit", boundaries=(4, 9))
    assert str(parse_partition("ratio:2:3:3")) == "ratio:2:3:3"


@pytest.mark.parametrize(
    ("blocks", "pp", "v", "partition", "match"),
    [
        (4, 3, 2, "equal", r"stages \(6 = .*exceed the model's pipeline blocks \(4\)"),
        (10, 2, 2, "ratio:2:1:2", r"ratio sums to 5 stages, the pipeline has 4"),
        (10, 4, 2, "ratio:5:1:2", r"vision tower has 4 blocks and 5 stages"),
        (10, 2, 2, "ratio:3:0:1", r"aligner tower has 2 blocks and 0 stages"),
        (10, 2, 2, "ratio:2:x:1", r"three non-negative stage counts"),
        (10, 2, 2, [5, 3, 7], r"strictly increasing"),
        (10, 2, 2, [0, 3, 7], r"strictly increasing"),
        (10, 2, 2, [3, 7, 10], r"boundary 10 is out of range for 10 blocks"),
        (10, 2, 2, [3, 7], r"2 boundaries for 4 stages; give 3"),
        (10, 2, 2, [3, True, 7], r"list of ints"),
        (10, 2, 1, "fastest", r"'fastest' is not a known mode; use 'equal'"),
        (10, 0, 1, "equal", r"pipeline_parallel \(0\) must be an int >= 1"),
    ],
)
def test_errors_name_value_and_fix(
    blocks: int, pp: int, v: int, partition: object, match: str
) -> None:
    specs = fusion_like()[:blocks]
    with pytest.raises(ValueError, match=match):
        plan_stages(specs, pp, v, partition)  # type: ignore[arg-type]


def test_ratio_needs_ordered_known_towers() -> None:
    with pytest.raises(ValueError, match="kind 'mlp' belongs to no tower"):
        plan_stages([spec("mlp", 1.0), spec("head", 1.0)], 2, 1, "ratio:0:0:2")
    with pytest.raises(ValueError, match="not ordered vision, aligner, decoder"):
        plan_stages([spec("language", 1.0), spec("vision", 1.0)], 2, 1, "ratio:1:0:1")


def test_memory_limit() -> None:
    blocks = [spec("language", 1.0, params=2**30) for _ in range(4)]
    plan = plan_stages(blocks, 2, 1, "memory", memory_limit_bytes=2 * 2**30)
    assert max(plan.stage_bytes) == 2 * 2**30
    with pytest.raises(ValueError, match=r"memory_limit \(1.500 GiB.*best achievable .* 2.000 GiB"):
        plan_stages(blocks, 2, 1, "memory", memory_limit_bytes=1.5 * 2**30)
    with pytest.raises(ValueError, match=r"partition \[3\] \(3.000 GiB\).*use partition='memory'"):
        plan_stages(blocks, 2, 1, [3], memory_limit_bytes=2.5 * 2**30)


def test_compare_modes_and_table() -> None:
    plans = compare_modes(fusion_like(), 2, 2, "ratio:2:1:1")
    assert [p.mode for p in plans] == ["equal", "ratio:1:1:2", "balanced", "memory", "ratio:2:1:1"]
    assert min(p.imbalance for p in plans) == plans[2].imbalance
    table = plans[2].table()
    assert re.search(r"^0 +0 +0-4 \(vision0 \.\. aligner4\) +vision\+aligner +27\.3 ", table, re.M)
    assert "cost %" in table and "boundaries [5, 7, 9], imbalance 1.236" in table
    assert len(compare_modes(fusion_like(), 5, 2)) == 4  # no ratio: 10 stages, 10 blocks ok


def test_cli_on_shipped_yamls(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = str(ROOT / "recipes" / "clip_llama_cpu.yaml")
    assert cli.main(["--config", cpu, "--pp", "4", "--virtual", "2"]) == 0
    out = capsys.readouterr().out
    assert "9 blocks, pp 4 x v 2 = 8 stages, interleaved_1f1b, 4 micro-batches of 18" in out
    for name in (
        "vision.stem",
        "vision.layer1",
        "vision.pool",
        "bridge",
        "adapter0",
        "decoder1",
        "head",
        "balanced",
        "memory",
        "ratio:4:1:3",
    ):
        assert name in out
    big = ROOT / "recipes" / "clip_llama_16gpu.yaml"
    if big.is_file():
        assert cli.main(["--config", str(big), "--pp", "4", "--virtual", "2"]) == 0
        assert "64 blocks, pp 4 x v 2 = 8 stages" in capsys.readouterr().out
    for argv, message in (
        (["--pp", "4", "--partition", "ratio:1:1:1"], "ratio sums to 3 stages"),
        (["--pp", "20", "--virtual", "2"], "exceed the model's pipeline blocks (9)"),
        (["--memory-limit-gib", "0.001", "--partition", "memory"], "memory_limit (1.02 MiB"),
        (["--pp", "4", "--micro-batches", "2"], "must be >= pipeline_parallel (4)"),
        (["--micro-batch-size", "0"], "--micro-batch-size (0) must be >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--config", cpu, *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_block_specs_of_the_cpu_recipe() -> None:
    import yaml

    config = yaml.safe_load((ROOT / "recipes" / "clip_llama_cpu.yaml").read_text())
    specs = cli.build_specs(config)
    assert [s.name for s in specs] == [
        "vision.stem",
        "vision.layer0",
        "vision.layer1",
        "vision.pool",
        "bridge",
        "adapter0",
        "decoder0",
        "decoder1",
        "head",
    ]
    assert [s.kind for s in specs[3:6]] == ["vision", "aligner", "aligner"]
    # everything trains in the CPU recipe except the EMA (momentum) heads of the head block
    assert all(s.trainable_bytes == s.parameter_bytes for s in specs[:-1])
    assert 0 < specs[-1].trainable_bytes < specs[-1].parameter_bytes
    assert specs[1].flops == specs[2].flops > 0 and specs[1].activation_bytes > 0
    with pytest.raises(ValueError, match="text_length"):
        measure_blocks([], 16, 0, [])
    module, data = cli.build_module(config)  # no trainer, no data module attached
    with pytest.raises(ValueError, match=r"text_length \(0\) .* pass text_length"):
        module.pipeline_block_specs()
    assert module.pipeline_block_specs(data.max_length) == specs
    params = list(module.parameters())  # the blocks' parameters, none shared between blocks
    assert sum(s.parameter_bytes for s in specs) == sum(p.numel() * 4 for p in params)
    trainable = sum(p.numel() * 4 for p in params if p.requires_grad)
    assert sum(s.trainable_bytes for s in specs) == trainable


def test_measured_balances_seconds_not_flops() -> None:
    """``measured`` cuts by :attr:`BlockSpec.seconds` (here the FLOPs say the opposite), reports
    its imbalance in seconds, and without times (planner, dry run) cuts as ``balanced``."""
    flops, seconds = (1.0, 1.0, 4.0, 4.0), (4.0, 4.0, 1.0, 1.0)
    timed = [
        BlockSpec(f"b{i}", "language", f, 0.0, 0.0, 0.0, seconds=t)
        for i, (f, t) in enumerate(zip(flops, seconds, strict=True))
    ]
    plan = plan_stages(timed, 2, 1, "measured")
    assert plan.boundaries == [1] and plan.stage_seconds == [4.0, 6.0]
    assert plan.imbalance == pytest.approx(6 / 5) and plan.measured_imbalance == plan.imbalance
    balanced = plan_stages(timed, 2, 1, "balanced")
    assert balanced.boundaries == [3] and balanced.imbalance == pytest.approx(6 / 5)
    assert balanced.measured_imbalance == pytest.approx(9 / 5)  # what the FLOPs cut costs
    untimed = [replace(b, seconds=None) for b in timed]
    assert plan_stages(untimed, 2, 1, "measured").boundaries == [3]
    assert plan_stages(untimed, 2, 1, "measured").measured_imbalance is None
    assert parse_partition("measured") == Partition("measured")
    assert "measured" in plan.table()
