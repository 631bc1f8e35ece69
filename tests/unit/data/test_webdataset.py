"""WebDataset shards: split by dp rank x worker, exact resume, bad samples, preprocessing."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import webdataset as wds
from PIL import Image
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mmpar.data.shards import ShardedCaptions
from lightning_mmpar.data.transforms import CLIP_MEAN, ImagePreprocess, clip_transform
from lightning_mmpar.data.webdataset import WebDatasetCaptions

NAMES = ["red", "green", "blue"]


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (value, 255 - value, 7)).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(
    folder: Path, shards: int, per_shard: int, bad: dict[int, dict[str, Any]] | None = None
) -> str:
    """``shards`` tars of ``per_shard`` samples ``"sample <i>"``; ``bad`` replaces fields of
    sample i. Returns the brace pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{s:06d}.tar")) as sink:
            for j in range(per_shard):
                i = s * per_shard + j
                sample = {"__key__": f"{i:06d}", "png": _png(i), "txt": f"sample {i}"}
                sample["cls"] = str(i % len(NAMES))
                sample.update((bad or {}).get(i, {}))
                sink.write({k: v for k, v in sample.items() if v is not None})
    return str(folder / f"{{000000..{shards - 1:06d}}}.tar")


def _fake_trainer(rank: int, world: int, epoch: int = 0) -> Any:
    kwargs = {"rank": rank, "num_replicas": world}
    return SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs), current_epoch=epoch
    )


def _module(pattern: str, rank: int = 0, world: int = 1, **kw: Any) -> WebDatasetCaptions:
    kw = {"image_size": 8, "max_length": 6, "batch_size": 2, **kw}
    dm = WebDatasetCaptions(train_shards=pattern, **kw)
    dm.trainer = _fake_trainer(rank, world)
    dm.setup("fit")
    return dm


def _ids(dm: WebDatasetCaptions, batches: list[dict[str, torch.Tensor]]) -> list[int]:
    out = []
    for batch in batches:
        for row in batch["input_ids"].tolist():
            out.append(int(dm.tokenizer.decode(row).split()[1]))
    return out


def test_split_by_dp_rank_and_worker_covers_every_sample_once(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "even", shards=4, per_shard=4)
    seen = []
    for rank in (0, 1):
        dm = _module(pattern, rank, 2, num_workers=2)
        assert dm.val_dataloader() == []  # no val_shards: no validation (raised "no val data")
        seen.append(_ids(dm, list(dm.train_dataloader())))
    assert len(seen[0]) == len(seen[1]) == 8  # equal batch counts on both dp ranks
    assert sorted(seen[0] + seen[1]) == list(range(16))  # every sample exactly once
    # tp / pp peers (same dp rank, another global rank) read the same samples in the same order
    again = _module(pattern, 1, 2, num_workers=2)
    assert _ids(again, list(again.train_dataloader())) == seen[1]
    # 5 shards for 4 readers: each reader yields the smallest reader's share, ranks stay equal
    uneven = write_shards(tmp_path / "uneven", shards=5, per_shard=4)
    counts = [len(list(_module(uneven, r, 2, num_workers=2).train_dataloader())) for r in (0, 1)]
    assert counts == [4, 4]
    with pytest.raises(ValueError, match=r"3 shards for dp \(2\) x num_workers \(2\) = 4"):
        _module(write_shards(tmp_path / "few", 3, 2), 0, 2, num_workers=2).train_dataloader()


