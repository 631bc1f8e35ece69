"""``WebDatasetCaptions``: sharded image-caption tar archives (WebDataset layout) as a
LightningDataModule, read with the ``webdataset`` library (see :mod:`lightning_mmpar.data.shards`
for the split by dp rank and worker, bad samples and the resumable position).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mmpar.data.caption_files import OnError, _check_config
from lightning_mmpar.data.shards import (
    ShardedCaptions,
    bad_in_state,
    decode_sample,
    expand_shards,
    raw_samples,
    shard_sizes,
)
from lightning_mmpar.data.text import CaptionTokenizer, ClassPrompts, check_classes
from lightning_mmpar.data.tokenizer import WordTokenizer
from lightning_mmpar.data.transforms import ImagePreprocess

__all__ = ["WebDatasetCaptions"]


class _EpochLoader(StatefulDataLoader):  # type: ignore[misc]
    """A StatefulDataLoader that hands its iterable dataset the trainer's epoch before each
    iteration (Lightning calls ``set_epoch`` on samplers only; an iterable dataset has none)."""

    epoch_of: Any = None
    bad_seen: int = 0
    """Bad samples skipped by this rank's readers so far in the current (or last) epoch."""

    def __iter__(self) -> Any:
        if self.epoch_of is not None:
            self.dataset.set_epoch(self.epoch_of())
        inner = super().__iter__()

        def counted() -> Iterator[Any]:  # the readers' counts live in their (worker) states
            for batch in inner:
                self.bad_seen = bad_in_state(inner.state_dict())
                yield batch

        return counted()


