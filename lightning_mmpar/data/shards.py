"""Image-caption samples from WebDataset tar shards, split by dp rank and DataLoader worker,
with a position a resumed run continues from exactly.

Files (WebDataset's): each sample is the files of one key in a tar, ``<key>.jpg`` / ``.jpeg`` /
``.png`` / ``.webp`` and ``<key>.txt`` (or ``<key>.json`` holding ``{"caption": ...}``), plus
``<key>.cls`` (a class index or name) when the data has labels. Tars are read by the
``webdataset`` library (``tarfile_samples``) and decoded by its ``autodecode.Decoder``.

**Split.** Each epoch orders the shards (a permutation seeded by ``seed + epoch`` when shuffling;
samples inside a shard keep their order, WebDataset shards being shuffled when written) and deals
them round-robin to the ``dp * num_workers`` readers (reader ``rank * num_workers + worker``), so
tensor- and pipeline-parallel peers (same dp rank) read the same samples and every sample is read
by one reader. Every reader yields the same number of samples in every epoch, the total of the
``len(shards) // readers`` smallest shards (open_clip sizes an epoch from ``sizes.json``
too), so every dp rank has the same, known number of batches (collectives would otherwise hang
at the epoch's end; all samples are read once when the shards are equal and divide evenly).

**Bad samples** (no image or caption, an image PIL cannot decode, a caption that is empty or not
UTF-8, an unknown label) raise ``ValueError`` naming shard, key and fix under
``on_error="raise"``; under ``"skip"`` they are logged, counted (``bad`` in the state) and the
reader's next sample stands in (wrapping round its shards), so batch counts stay equal.

**Resume.** The iterator is ``Stateful``: ``{"epoch", "consumed", "yielded", "bad"}``. torchdata's
``StatefulDataLoader`` saves it per worker and Lightning stores that in checkpoints; after
``load_state_dict`` the reader skips ``consumed`` raw samples (whole shards by their sizes,
without decoding) and yields exactly the samples an uninterrupted run would have yielded next.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from lightning_mmpar.data.text import parse_label

log = logging.getLogger(__name__)
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
"""Image extensions of a sample, in order of preference."""
STATE_MARK = "webdataset_captions"
"""Key that marks this reader's state inside a DataLoader state dict."""
_DECODER = wds.autodecode.Decoder([wds.autodecode.imagehandler("pil")])


def expand_shards(shards: str | Sequence[str]) -> list[str]:
    """Shard paths of ``"dir/shard-{000000..000009}.tar"`` (brace ranges, ``::`` joins) or a
    list of such patterns, in order.

    Raises:
        ValueError: no shard, or a path that is not a file.
    """
    patterns = [shards] if isinstance(shards, str) else list(shards)
    urls = [url for p in patterns for url in wds.shardlists.expand_urls(p)]
    missing = [u for u in urls if not Path(u).is_file()]
    if not urls or missing:
        raise ValueError(
            f"shards {shards!r}: {'no shard given' if not urls else f'missing {missing[:3]}'}; "
            "pass tar files, e.g. 'data/shard-{000000..000009}.tar'."
        )
    return urls


def raw_samples(url: str) -> Iterator[dict[str, Any]]:
    """Undecoded samples (``__key__``, ``__url__`` and one bytes entry per extension) of a shard,
    in tar order, read by webdataset."""
    yield from wds.tarfile_samples([{"url": url}])


def shard_sizes(urls: Sequence[str]) -> list[int]:
    """Samples per shard: from ``sizes.json`` next to the shards (open_clip's
    ``{"shard.tar": n}``) when it lists them all, else counted (tar headers read, nothing
    decoded)."""
    sizes: dict[str, int] = {}
    for folder in {Path(u).parent for u in urls}:
        listing = folder / "sizes.json"
        if listing.is_file():
            sizes.update(
                {str(folder / k): int(v) for k, v in json.loads(listing.read_text()).items()}
            )
    return [sizes[u] if u in sizes else sum(1 for _ in raw_samples(u)) for u in urls]


