"""Exact mid-epoch resume and per-rank callback state (issue 9, faults 10 and 14).

* ``restore_rank_state``'s rules, on a checkpoint written by two fake ranks: same layout, every
  rank its own state; another layout with the same data-parallel size, the loop state of the
  rank with the same dp coordinate and rank 0's callbacks; another dp size or an old checkpoint,
  rank 0's state, each with a warning;
* the FP8 fallback callback puts the modules it had switched to BF16 back into BF16 on resume
  (a module's precision is not in its weights);
* one process (plain Lightning), and a 2-process world at dp 2 (FSDP2, no DataLoader workers)
  and pp 2 (2 workers per rank): ``STEPS`` steps uninterrupted vs ``SAVE_AT`` steps, a DCP
  checkpoint mid-epoch (``ModelCheckpoint(every_n_train_steps)``) and a resume to ``STEPS``.
  Every rank trains on the same batches in the same order (dp ranks on different shards, pipeline
  peers on the same ones), with adapter dropout 0.3 logs the same losses after the resume (the
  tracker's and the default generators' states are checkpointed per rank), its loader workers
  get the same base seeds, ends with the same weights (bitwise), and gets back its own callback
  state (a rank-dependent recorder, ``GradientDriftMonitor``'s statistics,
  ``FP8FallbackCallback``'s decisions).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mmpar.callbacks import FP8FallbackCallback
from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.precision.fp8 import convert_to_fp8
from lightning_mmpar.testing import spawn
from tests.distributed import resume_worker as rw

LAYOUT = {"world_size": 2, "tp": 1, "pp": 1, "ep": 1, "virtual_pipeline": 1}


def _write(path: Path, layout: dict[str, int] | None) -> None:
    """A checkpoint by two ranks of ``layout`` (None: without per-rank files)."""
    path.mkdir()
    model = nn.Linear(2, 2)
    for rank in (1, 0):
        state = None
        if layout is not None:
            own = {"callbacks": {"cb": rank}, "loops": {"position": 10 + rank}}
            state = {"layout": {**layout, "rank": rank}, **own}
        meta = {"callbacks": {"cb": 0}, "loops": {"position": 10}, "global_step": 3}
        ckpt.save_sharded(path, model, [], meta, is_rank_zero=rank == 0, rank_state=state)


def _restore(path: Path, **now: int) -> tuple[dict[str, Any], list[str]]:
    meta = ckpt.load_sharded(path, nn.Linear(2, 2), [])
    notes = ckpt.restore_rank_state(path, meta, {**LAYOUT, **now})
    return meta, notes


def test_restore_rank_state_rules(tmp_path: Path) -> None:
    _write(tmp_path / "dp2", LAYOUT)
    meta, notes = _restore(tmp_path / "dp2", rank=1)
    assert (meta["callbacks"], meta["loops"], notes) == ({"cb": 1}, {"position": 11}, [])
    assert meta["global_step"] == 3
    # tp2 x dp2 on 4 ranks: rank 3 is dp rank 1, the saved rank 1's data position
    meta, notes = _restore(tmp_path / "dp2", world_size=4, tp=2, rank=3)
    assert (meta["callbacks"], meta["loops"]) == ({"cb": 0}, {"position": 11})
    assert len(notes) == 1 and "rank 0's callback state" in notes[0]
    meta, notes = _restore(tmp_path / "dp2", world_size=4, rank=3)  # dp 4
    assert (meta["callbacks"], meta["loops"]) == ({"cb": 0}, {"position": 10})
    assert len(notes) == 2 and "data-parallel size changed (2 -> 4)" in notes[1]
    _write(tmp_path / "old", None)
    meta, notes = _restore(tmp_path / "old", rank=1)
    assert meta["callbacks"] == {"cb": 0} and "no per-rank state" in notes[0]
    ckpt.rank_file(tmp_path / "dp2", 1).unlink()
    with pytest.raises(FileNotFoundError, match=r"rank_00001\.pt is missing"):
        _restore(tmp_path / "dp2", rank=1)
    with pytest.raises(ValueError, match=r"lacks \['rank'\]"):
        ckpt.restore_rank_state(tmp_path / "dp2", {}, LAYOUT)


def test_fp8_fallback_decisions_survive_resume() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    convert_to_fp8(module)
    saved = FP8FallbackCallback()
    saved.fallen, saved._clean_steps = {"1"}, 2
    state = saved.state_dict()
    resumed = FP8FallbackCallback()
    resumed.load_state_dict(state)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer = SimpleNamespace(optimizers=[opt], global_step=7)
    resumed.on_train_start(trainer, module)  # type: ignore[arg-type]
    assert [m.precision for m in module] == ["fp8", "bf16"]
    assert resumed.fallen == {"1"} and resumed._clean_steps == 2
    assert resumed.snapshot.step == 7 and resumed._last_step == 7


def _check_resume(runs: dict[str, Any], rank: int) -> None:
    full, part, resumed = runs["full"], runs["part"], runs["resumed"]
    assert [s for s, _ in full["batches"]] == list(range(rw.STEPS))
    tail = full["batches"][rw.SAVE_AT :]
    assert part["batches"] == full["batches"][: rw.SAVE_AT]
    assert resumed["batches"] == tail, f"rank {rank}: resumed batches differ"
    # dropout masks (the losses) and the workers' base seeds of the resumed steps: bitwise
    assert resumed["losses"] == full["losses"][rw.SAVE_AT :], f"rank {rank}: losses differ"
    assert resumed["worker_seeds"] == full["worker_seeds"][rw.SAVE_AT :], f"rank {rank}: seeds"
    for name, want in full["weights"].items():
        assert torch.equal(resumed["weights"][name], want), f"rank {rank}: {name}"
    saved, restored = part["at_save"], resumed["at_start"]
    assert saved["rank_state"] == {"rank": rank, "seen": rw.SAVE_AT * rw.BATCH}
    assert restored == saved, f"rank {rank}: callback state not its own"


def test_single_process_resume_is_exact(tmp_path: Path) -> None:
    _check_resume(rw.resume_runs(tmp_path, 0), 0)


def test_resume_between_accumulation_windows_is_exact(tmp_path: Path) -> None:
    """``mm_parallel`` reads the loader one accumulation window at a time (the recipe's caption
    term counts the window's tokens first): a checkpoint at an optimizer step has consumed
    exactly the trained batches, so the resumed run trains the same batches (the epoch's short
    last window included) to the same weights, bit for bit."""
    runs = rw.accumulation_runs(tmp_path)
    full, part, resumed = runs["full"], runs["part"], runs["resumed"]
    assert [s for s, _ in full["batches"]] == [0, 0, 1, 1, 2, 3, 3]  # windows 2, 2, 1; 2
    assert part["batches"] == full["batches"][:4]
    assert resumed["batches"] == full["batches"][4:]
    assert resumed["losses"] == full["losses"][4:]
    for name, want in full["weights"].items():
        assert torch.equal(resumed["weights"][name], want), name


@pytest.mark.distributed
def test_mid_epoch_resume_and_rank_state_in_a_world(tmp_path: Path) -> None:
    ranks = spawn(rw.world, 2, str(tmp_path), timeout=900)
    for rank, out in enumerate(ranks):
        _check_resume(out["dp2"], rank)
        _check_resume(out["pp2"], rank)
        fallback = out["pp2"]["resumed"]["at_start"]["FP8FallbackCallback"]
        assert fallback["fallen"] == [f"stage_of_rank_{rank}"]
    dp = [out["dp2"]["full"]["batches"] for out in ranks]
    assert dp[0] != dp[1], "dp ranks must see different shards"
    seeds = [s for out in ranks for s in out["pp2"]["full"]["worker_seeds"]]
    assert all(isinstance(s, int) for s in seeds), seeds  # pp2 runs 2 loader workers per rank
    pp = [out["pp2"]["full"]["batches"] for out in ranks]
    assert pp[0] == pp[1], "pipeline peers must see the same batches"
    drift = [out["pp2"]["part"]["at_save"]["GradientDriftMonitor"] for out in ranks]
    assert drift[0]["module_ema"] != drift[1]["module_ema"], "stages hold different statistics"
