"""Damaged or mismatched checkpoints fail with errors that name the file or the setting (issue 15
item 7), before DCP's raw errors (``metadata is None``, an unpickler error advising
``weights_only=False``, ``Missing key ... logit_scale``).

One real checkpoint of a small module (``save_sharded`` without a process group) is damaged in
each way; the recipe's module checks the hyper-parameters and keys of a model with one decoder
layer fewer. No process group, no Trainer.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mmpar.models.fusion import FusionConfig
from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.parallel.checkpoint import check
from lightning_mmpar.recipes.module import ClipLlamaModule
from tests.builders import tiny_fusion_config

SHARD = "__0_0.distcp"


def _mlp(width: int = 16, depth: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, width)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "last.ckpt"
    path.mkdir()
    model, opt = _mlp()
    ckpt.save_sharded(path, model, [opt], {"step": 1}, is_rank_zero=True)
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    path = tmp_path / "last.ckpt"
    shutil.copytree(saved, path)
    return path


def _load(path: Path, width: int = 16, depth: int = 2) -> dict[str, Any]:
    model, opt = _mlp(width, depth)
    return ckpt.load_sharded(path, model, [opt])


def _fails(exc: type[Exception], pattern: str, fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(exc, match=pattern) as info:
        fn(*args)
    message = str(info.value)
    assert "weights_only=False" not in message, message
    error = info.value
    assert error.__cause__ is None, "no raw torch error chained"
    assert error.__context__ is None or error.__suppress_context__, "no raw torch error shown"
    return message


def test_intact_checkpoint_validates_and_loads(saved: Path) -> None:
    assert ckpt.validate_checkpoint(str(saved)) == saved
    assert _load(saved)["step"] == 1


def test_truncated_shard_named_with_sizes(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    os.truncate(path / SHARD, 5000)
    for fn in (_load, ckpt.validate_checkpoint):  # the load path validates first
        msg = _fails(ValueError, "truncated shard", fn, path)
        assert re.search(rf"{re.escape(str(path / SHARD))}' has 5000 bytes, .* at least \d+", msg)


def test_zero_filled_shard_named_never_weights_only(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    shard = path / SHARD
    shard.write_bytes(bytes(shard.stat().st_size))
    assert ckpt.validate_checkpoint(path) == path  # sizes are right: only a read finds it
    msg = _fails(ValueError, "is damaged", _load, path)
    assert f"{str(shard)!r} (60 item(s), e.g. " in msg, msg  # every item of the zeroed file
    assert check.damaged_files(saved, check.inspect_checkpoint(saved).dcp) == {}


def test_missing_or_garbled_dcp_metadata(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / ".metadata").write_bytes(b"garbage" * 9)
    for fn in (_load, ckpt.validate_checkpoint):
        msg = _fails(ValueError, "is unreadable", fn, path)
        assert str(path / ".metadata") in msg and "damaged" in msg
    (path / ".metadata").unlink()
    for fn in (_load, ckpt.validate_checkpoint):
        msg = _fails(FileNotFoundError, "is missing", fn, path)
        assert str(path / ".metadata") in msg and "not a complete checkpoint" in msg


def test_missing_meta_pt_and_shard_file(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / ckpt.METADATA_FILE).write_bytes(b"\0" * 64)
    _fails(ValueError, re.escape(f"{str(path / 'meta.pt')!r} is unreadable"), _load, path)
    (path / ckpt.METADATA_FILE).unlink()
    msg = _fails(FileNotFoundError, "meta.pt' is missing", ckpt.validate_checkpoint, path)
    assert str(path) in msg
    (path / SHARD).unlink()
    msg = _fails(FileNotFoundError, f"lacks shard file.*{SHARD}", _load, path)


def test_folder_of_checkpoints_names_candidates(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    shutil.copytree(saved, tmp_path / "epoch=0-step=5.ckpt")
    for fn in (_load, ckpt.validate_checkpoint):
        msg = _fails(ValueError, "folder of checkpoints", fn, tmp_path)
        assert "'epoch=0-step=5.ckpt', 'last.ckpt'" in msg or "epoch=0-step=5.ckpt, last" in msg
        assert str(path) in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(FileNotFoundError, "not a complete checkpoint", ckpt.validate_checkpoint, empty)


def test_single_file_checkpoint_says_directories(tmp_path: Path) -> None:
    file = tmp_path / "model.ckpt"
    torch.save({"state_dict": _mlp()[0].state_dict()}, file)
    for fn in (_load, ckpt.validate_checkpoint):
        msg = _fails(ValueError, "is a single file", fn, file)
        assert str(file) in msg and "are directories" in msg and "ModelCheckpoint" in msg
    _fails(FileNotFoundError, "does not exist", ckpt.validate_checkpoint, tmp_path / "none")


def test_other_width_and_depth_list_shapes_and_keys(saved: Path) -> None:
    msg = _fails(ValueError, "does not fit this model", _load, saved, 32)
    assert "2 model shape mismatch(es)" in msg or "4 model shape mismatch(es)" in msg, msg
    assert "state_dict.0.weight (checkpoint [16, 8], this run [32, 8])" in msg
    msg = _fails(ValueError, "does not fit this model", _load, saved, 16, 3)
    assert (
        "2 model key(s) missing from the checkpoint: state_dict.4.weight, state_dict.4.bias" in msg
    )
    # a model with a layer fewer loads (a pipeline rank holds part of the model), the rest of
    # the checkpoint is unused
    assert _load(saved, 16, 1)["step"] == 1


def _fusion(layers: int, hidden: int = 32) -> FusionConfig:
    return tiny_fusion_config(
        language__vocab_size=64,
        language__hidden_size=hidden,
        language__num_hidden_layers=layers,
    )


def _recipe(layers: int, hidden: int = 32, lr: float = 1e-3) -> ClipLlamaModule:
    from lightning_mmpar.recipes.options import OptimConfig

    module = ClipLlamaModule(fusion=_fusion(layers, hidden), optim=OptimConfig(lr=lr))
    module.configure_model()
    return module


def test_recipe_one_decoder_layer_fewer_names_the_field(tmp_path: Path) -> None:
    old = _recipe(layers=1)
    assert old.hparams["fusion"] == _fusion(1), "save_hyperparameters keeps the dataclasses"
    path = tmp_path / "last.ckpt"
    path.mkdir()
    meta = {"step": 1, "hyper_parameters": dict(old.hparams)}
    ckpt.save_sharded(path, old, [], meta, is_rank_zero=True)
    # Lightning's single-file checkpoints load with weights_only=True: the configs are allowed
    assert torch.load(path / "meta.pt", weights_only=True)["hyper_parameters"] == old.hparams
    new = _recipe(layers=2)
    field = "fusion.language.num_hidden_layers: checkpoint 1, this run 2"
    msg = _fails(ValueError, "other hyper-parameters", ckpt.validate_checkpoint, path, new.hparams)
    assert field in msg and "lr" not in msg, msg
    msg = _fails(ValueError, "does not fit this model", ckpt.load_sharded, path, new, [])
    assert "model key(s) missing from the checkpoint" in msg and field in msg, msg
    # another learning rate: an error unless ignored, and no obstacle to loading
    other_lr = _recipe(layers=1, lr=5e-4)
    lr_diff = "optim.lr: checkpoint 0.001, this run 0.0005"
    _fails(ValueError, lr_diff, ckpt.validate_checkpoint, path, other_lr.hparams)
    assert ckpt.validate_checkpoint(path, other_lr.hparams, ignore=("optim",)) == path
    assert ckpt.load_sharded(path, other_lr, [])["step"] == 1
    for a, b in zip(old.parameters(), other_lr.parameters(), strict=True):
        assert torch.equal(a, b)
    wider = _recipe(layers=1, hidden=64)
    msg = _fails(ValueError, "shape mismatch", ckpt.load_sharded, path, wider, [])
    assert "fusion.language.hidden_size: checkpoint 32, this run 64" in msg, msg