def decode_sample(
    raw: dict[str, Any], caption_key: str, class_names: Sequence[str]
) -> tuple[Image.Image, str, int] | str:
    """``(RGB image, caption, label)`` of a raw sample (label -1 without ``class_names``), or
    the reason it cannot be used."""
    image_key = next((k for k in IMAGE_KEYS if k in raw), None)
    text_key = "txt" if "txt" in raw else "json" if "json" in raw else None
    if image_key is None or text_key is None:
        return (
            f"no {'image (.jpg/.jpeg/.png/.webp)' if image_key is None else 'caption (.txt/.json)'}"
        )
    wanted = [image_key, text_key] + (["cls"] if class_names else [])
    try:
        sample = _DECODER({k: raw[k] for k in wanted if k in raw})
        image = sample[image_key].convert("RGB")
    except Exception as err:  # PIL / UTF-8 / JSON errors: a fault of this sample only
        return f"undecodable {image_key}/{text_key} ({type(err).__name__}: {err})"
    caption = sample[text_key]
    if text_key == "json":
        caption = caption.get(caption_key) if isinstance(caption, dict) else None
    if not isinstance(caption, str) or not caption.strip():
        return f"empty caption (got {caption!r})"
    if not class_names:
        return image, caption.strip(), -1
    label = parse_label(sample.get("cls", ""), class_names)
    return (image, caption.strip(), label) if isinstance(label, int) else f".cls: {label}"


