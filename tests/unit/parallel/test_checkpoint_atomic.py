"""Atomic checkpoint writes: a save killed midway leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.parallel.checkpoint import atomic


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    partial = ckpt.partial_path(path)
    ckpt.remove(partial)
    partial.mkdir(parents=True)
    ckpt.save_sharded(partial, model, [opt], {"step": step}, is_rank_zero=True)
    ckpt.commit(path)


def test_round_trip_restores_model_optimizer_and_metadata(tmp_path: Path) -> None:
    model, opt = _model(0)
    _save(tmp_path / "a.ckpt", model, opt, step=3)
    fresh, fresh_opt = _model(1)
    meta = ckpt.load_sharded(tmp_path / "a.ckpt", fresh, [fresh_opt])
    assert meta["step"] == 3
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    exp_avg = [s["exp_avg"] for s in opt.state.values()]
    got = [s["exp_avg"] for s in fresh_opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, got, strict=True))


def test_crash_between_the_two_renames_falls_back_to_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    model, opt = _model(0)
    _save(path, model, opt, step=1)
    calls = []

    def replace_then_die(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between renames")
        os.rename(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace_then_die)
    newer, newer_opt = _model(5)
    with pytest.raises(KeyboardInterrupt):
        _save(path, newer, newer_opt, step=2)
    monkeypatch.undo()
    assert not path.exists()
    resolved = ckpt.resolve(path)
    fresh, fresh_opt = _model(1)
    assert ckpt.load_sharded(resolved, fresh, [fresh_opt])["step"] == 1
    assert torch.equal(fresh[0].weight, model[0].weight)
    # the next save cleans up and commits normally
    _save(path, newer, newer_opt, step=3)
    assert ckpt.resolve(path) == path and not ckpt.partial_path(path).exists()


KILLED_SAVER = textwrap.dedent(
    """
    import sys, time, torch
    from torch import nn
    from lightning_mmpar.parallel import checkpoint as ckpt
    path = __import__("pathlib").Path(sys.argv[1])
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def save(step):
        partial = ckpt.partial_path(path)
        ckpt.remove(partial)
        partial.mkdir(parents=True)
        ckpt.save_sharded(partial, model, [opt], {"step": step}, is_rank_zero=True)
        ckpt.commit(path)
    save(1)
    torch.save(model.state_dict(), str(path) + ".expected")
    with torch.no_grad():
        model.weight.add_(1.0)
    real_save = torch.save
    def slow_save(*args, **kwargs):  # the shards are written; block before the metadata
        print("saving 2", flush=True)
        time.sleep(60)
        real_save(*args, **kwargs)
    torch.save = slow_save  # the same module object the checkpoint code calls
    save(2)
    """
)


def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "saving 2", line
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert ckpt.partial_path(path).exists(), "the killed save should have left its partial dir"
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = ckpt.load_sharded(ckpt.resolve(path), model, [opt])
    assert meta["step"] == 1
    expected = torch.load(str(path) + ".expected")
    assert torch.equal(model.weight, expected["weight"])