def test_shard_order_is_seeded_per_epoch(tmp_path: Path) -> None:
    dm = _module(write_shards(tmp_path, shards=6, per_shard=2), batch_size=1)
    data = dm.datasets["train"]
    orders = [_ids(dm, list(StatefulDataLoader(data)))]
    data.set_epoch(1)
    orders.append(_ids(dm, list(StatefulDataLoader(data))))
    data.set_epoch(0)
    orders.append(_ids(dm, list(StatefulDataLoader(data))))
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(12))
    assert orders[0] != orders[1] and orders[0] == orders[2]
    dm.trainer = _fake_trainer(0, 1, epoch=1)  # the loader hands the trainer's epoch over
    assert _ids(dm, list(dm.train_dataloader())) == orders[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_with_exactly_the_next_samples(tmp_path: Path, workers: int) -> None:
    bad = {5: {"png": b"not a png"}}
    pattern = write_shards(tmp_path, shards=4, per_shard=6, bad=bad)
    kw = {"num_workers": workers, "on_error": "skip", "batch_size": 2}
    dm = _module(pattern, **kw)
    full = _ids(dm, list(dm.train_dataloader()))
    loader = _module(pattern, **kw).train_dataloader()
    head, it = [], iter(loader)
    for _ in range(3):
        head.append(next(it))
    state = loader.state_dict()
    del it
    resumed = _module(pattern, **kw)
    rest_loader = resumed.train_dataloader()
    rest_loader.load_state_dict(state)
    rest = list(rest_loader)
    assert _ids(dm, head) + _ids(dm, rest) == full
    assert 5 not in full and len(full) == 24  # a stand-in replaces the bad sample
    assert resumed.num_skipped["train"] == 1


def test_bad_samples_raise_or_are_skipped_and_counted(tmp_path: Path) -> None:
    bad = {
        1: {"png": b"garbage"},
        3: {"txt": None},
        4: {"txt": "   "},
        6: {"txt": b"caf\xe9"},
        7: {"cls": "purple"},
    }
    pattern = write_shards(tmp_path, shards=1, per_shard=10, bad=bad)
    kw = {"class_names": NAMES, "batch_size": 10, "shuffle": False}
    with pytest.raises(ValueError, match=r"000000.tar, sample '000001': undecodable png"):
        list(_module(pattern, **kw).train_dataloader())
    dm = _module(pattern, on_error="skip", **kw)
    (batch,) = list(dm.train_dataloader())  # the next samples stand in: the batch stays full
    assert dm.num_skipped == {"train": 5}
    assert _ids(dm, [batch]) == [0, 2, 5, 8, 9, 0, 2, 5, 8, 9]
    assert batch["labels"].tolist() == [i % 3 for i in _ids(dm, [batch])]
    assert dm.class_prompts()["input_ids"].shape == (3, 6)
    assert dm.vocab_size == dm.tokenizer.vocab_size
    with pytest.raises(ValueError, match=r"missing .*nothere.tar"):
        WebDatasetCaptions(train_shards=str(tmp_path / "nothere.tar"))
    with pytest.raises(ValueError, match=r"batch_size \(0\) must be an integer >= 1"):
        WebDatasetCaptions(train_shards=pattern, batch_size=0)


def test_transform_uses_the_given_mean_std_and_open_clip_configs(tmp_path: Path) -> None:
    image = Image.new("RGB", (12, 8), (51, 102, 204))
    rgb = torch.tensor([51, 102, 204]) / 255
    custom = ImagePreprocess(mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0)).transform(8)(image)
    assert custom.shape == (3, 8, 8)
    want = (rgb - 0.5) / torch.tensor([0.25, 0.5, 1.0])
    torch.testing.assert_close(custom[:, 4, 4], want, rtol=0, atol=1e-6)
    default = clip_transform(8)(image)  # open_clip's OpenAI CLIP mean/std
    torch.testing.assert_close(default[0, 4, 4], (rgb[0] - CLIP_MEAN[0]) / 0.26862954)
    # an open_clip model directory: open_clip_config.json's preprocess_cfg and image size
    cfg = {"model_cfg": {"vision_cfg": {"image_size": 8}}, "preprocess_cfg": {"mean": [0.1] * 3}}
    (tmp_path / "open_clip_config.json").write_text(json.dumps(cfg))
    resolved = ImagePreprocess(from_pretrained=str(tmp_path)).resolve(8)
    assert resolved.mean == [0.1] * 3 and resolved.resize_mode == "shortest"
    with pytest.raises(ValueError, match=r"is for 8-pixel images but image_size is 16"):
        ImagePreprocess(from_pretrained=str(tmp_path)).resolve(16)
    siglip = ImagePreprocess(from_pretrained="ViT-B-16-SigLIP:webli").resolve(224)
    assert tuple(siglip.mean) == (0.5, 0.5, 0.5) and siglip.resize_mode == "squash"
    with pytest.raises(ValueError, match=r"std \(\(1.0, 0.0, 1.0\)\) must be 3 numbers"):
        ImagePreprocess(std=(1.0, 0.0, 1.0)).resolve(8)
    with pytest.raises(ValueError, match=r"neither a file, a directory nor an open_clip model"):
        ImagePreprocess(from_pretrained="no-such-model").resolve(8)


def test_sharded_captions_alone(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path, shards=2, per_shard=3)
    dm = _module(pattern)
    data = ShardedCaptions(
        dm.urls["train"], [3, 3], transform=dm.transform, tokenizer=dm.tokenizer, max_length=6
    )
    item = next(iter(data))
    assert item["images"].shape == (3, 8, 8) and item["input_ids"].shape == (6,)
    assert "labels" not in item
