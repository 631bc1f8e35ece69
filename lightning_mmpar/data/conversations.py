"""``ConversationDataModule``: LLaVA-format conversations (a JSON file and an image folder, or
WebDataset shards) with 0..N images per sample, padded or packed into ragged batches.

Samples come from :mod:`lightning_mmpar.data.llava` (JSON) or
:mod:`lightning_mmpar.data.conversation_shards` (tar shards), tokenised by
:class:`~lightning_mmpar.data.chat.ChatEncoder` (the tokenizer's chat template when it has one,
labels on the assistant turns only); :class:`~lightning_mmpar.data.packing.MultimodalCollator`
turns them into batches (``pack: true``: several samples per row up to ``max_tokens``).
:class:`RaggedDataModule` is what this module and the digits question-answering task
(:mod:`lightning_mmpar.data.digits_vqa`) share: the collator and the loaders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_mmpar.data.chat import IMAGE_MARKER, ChatEncoder
from lightning_mmpar.data.conversation_shards import ShardedConversations
from lightning_mmpar.data.hf_tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from lightning_mmpar.data.llava import ConversationDataset, ConversationRecord, read_conversations
from lightning_mmpar.data.packing import MultimodalCollator, Overflow
from lightning_mmpar.data.qwen_images import QwenImages
from lightning_mmpar.data.qwen_packing import QwenVLCollator
from lightning_mmpar.data.sampler import ResumableRandomSampler
from lightning_mmpar.data.shards import expand_shards, shard_sizes
from lightning_mmpar.data.tokenizer import IGNORE_INDEX, WordTokenizer
from lightning_mmpar.data.transforms import ImagePreprocess
from lightning_mmpar.data.webdataset import _EpochLoader

__all__ = [
    "ConversationDataModule",
    "QwenRowsCollator",
    "RaggedDataModule",
    "RowsCollator",
    "word_tokenizer_for",
]


def word_tokenizer_for(texts: list[str], image_token: str = IMAGE_MARKER) -> WordTokenizer:
    """A :class:`WordTokenizer` of the words of ``texts`` (markers removed) plus
    ``image_token`` as the last id."""
    tok = WordTokenizer.build(t.replace(image_token, " ") for t in texts)
    return WordTokenizer(vocab=[*tok.vocab, image_token])


ROW_FILL: dict[str, int] = {
    "input_ids": -1,  # replaced by the pad id
    "labels": IGNORE_INDEX,
    "sample_ids": -1,
    "image_sample": -1,
    "image_position": -1,
}
"""Value of each key on an empty row (others: 0 / False)."""


@dataclass(kw_only=True)
class RowsCollator(MultimodalCollator):
    """:class:`MultimodalCollator` whose batches have a multiple of ``rows_multiple`` rows:
    packed batches vary in row count, a pipeline splits a batch into ``micro_batches`` equal
    parts; empty rows (all pad, ``sample_ids`` -1, no image, no target) make up the rest."""

    rows_multiple: int = 1

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return _pad_rows(super().__call__(samples), self.rows_multiple, self.pad_token_id)


def _pad_rows(batch: dict[str, torch.Tensor], multiple: int, pad_id: int) -> dict[str, Any]:
    """``batch`` with empty rows (:data:`ROW_FILL`) up to a multiple of ``multiple`` rows."""
    extra = -batch["input_ids"].shape[0] % multiple
    if not extra:
        return batch
    out = {}
    for key, value in batch.items():
        fill = pad_id if key == "input_ids" else ROW_FILL.get(key, 0)
        out[key] = torch.cat([value, value.new_full((extra, *value.shape[1:]), fill)])
    return out


@dataclass(kw_only=True)
class QwenRowsCollator(QwenVLCollator):
    """:class:`~lightning_mmpar.data.qwen_packing.QwenVLCollator` with :class:`RowsCollator`'s
    ``rows_multiple``; a text-only sample of the conversation data (``pixel_values [0, 3, S,
    S]``, no grid) gets ``pixel_values [0, patch_dim]`` and ``image_grid_thw [0, 3]``."""

    rows_multiple: int = 1
    patch_dim: int = 0

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        fixed = [
            s
            if "image_grid_thw" in s
            else {
                **s,
                "pixel_values": torch.zeros(0, self.patch_dim),
                "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
            }
            for s in samples
        ]
        return _pad_rows(super().__call__(fixed), self.rows_multiple, self.pad_token_id)


class RaggedDataModule(pl.LightningDataModule):
    """Loaders of contract samples through a :class:`MultimodalCollator` (subclasses fill
    ``datasets`` in ``setup`` and set ``tokenizer`` / ``image_token_id``).

    Args:
        batch_size: samples per batch and dp rank (packing puts them in fewer rows).
        max_tokens: row budget, image tokens counted; ``pack``: several samples per row.
        image_seq_length: tokens one image occupies (spliced style; 0: cross-attention, the
            marker stays one token).
        max_images_per_row, pad_to_max_tokens, overflow: as in :class:`MultimodalCollator`.
        rows_multiple: batches hold a multiple of this many rows (empty rows added): the
            pipeline's ``micro_batches`` when packing under pipeline parallelism.
        num_workers: DataLoader workers; ``seed``: shuffling (and splits).
    """

    def __init__(
        self,
        *,
        batch_size: int = 8,
        max_tokens: int = 512,
        pack: bool = False,
        image_seq_length: int = 0,
        max_images_per_row: int | None = None,
        pad_to_max_tokens: bool = False,
        overflow: Overflow = "truncate",
        rows_multiple: int = 1,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1 or num_workers < 0 or rows_multiple < 1:
            raise ValueError(
                f"batch_size ({batch_size}) and rows_multiple ({rows_multiple}) must be >= 1 "
                f"and num_workers ({num_workers}) >= 0."
            )
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.collate_args: dict[str, Any] = {
            "max_tokens": max_tokens,
            "pack": pack,
            "image_seq_length": image_seq_length,
            "max_images_per_row": max_images_per_row,
            "pad_to_max_tokens": pad_to_max_tokens,
            "overflow": overflow,
            "rows_multiple": rows_multiple,
        }
        RowsCollator(image_token_id=0, **self.collate_args)  # checks the arguments now
        self.tokenizer: Tokenizer | None = None
        self.image_token_id = -1
        self.datasets: dict[str, Any] = {}
        self.collators: dict[str, Any] = {}

    @property
    def max_length(self) -> int:
        """Tokens per row (``max_tokens``): what the planner, the partitioner and the pre-launch
        checks price as one sample's text length (a caption module's ``max_length``); an upper
        bound, since a packed row may hold several samples and an unpacked one pads less."""
        return int(self.collate_args["max_tokens"])

    @property
    def images_per_sample(self) -> float | None:
        """Mean images per sample, what the planner prices (``--images-per-sample``'s default);
        ``None`` here: unknown without reading the data (the planner then assumes 1)."""
        return None

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size (the LM head's output size), image token included."""
        if self.tokenizer is None:
            self.setup("fit")
        assert self.tokenizer is not None
        return self.tokenizer.vocab_size

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id (the collator's padding)."""
        if self.tokenizer is None:
            self.setup("fit")
        return int(self.tokenizer.pad_id)  # type: ignore[union-attr]

    def collator(self, split: str = "train") -> Any:
        """The split's collator (one per split: its ``stats`` count truncations there)."""
        if split not in self.collators:
            self.collators[split] = self._make_collator(self.collate_args)
        return self.collators[split]

    def unpacked_collator(self) -> Any:
        """A collator of one sample per row, right-padded (greedy decoding reads every row at
        one position), with this module's other arguments (fixed shapes kept)."""
        return self._make_collator({**self.collate_args, "pack": False})

    def _make_collator(self, args: dict[str, Any]) -> Any:
        return RowsCollator(
            image_token_id=self.image_token_id, pad_token_id=self.pad_token_id, **args
        )

    def _loader(self, split: str, train: bool) -> DataLoader[dict[str, torch.Tensor]]:
        if split not in self.datasets:
            raise ValueError(f"no {split} data: call setup() first (or give a {split} source).")
        dataset = self.datasets[split]
        if isinstance(dataset, ShardedConversations):
            dataset.workers, dataset.batch_size = max(1, self.num_workers), self.batch_size
            dataset.drop_last = train
            dataset.plan(0, dataset.workers)  # enough shards for every reader, or raise
            loader = _EpochLoader(
                dataset,
                batch_size=self.batch_size,
                drop_last=train,
                num_workers=self.num_workers,
                collate_fn=self.collator(split),
            )
            if self.trainer is not None:
                trainer = self.trainer
                loader.epoch_of = lambda: trainer.current_epoch
            return loader
        return StatefulDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=ResumableRandomSampler(dataset, seed=self.seed) if train else None,
            drop_last=train,
            num_workers=self.num_workers,
            collate_fn=self.collator(split),
        )

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Shuffled (seeded by ``seed`` and the epoch), last partial batch dropped."""
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]] | list[Any]:
        """The validation samples in order (a subclass without a validation split: ``[]``)."""
        return self._loader("val", False)


class ConversationDataModule(RaggedDataModule):
    """LLaVA-format conversations as ragged batches (module docstring).

    Args:
        train_file: LLaVA JSON (or JSON lines) of the training records; or ``train_shards``:
            WebDataset tars (brace ranges) of ``<key>.json`` + ``<key>.<n>.<ext>`` images
            (:mod:`lightning_mmpar.data.conversation_shards`).
        val_file / val_shards: validation records; without them ``val_fraction`` of the
            training file's records (seeded) is held out (0: no validation).
        image_root: folder the JSON's relative image paths are under.
        tokenizer: a transformers tokenizer directory (its chat template is used when set);
            else ``tokenizer_dir`` (:func:`~lightning_mmpar.data.hf_tokenizer.load_tokenizer`);
            else a :class:`WordTokenizer` of the training file's words plus the image token.
        image_token: the marker (``<image>``), a token of the tokenizer.
        use_chat_template: False: the plain format even with a template.
        image_size, preprocess: images become ``[3, S, S]`` (``ImagePreprocess``).
        on_error: shards only: ``"raise"`` or ``"skip"`` a bad sample.
        image_processor: a Qwen2-VL / Qwen2.5-VL directory (:class:`~lightning_mmpar.data.
            qwen_images.QwenImages`; the recipe links ``model.pretrained.hf`` here): images
            become its image processor's patches and grids, markers its vision tokens,
            batches a :class:`QwenRowsCollator`'s; the tokenizer defaults to the directory's.
            ``image_size`` / ``preprocess`` then do not apply, ``overflow`` must be ``"drop"``
            or ``"error"`` (an image is not cut), ``image_seq_length`` 0.
        max_patches_per_row: with ``image_processor``: a row's patch budget (fixed ``P``,
            what pipeline parallelism needs with ``pad_to_max_tokens`` and
            ``max_images_per_row``).
        Others: as in :class:`RaggedDataModule`.

    Raises:
        ValueError: neither or both of ``train_file`` / ``train_shards``, a bad field (named),
            a bad record (file, record, sample id), markers that do not match the images.
    """

    def __init__(
        self,
        *,
        train_file: str | None = None,
        val_file: str | None = None,
        train_shards: str | list[str] | None = None,
        val_shards: str | list[str] | None = None,
        val_fraction: float = 0.0,
        image_root: str = ".",
        tokenizer: str | None = None,
        tokenizer_dir: str | None = None,
        image_token: str = IMAGE_MARKER,
        use_chat_template: bool = True,
        image_size: int = 224,
        preprocess: ImagePreprocess | None = None,
        on_error: str = "raise",
        image_processor: str | None = None,
        max_patches_per_row: int | None = None,
        **ragged: Any,
    ) -> None:
        super().__init__(**ragged)
        self.images = QwenImages(image_processor) if image_processor else None
        self.max_patches_per_row = max_patches_per_row
        if self.images is not None:
            _check_qwen_args(self.collate_args)
            self.image_token_id = self.images.image_token_id
            has_tokenizer = (Path(str(image_processor)) / "tokenizer_config.json").is_file()
            if tokenizer is None and tokenizer_dir is None and has_tokenizer:
                tokenizer = image_processor
        if (train_file is None) == (train_shards is None):
            raise ValueError(
                "ConversationDataModule: give train_file (LLaVA JSON) or train_shards "
                f"(WebDataset tars), exactly one (got {train_file!r}, {train_shards!r})."
            )
        if not 0.0 <= val_fraction < 1.0 or image_size < 8:
            raise ValueError(
                f"ConversationDataModule: val_fraction ({val_fraction}) must be in [0, 1) and "
                f"image_size ({image_size}) >= 8."
            )
        self.files = {"train": train_file, "val": val_file}
        self.shards = {"train": train_shards, "val": val_shards}
        self.val_fraction, self.image_root, self.image_size = val_fraction, image_root, image_size
        self.image_token, self.use_chat_template, self.on_error = (
            image_token,
            use_chat_template,
            on_error,
        )
        self.transform: Any = self.images or (preprocess or ImagePreprocess()).transform(image_size)
        if tokenizer is not None:
            self.tokenizer = HFTokenizer(tokenizer)
        elif tokenizer_dir is not None:
            self.tokenizer = load_tokenizer(tokenizer_dir)

    def _records(self) -> dict[str, list[ConversationRecord]]:
        train = read_conversations(self.files["train"]) if self.files["train"] else []
        if self.files["val"]:
            return {"train": train, "val": read_conversations(self.files["val"])}
        if not self.val_fraction:
            return {"train": train}
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed))
        n_val = max(1, round(self.val_fraction * len(train)))
        held = set(order[:n_val].tolist())
        return {
            "train": [r for i, r in enumerate(train) if i not in held],
            "val": [r for i, r in enumerate(train) if i in held],
        }

    def setup(self, stage: str | None = None) -> None:
        """Read and check the records (or size the shards), build the tokenizer if needed
        (idempotent)."""
        if self.datasets:  # the dp rank may be known only now (vocab_size came first)
            for data in self.datasets.values():
                if isinstance(data, ShardedConversations):
                    data.rank, data.world = self._dp()
            return
        records = self._records() if self.files["train"] else {}
        if self.tokenizer is None:
            texts = [v for r in records.get("train", []) for _, v in r.turns]
            texts += self._shard_texts()
            self.tokenizer = word_tokenizer_for(texts, self.image_token)
        encoder = ChatEncoder(
            self.tokenizer,
            image_token=self.image_token,
            use_template=self.use_chat_template,
            marker_ids=self.images.marker_ids if self.images else None,
        )
        self.image_token_id = encoder.image_token_id
        common: dict[str, Any] = {
            "encoder": encoder,
            "transform": self.transform,
            "image_size": self.image_size,
        }
        for split, recs in records.items():
            self.datasets[split] = ConversationDataset(recs, image_root=self.image_root, **common)
        rank, world = self._dp()
        for split, shards in self.shards.items():
            if shards is not None:
                urls = expand_shards(shards)
                self.datasets[split] = ShardedConversations(
                    urls,
                    shard_sizes(urls),
                    rank=rank,
                    world=world,
                    shuffle=split == "train",
                    seed=self.seed,
                    on_error=self.on_error,
                    **common,
                )

    def _make_collator(self, args: dict[str, Any]) -> Any:
        if self.images is None:
            return super()._make_collator(args)
        return QwenRowsCollator(
            image_token_id=self.image_token_id,
            pad_token_id=self.pad_token_id,
            spatial_merge_size=self.images.merge_size,
            max_patches_per_row=self.max_patches_per_row,
            patch_dim=self.images.patch_dim,
            **{k: v for k, v in args.items() if k != "image_seq_length"},
        )

    def _shard_texts(self, limit: int = 10000) -> list[str]:
        """Turn texts of the first ``limit`` training shard samples (vocabulary building)."""
        import json

        from lightning_mmpar.data.shards import raw_samples

        texts: list[str] = []
        for url in expand_shards(self.shards["train"]) if self.shards["train"] else []:
            for raw in raw_samples(url):
                if len(texts) >= limit:
                    return texts
                try:
                    turns = json.loads(raw.get("json", b"{}")).get("conversations", [])
                    texts += [str(t.get("value", "")) for t in turns]
                except (ValueError, AttributeError):
                    continue  # the reader reports the bad sample when it reaches it
        return texts

    def _dp(self) -> tuple[int, int]:
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]] | list[Any]:
        """The validation samples in order; ``[]`` when there are none (``val_fraction`` 0 and
        no ``val_file`` / ``val_shards``): Lightning then skips validation."""
        self.setup("fit")
        return self._loader("val", False) if "val" in self.datasets else []

    def dataset(self, split: str = "train") -> Dataset[dict[str, Any]]:
        """The split's dataset (after :meth:`setup`)."""
        self.setup("fit")
        return self.datasets[split]  # type: ignore[no-any-return]


def _check_qwen_args(args: Mapping[str, Any]) -> None:
    """``ValueError`` for collator arguments a Qwen-VL image processor cannot honour."""
    if args["overflow"] not in ("drop", "error"):
        raise ValueError(
            f"data.overflow ({args['overflow']!r}) with data.image_processor: a dynamic-"
            "resolution image is not cut; set overflow to 'drop' or 'error'."
        )
    if args["image_seq_length"]:
        raise ValueError(
            f"data.image_seq_length ({args['image_seq_length']}) with data.image_processor: "
            "each image's tokens come from its grid (t h w / merge^2); set it to 0."
        )
