"""Every benchmark runs for one short iteration (``--smoke``) and its correctness checks hold
(issue 14): nothing here depends on timings, only on what the benchmarks assert about the work
they compare (the same losses on both sides, counted calls and bytes equal to the model's).

Each benchmark's ``main(["--smoke", ...])`` runs in this process (:func:`run_main`): its spawned
worlds come from this process's forkserver, which has imported torch, Lightning and the package
once, instead of a fresh interpreter and forkserver per script. ``run_all.py`` runs them as
scripts; ``benchmarks/gpu_check.sh`` is run as one here.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from run_all import ARGS, BENCHMARKS  # noqa: E402


def _overhead(r: dict[str, Any]) -> None:
    pairs = [p for world in r["results"].values() for p in world.values()]
    assert pairs and all(p["same_work"] for p in pairs), pairs


def _planner(r: dict[str, Any]) -> None:
    assert r["calls"] and all(c["equal"] for c in r["calls"].values()), r["calls"]
    assert set(r["measured_step_s"]) == set(r["predicted"])


def _pipeline(r: dict[str, Any]) -> None:
    rows = r["results"]["pp2"]
    assert rows and all(row["step_s"] > 0 for row in rows.values())
    for row in rows.values():  # the timeline's split of the bubble: waits, host, fill / drain
        assert 0.0 < row["bubble_wait"] < 1.0 and 0.0 <= row["bubble_host"] < 1.0, row
        assert 0.0 <= row["bubble_outside"] < 1.0, row
        assert 0.0 <= row["bubble_post"] < 1.0, row
        assert 0.0 <= row["bubble_stage_cost"] < 1.0 and "kept" not in r, row  # unequal stages


def _zero(r: dict[str, Any]) -> None:
    assert r["loss_check"]["ok"], r["loss_check"]  # every side trains the same first step
    for side in ("mm_fsdp", "mm_ddp"):  # measured state bytes = the cost model's, every rank
        for rank, want in enumerate(r["analytical"][side]):
            got = {k: r["bytes"][side][rank][k] for k in ("parameters", "gradients", "optimizer")}
            assert got == want, (side, rank, got, want)
    for pair in ("mm_fsdp/ds_zero3", "mm_fsdp/ds_zero2", "mm_ddp/ds_zero2"):
        assert r["ratios"][pair]["ratio"] > 0
    assert r["torchtitan"]["finding"]


def _memory_comm(r: dict[str, Any]) -> None:
    layouts = r["memory_comm"]
    assert layouts and all(x["state_equal"] and x["comm_equal"] for x in layouts.values())
    assert all(x["excess_adds_up"] and x["ideal_equal"] for x in layouts.values())


def _scaling(r: dict[str, Any]) -> None:
    axes = r["scaling"]
    assert axes and set(axes) <= {"image tokens", "text length", "layers", "experts"}
    assert all(
        len(x["points"]) >= 2 and x["time_expected"] == x["time_expected"] for x in axes.values()
    )


def _learning(r: dict[str, Any]) -> None:
    runs = r["runs"]  # --smoke: 2 steps each on one process, the bar reported (not reached)
    assert set(runs) == {"recipe tp2 x pp2", "moe one process"}, runs
    assert all(x["steps"] == 2 and 0.0 <= x["zero_shot_acc"] <= 1.0 for x in runs.values())
    assert all(x["met"] == (x["zero_shot_acc"] >= x["bar"]) for x in runs.values())
    assert sorted(runs["moe one process"]["router"]) == ["text", "vision"]


def _packing(r: dict[str, Any]) -> None:
    assert set(r["packing"]) == {"conversations", "digits_vqa"}
    for x in r["packing"].values():  # the same samples on both sides, fewer pad positions
        padded, packed = x["padded"], x["packed"]
        for key in ("sample_tokens", "target_tokens", "images"):
            assert padded[key] == packed[key] > 0, (key, padded[key], packed[key])
        assert packed["rows"] < padded["rows"]
        assert packed["non_pad_fraction"] >= padded["non_pad_fraction"]
        assert padded["target_tokens_per_s"] > 0 and packed["target_tokens_per_s"] > 0


def _planner_noncolocated(r: dict[str, Any]) -> None:
    layouts = {"vision 1 + language 1", "dp2 ddp"}
    assert set(r["measured_step_s"]) == set(r["predicted"]) == layouts
    assert [row["against"] for row in r["agreement"]] == ["dp2 ddp"]
    assert all(r["predicted"][n]["step_s"] > 0 for n in layouts)


def _noncolocated(r: dict[str, Any]) -> None:
    ours, theirs = "vision 1 + language 1", "dp2 ddp"  # --smoke: these two, 2 processes
    assert set(r["layouts"]) == {ours, theirs} and r["best_colocated"] == theirs
    assert r["config"]["processes"] == 2 and r["against"][theirs]["ratio"] == r["ratio"] > 0
    for x in r["layouts"].values():
        assert x["step_s"] > 0 and x["cpu_s_all_ranks"] > 0 and x["tokens_per_s_per_process"] > 0
    m = r["measured"]  # the same work: every step's target tokens and images on both sides
    assert m[ours]["tokens"] == m[theirs]["tokens"] and m[ours]["tokens"][0][0] > 0
    assert m[ours]["images_per_sample"] == m[theirs]["images_per_sample"] > 1


def _hf_tax(r: dict[str, Any]) -> None:
    assert r["same_loss"], r["first_loss"]  # the same model and batch on every side
    assert set(r["first_loss"]) == {"theirs", "ours", "ours_text_stream"}
    assert r["ours"]["ratio"] > 0 and r["ours_text_stream"]["ratio"] > 0


def _hf_tax_qwen(r: dict[str, Any]) -> None:
    assert set(r["families"]) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe"}
    for x in r["families"].values():  # the same model and batch on both sides
        assert x["same_loss"], x["first_loss"]
        assert x["ours"]["ratio"] > 0


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "overhead": _overhead,
    "planner": _planner,
    "pipeline": _pipeline,
    "zero": _zero,
    "memory_comm": _memory_comm,
    "scaling": _scaling,
    "learning": _learning,
    "packing": _packing,
    "noncolocated": _noncolocated,
    "hf_tax": _hf_tax,
    "hf_tax_qwen": _hf_tax_qwen,
}


def run_main(
    script: str, out_dir: Path, monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...] = ()
) -> Any:
    """``benchmarks/<script>``'s ``main(["--smoke", "--out-dir", out_dir])`` in this process, as
    ``python benchmarks/<script> --smoke --out-dir <out_dir>`` would run it (``sys.argv``, the
    working directory); torch's thread count, which benchmarks set, is restored after."""
    argv = [*extra, "--smoke", "--out-dir", str(out_dir)]
    module = importlib.import_module(Path(script).stem)  # by name: spawned ranks import it so
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.chdir(ROOT)
    threads = torch.get_num_threads()
    try:
        return module.main(argv)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_smoke(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_main(BENCHMARKS[name][0], tmp_path, monkeypatch, ARGS.get(name, ()))
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["machine"]["cpus"] and result["command"]
    CHECKS.get(name, lambda r: None)(result)
    if name == "noncolocated":  # bench_planner.py --noncolocated: the same run, predicted too
        _planner_noncolocated(json.loads((tmp_path / "planner_noncolocated.json").read_text()))


def test_planner_prices_the_noncolocated_benchmark_layouts() -> None:
    """``bench_planner.py --noncolocated``'s prediction side (no process spawned): every
    layout of ``bench_noncolocated`` priced on a given calibration, the non-colocated one as
    the serial exchange runs (its parts add up to the step), and the order table."""
    import bench_noncolocated as nc
    import bench_planner as bp

    cal = {"flops": 5e10, "overhead": 2e-4, "alpha": 5e-5, "beta": 1e9, "call_s": 1e-4}
    got = bp.predict_towers(list(nc.LAYOUTS), 32, 2.5, cal)
    assert set(got) == set(nc.LAYOUTS)
    ours = got[nc.NONCOLOCATED]
    assert ours["step_s"] == pytest.approx(sum(ours["breakdown"].values()))
    assert ours["breakdown"]["vision forward"] > 0 and set(ours["idle"]) == {
        "language ranks",
        "vision ranks",
    }
    ahead = bp.predict_towers([nc.NONCOLOCATED], 32, 2.5, cal, accumulate=4)[nc.NONCOLOCATED]
    assert ahead["step_s"] == pytest.approx(sum(ahead["breakdown"].values()))
    assert ahead["breakdown"]["waiting for the other side"] >= 0  # one batch ahead, as run
    rows = bp.agreement({"a": 2.0, "b": 1.0, "c": 3.0}, {"a": 1.0, "b": 2.0, "c": 0.5}, "a")
    assert [
        (x["against"], x["measured_faster"], x["predicted_faster"], x["agree"]) for x in rows
    ] == [
        ("b", False, True, False),
        ("c", True, False, False),
    ]


def test_results_page_renders_the_committed_results() -> None:
    """docs/results.md is generated from docs/results/*.json: every benchmark has a section,
    and the committed page is the generator's output for the committed JSON."""
    from results_md import render

    text = render()
    assert all(f"## {name}:" in text for name in BENCHMARKS)
    assert (ROOT / "docs" / "results.md").read_text() == text


def test_gpu_check_code_path_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_check.py's code path at tiny sizes on CPU (gloo at world size 1, FP8
    emulation): bf16, fp8 and a forced FP8 fallback train finite losses, the fallback fires,
    and every parallel.comm helper (and the raw collectives) passes its check."""
    run_main("gpu_check.py", tmp_path, monkeypatch)
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["ok"] and r["runs"]["fp8_fallback"]["fallback"]["ok"]
    assert r["runs"]["fp8"]["fp8_layers"][0] > 0
    fb = r["runs"]["fp8_fallback"]["fallback"]
    assert fb["forced_module"] not in fb["fell_back_before_outlier"]
    assert list(r["runs"]) == ["bf16", "fp8", "fp8_fallback", "fp8_2", "bf16_2"]  # A B, B A
    assert len(r["fp8_speedup_rounds"]) == 2 and r["fp8_speedup"] > 0
    col = r["runs"]["bf16"]["collectives"]
    assert col["backend"] == "gloo" and not col["failed"] and len(col["helpers"]) == 68


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the real check")
def test_gpu_check_sh_exits_0_without_cuda() -> None:
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    done = subprocess.run(
        ["bash", script], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stdout + done.stderr


def test_gpu_llava_code_path_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_llava.py's code path at tiny sizes on CPU: the spliced-fusion module trains
    packed and padded ragged batches with finite losses, packing fills more of its rows, FP8
    through torchao runs or says why not, and the model FLOPs count what the docstring says."""
    import gpu_llava

    run_main("gpu_llava.py", tmp_path, monkeypatch)
    r = json.loads((tmp_path / "gpu_llava.json").read_text())
    assert r["ok"] and list(r["runs"]) == ["bf16_packed", "bf16_padded", "fp8_torchao"]
    packed, padded = r["runs"]["bf16_packed"], r["runs"]["bf16_padded"]
    assert packed["losses_finite"] and padded["losses_finite"]
    assert packed["batches"]["non_pad_fraction"] > padded["batches"]["non_pad_fraction"]
    assert packed["mfu"] is None and r["packed_vs_padded_tokens_per_s"] > 0
    fp8 = r["runs"]["fp8_torchao"]
    assert "torchao" in fp8.get("skipped", "torchao") and (fp8.get("losses_finite", True))
    sizes = gpu_llava.SIZES["tiny"]  # one row: samples of 3 and 5 tokens, one image; one pad
    batch = {
        "sample_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, -1]]),
        "image_mask": torch.ones(1, 1),
    }
    weights = {"vision": 10, "trained": 100}
    lang, vis, pos = sizes["language"], sizes["vision"], gpu_llava.image_tokens(sizes) + 1
    expected = 6 * 100 * 8 + 6 * lang["hidden_size"] * lang["num_hidden_layers"] * (9 + 25)
    expected += 2 * 10 * pos + 4 * vis["width"] * vis["layers"] * pos**2
    assert gpu_llava.model_flops(sizes, weights, batch) == expected
    # LLaVA-1.5's projector (mlp2x_gelu), recorded in the JSON and shown by docs/results.md
    assert r["projector"] == "mlp2x_gelu"
    fusion = gpu_llava.build_module(sizes, fp8=False).fusion_config
    assert (fusion.projector, fusion.projector_act) == ("mlp2x", "gelu")
    from results_md import _llava_projector

    assert _llava_projector(r) == "Projector: `mlp2x_gelu` (LLaVA-1.5's)."
