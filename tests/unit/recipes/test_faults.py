"""The dead-rank report's pieces without a process group: which errors count as a failed
collective, the resume command and the block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_mmpar.recipes.faults import fault_block, is_collective_failure, resume_command


def test_collective_failures_are_told_from_other_errors() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer")
    assert is_collective_failure(gloo)
    assert is_collective_failure(dist.DistBackendError("NCCL watchdog"))
    wrapped = ValueError("while stepping")
    wrapped.__cause__ = gloo
    assert is_collective_failure(wrapped)
    assert not is_collective_failure(RuntimeError("non-finite loss at step 3"))
    assert not is_collective_failure(ValueError("batch_size must be > 0"))
    assert not is_collective_failure(RuntimeError("DataLoader worker timed out"))


def test_resume_command_replaces_the_checkpoint_option() -> None:
    argv = ["fit", "--config", "a b.yaml", "--ckpt_path", "x.ckpt", "--trainer.max_steps=9"]
    want = "lightning_mmpar.recipes.clip_llama fit --config 'a b.yaml' --trainer.max_steps=9"
    assert resume_command(argv, env={}) == f"python -m {want} --ckpt_path auto"
    under = resume_command(["fit", "--ckpt_path=last"], env={"TORCHELASTIC_RUN_ID": "1"})
    assert under.startswith("torchrun <the same torchrun options> -m ")
    assert under.endswith("clip_llama fit --ckpt_path auto")


def test_fault_block_names_rank_host_checkpoint_and_command() -> None:
    table = {0: ("node0", 10), 1: ("node1", 11)}
    block = fault_block(
        {1: "was killed by SIGKILL"},
        table,
        rank=0,
        step=57,
        error="RuntimeError: Connection reset by peer",
        checkpoint=(40, Path("runs/last.ckpt")),
        command="python -m lightning_mmpar.recipes.clip_llama fit --ckpt_path auto",
        log_dir=Path("runs/faults"),
    )
    assert "lightning_mmpar: rank 1 (host node1, pid 11) was killed by SIGKILL." in block
    assert "rank 0 stopped at global step 57: RuntimeError: Connection reset by peer" in block
    assert "last complete checkpoint: runs/last.ckpt (global step 40)" in block
    assert "resume: python -m lightning_mmpar.recipes.clip_llama fit --ckpt_path auto" in block
    assert "tracebacks of every rank: runs/faults/rank_<r>.log" in block
    hung = fault_block(
        {}, table, rank=1, step=None, error="x", checkpoint=None, command="c", log_dir=Path(".")
    )
    assert "every rank answered" in hung and "checkpoint: none" in hung


def test_a_rank_that_raised_is_named_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that ends on its own error (a missing image, not a failed collective) writes it
    before it exits; the reporting rank's block names it and says to fix it before resuming."""
    from types import SimpleNamespace

    from lightning_mmpar.recipes import faults

    trainer = SimpleNamespace(default_root_dir=str(tmp_path))
    monkeypatch.setattr(faults, "_RUN", faults._Run(trainer=trainer, rank=1, world_size=2))
    monkeypatch.setattr(faults.dist, "is_initialized", lambda: True)
    callback = faults.RankFaults()
    callback.on_exception(trainer, None, RuntimeError("gloo: Connection closed by peer"))
    assert not (tmp_path / "faults").exists()  # a failed collective: report_failure's job
    missing = FileNotFoundError(2, "No such file or directory", "images/cat.jpg")
    callback.on_exception(trainer, None, missing)
    assert "FileNotFoundError" in (tmp_path / "faults" / "rank_1.log").read_text()
    raised = faults._raised({1: "exited with code 1"})
    assert raised == {1: "FileNotFoundError: [Errno 2] No such file or directory: 'images/cat.jpg'"}
    block = fault_block(
        {1: "exited with code 1"},
        {0: ("node0", 10), 1: ("node0", 11)},
        rank=0,
        step=3,
        error="RuntimeError: Connection closed by peer",
        checkpoint=None,
        command="python -m lightning_mmpar.recipes.clip_llama fit --ckpt_path auto",
        log_dir=tmp_path / "faults",
        raised=raised,
    )
    assert "rank 1 (host node0, pid 11) exited with code 1." in block
    assert f"rank 1 raised {raised[1]}" in block
    assert "resume, once what rank 1 raised is fixed: python -m" in block
    assert "  resume: " not in block