class ShardedCaptions(IterableDataset[dict[str, torch.Tensor]]):
    """Samples ``{"images": [3, S, S], "input_ids" / "attention_mask" / "target_ids": [T],
    "labels": 0-d (with class_names)}`` of this dp rank's share of ``urls``.

    Args:
        urls: shard files (:func:`expand_shards`); ``sizes`` their sample counts.
        transform: PIL image -> ``[3, S, S]`` tensor.
        tokenizer: a :class:`~lightning_mmpar.data.text.CaptionTokenizer`; ``max_length`` T.
        rank, world: this dp rank and the dp size (not the global rank: tp/pp peers share data).
        shuffle: permute the shards every epoch (seed ``seed + epoch``).
        on_error: ``"raise"`` or ``"skip"`` (see the module doc).
        caption_key: caption field of ``.json`` files; ``class_names``: labels from ``.cls``.
    """

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Sequence[int],
        *,
        transform: Callable[[Image.Image], torch.Tensor],
        tokenizer: Any,
        max_length: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        on_error: str = "raise",
        caption_key: str = "caption",
        class_names: Sequence[str] = (),
    ) -> None:
        self.urls, self.sizes = list(urls), list(sizes)
        self.transform, self.tokenizer, self.max_length = transform, tokenizer, max_length
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, seed
        self.on_error, self.caption_key, self.class_names = on_error, caption_key, class_names
        self.epoch = 0
        self.workers, self.batch_size, self.drop_last = 1, 1, False
        """DataLoader workers, batch size and drop_last of the loader (for :meth:`__len__`)."""

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose shard order the next iterator reads."""
        self.epoch = epoch

    def plan(self, epoch: int, workers: int) -> tuple[list[list[int]], int]:
        """Shard indices of each reader (``rank * workers + worker``) in ``epoch`` and the
        samples every reader yields: the ``len(urls) // readers`` smallest shards' total, a
        share every reader has in every epoch (so the epoch length is fixed: all samples once
        when the shards are equal and divide evenly).

        Raises:
            ValueError: fewer shards than readers.
        """
        readers = self.world * workers
        if len(self.urls) < readers:
            raise ValueError(
                f"WebDatasetCaptions: {len(self.urls)} shards for dp ({self.world}) x "
                f"num_workers ({workers}) = {readers} readers; every reader needs a shard: "
                "write more, smaller shards or lower num_workers."
            )
        order = list(range(len(self.urls)))
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.urls), generator=gen).tolist()
        dealt = [order[r::readers] for r in range(readers)]
        return dealt, sum(sorted(self.sizes)[: len(self.urls) // readers])

    def __len__(self) -> int:
        """Samples per dp rank, reported so that ``len(DataLoader)`` is the exact batch count
        (``workers`` readers each batch their own ``quota``): Lightning then knows the epoch
        length and does not prefetch a batch past a checkpoint (an unsized loader's saved
        position would be one batch ahead)."""
        quota, batch = self.plan(self.epoch, self.workers)[1], self.batch_size
        if self.drop_last:
            return self.workers * (quota // batch) * batch
        batches = self.workers * -(-quota // batch)
        return max(0, (batches - 1) * batch + 1)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return CaptionStream(self, self.rank * workers + worker, workers, self.epoch)

    def decode(self, raw: dict[str, Any]) -> dict[str, Any] | str:
        """The training item of a raw sample, or the reason it cannot be used."""
        decoded = decode_sample(raw, self.caption_key, self.class_names)
        return decoded if isinstance(decoded, str) else self.make_item(*decoded)

    def make_item(self, image: Image.Image, caption: str, label: int) -> dict[str, torch.Tensor]:
        """The training item of a decoded sample."""
        text = self.tokenizer([caption], self.max_length)
        item = {"images": self.transform(image), **{k: v[0] for k, v in text.items()}}
        if self.class_names:
            item["labels"] = torch.tensor(label, dtype=torch.long)
        return item


class CaptionStream(Iterator[dict[str, Any]]):
    """One reader's samples of one epoch; ``Stateful`` (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, data: ShardedCaptions, reader: int, workers: int, epoch: int) -> None:
        self.data, self.reader, self.workers = data, reader, workers
        self.consumed = self.yielded = self.bad = 0
        self._set_epoch(epoch)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        dealt, self.quota = self.data.plan(epoch, self.workers)
        self.shards = dealt[self.reader]
        self.total = sum(self.data.sizes[i] for i in self.shards)
        self._raw: Iterator[tuple[str, dict[str, Any]]] | None = None

    def _raw_from(self, start: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(shard, raw sample)`` cycling over this reader's shards from position ``start``."""
        skip = start % self.total
        while True:
            for index in self.shards:
                url, size = self.data.urls[index], self.data.sizes[index]
                if skip >= size:  # a whole shard before the resume point: not even opened
                    skip -= size
                    continue
                for n, raw in enumerate(raw_samples(url)):
                    if n >= skip:
                        yield url, raw
                skip = 0

    def __next__(self) -> dict[str, Any]:
        if self.yielded >= self.quota:
            raise StopIteration
        if self._raw is None:
            self._raw = self._raw_from(self.consumed)
        for _ in range(self.total):
            url, raw = next(self._raw)
            self.consumed += 1
            decoded = self.data.decode(raw)
            if not isinstance(decoded, str):
                self.yielded += 1
                return decoded
            where = f"{url}, sample {raw.get('__key__')!r}"
            if self.data.on_error == "raise":
                raise ValueError(
                    f"{where}: {decoded}; fix or remove the sample, or pass on_error='skip'."
                )
            if self.consumed <= self.total:  # counted and logged once, not again when wrapping
                self.bad += 1
                log.warning("%s: %s; skipped (%d so far by this reader)", where, decoded, self.bad)
        raise ValueError(f"shards {[self.data.urls[i] for i in self.shards]}: no usable sample.")

    def state_dict(self) -> dict[str, Any]:
        """Where this reader stands: epoch, raw samples consumed, samples yielded, bad ones."""
        keys = ("epoch", "consumed", "yielded", "bad")
        return {STATE_MARK: True, **{k: getattr(self, k) for k in keys}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (the next sample is the one after its position)."""
        self._set_epoch(int(state["epoch"]))
        self.consumed, self.yielded, self.bad = (
            int(state[k]) for k in ("consumed", "yielded", "bad")
        )


def bad_in_state(state: Any) -> int:
    """Bad samples counted by the readers whose states are inside a DataLoader's state dict."""
    if isinstance(state, dict):
        if state.get(STATE_MARK):
            return int(state["bad"])
        return sum(bad_in_state(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(bad_in_state(v) for v in state)
    return 0