class WebDatasetCaptions(ClassPrompts, pl.LightningDataModule):
    """Image-caption WebDataset shards; items as in :class:`~lightning_mmpar.data.CaptionsDataset`.

    Args:
        train_shards: tar files, e.g. ``"data/train-{000000..000031}.tar"`` (brace ranges, or a
            list); at least ``dp * max(1, num_workers)`` shards.
        val_shards: validation tars (read in order, not shuffled); None: no validation.
        image_size: side S of the square images; ``preprocess`` sets resize/mean/std
            (:class:`~lightning_mmpar.data.transforms.ImagePreprocess`, open_clip's defaults or
            the vision tower's config).
        max_length: token length T; ``batch_size``: samples per batch and dp rank.
        num_workers: DataLoader workers per rank (each reads its own shards).
        on_error: ``"raise"`` at a bad sample, or ``"skip"``: logged, counted
            (:attr:`num_skipped`), the next sample stands in.
        shuffle: permute the training shards every epoch (seeded by ``seed + epoch``).
        caption_key: caption field of ``.json`` sample files (``.txt`` files are the caption).
        tokenizer: any :class:`~lightning_mmpar.data.text.CaptionTokenizer`; else loaded from
            ``tokenizer_dir``; else a :class:`WordTokenizer` built from the captions of the first
            ``vocab_samples`` training samples and the class prompts (``min_count``,
            ``max_vocab``).
        class_names: labels (index = label) read from each sample's ``.cls``;
            ``prompt_template`` (with ``{name}``) gives the zero-shot prompts.

    Raises:
        ValueError: a bad field (named, with the fix), missing shards, or fewer shards than
            readers (at ``train_dataloader``).
    """

    def __init__(
        self,
        *,
        train_shards: str | list[str],
        val_shards: str | list[str] | None = None,
        image_size: int = 224,
        max_length: int = 32,
        batch_size: int = 32,
        num_workers: int = 0,
        on_error: OnError = "raise",
        shuffle: bool = True,
        seed: int = 0,
        caption_key: str = "caption",
        tokenizer: CaptionTokenizer | None = None,
        tokenizer_dir: str | None = None,
        vocab_samples: int = 10000,
        min_count: int = 1,
        max_vocab: int | None = None,
        class_names: Sequence[str] | None = None,
        prompt_template: str = "a photo of a {name}",
        preprocess: ImagePreprocess | None = None,
    ) -> None:
        super().__init__()
        limits = {"image_size": image_size, "max_length": max_length, "batch_size": batch_size}
        limits |= {"num_workers": num_workers} | ({"max_vocab": max_vocab} if max_vocab else {})
        _check_config("WebDatasetCaptions", on_error, **limits)
        if vocab_samples < 1:
            raise ValueError(f"WebDatasetCaptions: vocab_samples ({vocab_samples}) must be >= 1.")
        self.class_names = check_classes("WebDatasetCaptions", class_names, prompt_template)
        self.prompt_template, self.caption_key = prompt_template, caption_key
        self.urls = {"train": expand_shards(train_shards)}
        if val_shards is not None:
            self.urls["val"] = expand_shards(val_shards)
        self.image_size, self.max_length, self.batch_size = image_size, max_length, batch_size
        self.num_workers, self.on_error, self.shuffle, self.seed = (
            num_workers,
            on_error,
            shuffle,
            seed,
        )
        self.vocab_samples, self.min_count, self.max_vocab = vocab_samples, min_count, max_vocab
        self.preprocess = preprocess or ImagePreprocess()
        self.transform = self.preprocess.transform(image_size)
        self.tokenizer = tokenizer or (WordTokenizer.load(tokenizer_dir) if tokenizer_dir else None)
        self.datasets: dict[str, ShardedCaptions] = {}
        self.loaders: dict[str, _EpochLoader] = {}

    def _ensure_tokenizer(self) -> Any:
        """The tokenizer; a WordTokenizer of the first ``vocab_samples`` captions if none."""
        if self.tokenizer is None:
            captions: list[str] = []
            for url in self.urls["train"]:
                for raw in raw_samples(url):
                    if len(captions) >= self.vocab_samples:
                        break
                    decoded = decode_sample(raw, self.caption_key, ())
                    if not isinstance(decoded, str):
                        captions.append(decoded[1])
            prompts = [self.prompt_template.format(name=n) for n in self.class_names]
            self.tokenizer = WordTokenizer.build(
                captions + prompts, min_count=self.min_count, max_size=self.max_vocab
            )
        return self.tokenizer

    def dp_rank_and_size(self) -> tuple[int, int]:
        """``(dp rank, dp size)`` from the strategy's ``distributed_sampler_kwargs`` (the dp
        group under ``mm_parallel``: tp/pp peers read the same samples); ``(0, 1)`` without a
        trainer or on one device."""
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def setup(self, stage: str | None = None) -> None:
        """Size the shards and build the per-rank datasets (idempotent)."""
        rank, world = self.dp_rank_and_size()
        tokenizer = self._ensure_tokenizer()
        for split, urls in self.urls.items():
            if split in self.datasets:  # the rank may be known only now (vocab_size came first)
                self.datasets[split].rank, self.datasets[split].world = rank, world
                continue
            self.datasets[split] = ShardedCaptions(
                urls,
                shard_sizes(urls),
                transform=self.transform,
                tokenizer=tokenizer,
                max_length=self.max_length,
                rank=rank,
                world=world,
                shuffle=self.shuffle and split == "train",
                seed=self.seed,
                on_error=self.on_error,
                caption_key=self.caption_key,
                class_names=self.class_names,
            )

    def _loader(self, split: str, train: bool) -> DataLoader[dict[str, torch.Tensor]]:
        if split not in self.datasets:
            raise ValueError(f"no {split} data: call setup() first, or pass {split}_shards.")
        dataset = self.datasets[split]
        dataset.workers, dataset.batch_size = max(1, self.num_workers), self.batch_size
        dataset.drop_last = train
        dataset.plan(0, dataset.workers)  # enough shards for every reader, or raise
        loader = _EpochLoader(
            dataset, batch_size=self.batch_size, drop_last=train, num_workers=self.num_workers
        )
        if self.trainer is not None:
            trainer = self.trainer
            loader.epoch_of = lambda: trainer.current_epoch
        self.loaders[split] = loader
        return loader

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """This dp rank's share, shards shuffled per epoch, last partial batch per worker
        dropped; a torchdata ``StatefulDataLoader`` whose state Lightning checkpoints."""
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]] | list[Any]:
        """This dp rank's share of the validation shards, in order; ``[]`` without
        ``val_shards`` (no validation: Lightning skips the loop)."""
        return self._loader("val", False) if "val" in self.urls else []

    def predict_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """As :meth:`val_dataloader` (``predict`` captions the validation images)."""
        return self._loader("val", False)

    @property
    def num_skipped(self) -> dict[str, int]:
        """Bad samples skipped per split by this rank's readers in the current (or last) epoch
        (read from the readers' states, which live in the DataLoader workers)."""
        return {split: loader.bad_seen for split, loader in self.loaders.items()}
