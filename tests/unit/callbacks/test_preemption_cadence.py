"""Pre-emption callback in one process, the newest-complete-checkpoint finder, one
``last.ckpt`` on a step and a time trigger (:class:`PeriodicCheckpoint`), and the CPU recipe's
checkpoint cadence as parsed by jsonargparse (LightningCLI's parser)."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_mmpar.callbacks.periodic_checkpoint import PeriodicCheckpoint
from lightning_mmpar.callbacks.preemption import Preemption
from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.parallel.checkpoint import complete_checkpoints, newest_checkpoint

YAML = Path(__file__).resolve().parents[3] / "recipes" / "clip_llama_cpu.yaml"


class _SignalAt(Callback):
    """Sends ``sig`` to this process at the end of global step ``step``."""

    def __init__(self, step: int, sig: signal.Signals) -> None:
        self.step, self.sig = step, sig

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def _trainer(root: Path, *callbacks: Callback, max_steps: int = 8) -> Trainer:
    return Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
        callbacks=[
            ModelCheckpoint(
                dirpath=root / "ckpts", save_last=True, save_top_k=0, every_n_train_steps=100
            ),
            *callbacks,
        ],
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_last_and_stops_at_that_step(tmp_path: Path, sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    pre = Preemption()
    trainer = _trainer(tmp_path, _SignalAt(3, sig), pre)
    trainer.fit(BoringModel())
    assert trainer.global_step == 3 and pre.stopped_at == 3 and pre.received == sig
    assert pre.saved_path == tmp_path / "ckpts" / "last.ckpt" and pre.saved_path.is_file()
    assert torch.load(pre.saved_path, weights_only=False)["global_step"] == 3
    assert signal.getsignal(sig) == before  # handlers restored when training ends
    resumed = _trainer(tmp_path, Preemption())
    model = BoringModel()
    resumed.fit(model, ckpt_path="last")
    assert resumed.global_step == 8  # went on from step 3 to max_steps


def test_no_signal_no_save_and_check_every(tmp_path: Path) -> None:
    pre = Preemption(check_every_n_steps=4)
    trainer = _trainer(tmp_path, _SignalAt(5, signal.SIGTERM), pre, max_steps=12)
    trainer.fit(BoringModel())
    assert pre.stopped_at == 8 and trainer.global_step == 8  # first agreed step after 5
    pre = Preemption()
    _trainer(tmp_path / "b", pre, max_steps=3).fit(BoringModel())
    assert pre.saved_path is None and pre.stopped_at == -1


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int = 0) -> Path:
    """An ``scontrol`` first on the PATH that records its arguments and exits ``code``."""
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.args"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {record}\necho refused by test\nexit {code}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def test_requeue_runs_scontrol_after_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    pre = Preemption(requeue=True)
    _trainer(tmp_path, _SignalAt(2, signal.SIGUSR1), pre).fit(BoringModel())
    assert pre.stopped_at == 2 and pre.saved_path is not None and pre.saved_path.is_file()
    assert pre.requeued == "4242" and record.read_text() == "requeue 4242\n"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")  # an array task: <array job>_<task>
    pre = Preemption(requeue=True)
    _trainer(tmp_path / "array", _SignalAt(1, signal.SIGTERM), pre).fit(BoringModel())
    assert pre.requeued == "77_3" and record.read_text().splitlines()[-1] == "requeue 77_3"


def test_requeue_refused_without_slurm_and_failures_surface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"requeue=True.*SLURM_JOB_ID is not set"):
        _trainer(tmp_path / "a", Preemption(requeue=True)).fit(BoringModel())
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"no scontrol on the PATH"):
        _trainer(tmp_path / "b", Preemption(requeue=True)).fit(BoringModel())
    _fake_scontrol(tmp_path, monkeypatch, code=1)
    pre = Preemption(requeue=True)
    with pytest.raises(RuntimeError, match=r"scontrol requeue 9 failed \(exit 1\): refused"):
        _trainer(tmp_path / "c", _SignalAt(1, signal.SIGTERM), pre).fit(BoringModel())
    assert pre.saved_path is not None and pre.saved_path.is_file()  # saved before requeueing


def test_refuses_unknown_signals_and_bad_cadence() -> None:
    with pytest.raises(ValueError, match=r"signals=\['SIGKILL'\].*use some of"):
        Preemption(signals=["SIGKILL"])
    with pytest.raises(ValueError, match=r"check_every_n_steps=0"):
        Preemption(check_every_n_steps=0)


def _save(path: Path, step: int, commit: bool = True) -> None:
    partial = ckpt.partial_path(path)
    partial.mkdir(parents=True)
    model: LightningModule | nn.Module = nn.Linear(2, 2)
    ckpt.save_sharded(partial, model, [], {"global_step": step}, is_rank_zero=True)
    if commit:
        ckpt.commit(path)


def test_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path / "missing") is None
    _save(tmp_path / "v0" / "checkpoints" / "last.ckpt", 40)
    _save(tmp_path / "v1" / "checkpoints" / "last.ckpt", 60)
    _save(tmp_path / "v1" / "checkpoints" / "step=90.ckpt", 90, commit=False)  # cut short
    assert newest_checkpoint(tmp_path) == tmp_path / "v1" / "checkpoints" / "last.ckpt"
    damaged = tmp_path / "v2" / "last.ckpt"
    _save(damaged, 80)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # truncated: not complete
    assert [s for s, _, _ in complete_checkpoints(tmp_path)] == [40, 60]
    previous = tmp_path / "v3" / "last.ckpt.previous"  # a commit stopped between its renames
    _save(previous, 70)
    assert newest_checkpoint(tmp_path) == previous
    _save(tmp_path / "v3" / "last.ckpt", 75)  # once its last.ckpt exists, .previous is stale
    assert newest_checkpoint(tmp_path) == tmp_path / "v3" / "last.ckpt"


def test_cpu_recipe_cadence_parses_to_lightning_triggers() -> None:
    trainer = yaml.safe_load(YAML.read_text())["trainer"]
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    parser.add_argument("--timeout", type=timedelta)
    cfg = parser.parse_object(
        {"callbacks": trainer["callbacks"], "timeout": trainer["strategy"]["init_args"]["timeout"]}
    )
    init = parser.instantiate_classes(cfg)
    checkpoints = [c for c in init.callbacks if isinstance(c, ModelCheckpoint)]
    assert len(checkpoints) == 1, checkpoints  # two with save_last wrote last-v1.ckpt
    assert isinstance(checkpoints[0], PeriodicCheckpoint) and checkpoints[0].save_last
    assert checkpoints[0]._every_n_train_steps == 100
    assert checkpoints[0]._train_time_interval == timedelta(minutes=2)
    assert [type(c) for c in init.callbacks].count(Preemption) == 1
    assert init.timeout == timedelta(minutes=5)


class _SavedAt(Callback):
    """The global steps at which a checkpoint was written."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize(
    ("interval", "want"), [(timedelta(hours=1), [3, 6]), (timedelta(0), [1, 2, 3, 4, 5, 6, 7])]
)
def test_periodic_checkpoint_keeps_one_last_on_both_triggers(
    tmp_path: Path, interval: timedelta, want: list[int]
) -> None:
    saved = _SavedAt()
    periodic = PeriodicCheckpoint(
        dirpath=tmp_path,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=3,
        train_time_interval=interval,
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=7,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
        callbacks=[periodic, saved],
    )
    trainer.fit(BoringModel())
    assert saved.steps == want  # the step trigger alone, or the time trigger every step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    with pytest.raises(ValueError, match="every_n_train_steps=-1"):
        PeriodicCheckpoint(every_n_train_steps=-1)
    with pytest.raises(ValueError, match="every_n_epochs"):
        PeriodicCheckpoint(every_n_epochs=1)
