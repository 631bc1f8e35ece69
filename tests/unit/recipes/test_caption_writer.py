"""``CaptionWriter``'s files: one JSONL per rank, an earlier larger world's files removed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from lightning_mmpar.recipes.caption_writer import CaptionWriter


def test_rank0_replaces_its_file_and_removes_ranks_this_world_lacks(tmp_path: Path) -> None:
    for rank in range(4):  # a 4-process predict ran here before
        (tmp_path / f"captions.rank{rank}.jsonl").write_text('{"old": true}\n')
    (tmp_path / "captions.rankX.jsonl").write_text("not ours\n")
    writer = CaptionWriter(str(tmp_path))
    rows = [
        {"caption": "a handwritten 3", "digit": 3, "label": 3},
        {"caption": "a handwritten", "digit": None, "label": 5},
    ]
    writer.write_on_batch_end(None, None, rows, None, None, 0, 0)  # type: ignore[arg-type]
    trainer = SimpleNamespace(global_rank=0, world_size=2, default_root_dir=str(tmp_path))
    writer.on_predict_epoch_end(trainer, None)  # type: ignore[arg-type]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["captions.rank0.jsonl", "captions.rank1.jsonl", "captions.rankX.jsonl"]
    got = [json.loads(x) for x in (tmp_path / "captions.rank0.jsonl").read_text().splitlines()]
    assert got == rows and writer.accuracy == 0.5
