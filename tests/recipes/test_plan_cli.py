"""``python -m lightning_mmpar.recipes.plan`` in-process on the CPU recipe (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.recipes import plan as cli
from lightning_mmpar.recipes.partition import build_module
from lightning_mmpar.strategy import MultimodalParallelStrategy

ROOT = Path(__file__).parents[2]
CPU = str(ROOT / "recipes" / "clip_llama_cpu.yaml")
PCIE = str(ROOT / "tests" / "fixtures" / "topology" / "pcie_4gpu_2numa.txt")


def test_plan_cpu_recipe_table_rejections_placement_and_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_yaml = tmp_path / "best.yaml"
    argv = ["--config", CPU, "--gpus", "4", "--device", "cpu", "--topo", PCIE, "--top", "5",
            "--write-yaml", str(out_yaml)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "4 x cpu (32-true" in lines[0]
    header = next(i for i, ln in enumerate(lines) if ln.startswith("#  layout"))
    rows = [ln.split() for ln in lines[header + 1 : header + 6]]
    steps = [float(r[-2]) for r in rows]
    assert len(rows) == 5 and steps == sorted(steps)
    assert all(r[0] == str(i) for i, r in enumerate(rows, 1))
    # the strategy's own check: the CPU model's 2 key-value heads refuse tp 4
    assert any("num_key_value_heads (2) must be divisible" in ln for ln in lines)
    assert any(ln.startswith("placement [") and "vs Megatron order" in ln for ln in lines)
    # the fragment: what the recipe's parser and the strategy accept
    fragment = yaml.safe_load(out_yaml.read_text())
    assert text.endswith(out_yaml.read_text())
    args = fragment["trainer"]["strategy"]["init_args"]
    MultimodalParallelStrategy(**args)
    config = yaml.safe_load(Path(CPU).read_text())
    module, data = build_module(cli._merge(config, {k: fragment[k] for k in ("model", "data")}))
    assert data.batch_size == fragment["data"]["batch_size"]
    assert (
        module.tp_options.sequence_parallel
        == fragment["model"]["tensor_parallel"]["sequence_parallel"]
    )
    tp, pp = args.get("tensor_parallel", 1), args.get("pipeline_parallel", 1)
    assert 4 % (tp * pp) == 0
    ParallelConfig(**{k: v for k, v in args.items() if k != "placement"}).check_batch_size(
        data.batch_size
    )
    # the global batch is the YAML's (72 per dp rank x dp 1): every layout keeps it
    assert data.batch_size * (4 // (tp * pp)) == 72


def test_plan_rejects_layouts_over_the_memory_limit_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--config", CPU, "--gpus", "2", "--device", "cpu",
                     "--memory-gib", "0.0001"]) == 1  # fmt: skip
    text = capsys.readouterr().out
    assert "0 layouts fit" in text
    assert any("needs " in ln and "> 0.0001 GiB" in ln and "parameters" in ln
               for ln in text.splitlines())  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", CPU, "--gpus", "0"], "--gpus (0) must be >= 1"),
        (["--config", CPU, "--gpus", "4", "--device", "tpu"], "--device 'tpu' is unknown"),
        (["--config", "nope.yaml", "--gpus", "4"], "no such file"),
        (["--config", CPU, "--gpus", "4", "--memory-gib", "-1"], "--memory-gib (-1.0) must be"),
        (["--config", CPU, "--gpus", "4", "--device", "a100", "--precision", "fp8"],
         "precision 'fp8' has no peak figure on A100"),
        (["--config", CPU, "--gpus", "3", "--topo", PCIE], "describes 4 devices, --gpus is 3"),
    ],
)  # fmt: skip
def test_invalid_arguments_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err
