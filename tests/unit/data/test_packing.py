"""The ragged-batch collator (issue 28 items 1, 2, 7): marker expansion, packing, position and
sample ids, image slots, fixed shapes, and the bad-input errors."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpar.data.packing import IGNORE_INDEX, MultimodalCollator, contrastive_pairs

IMG = 9


def _sample(sid: str, text: list[int], images: int, size: int = 4) -> dict[str, object]:
    """``text`` with IMG markers; labels = the tokens; ``images`` images filled with their
    index + 1 (so slots can be told apart)."""
    ids = torch.tensor(text)
    pix = torch.arange(1.0, images + 1).view(-1, 1, 1, 1).expand(images, 3, size, size)
    return {"id": sid, "input_ids": ids, "labels": ids.clone(), "pixel_values": pix}


def test_unpacked_pads_each_sample_to_the_longest_row() -> None:
    c = MultimodalCollator(max_tokens=16, image_token_id=IMG, pack=False)
    batch = c([_sample("a", [1, IMG, 5, 6, 2], 1), _sample("b", [1, 7, 2], 0)])
    assert batch["input_ids"].tolist() == [[1, IMG, 5, 6, 2], [1, 7, 2, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 5, 6, 2], [-100, 7, 2, -100, -100]]
    assert batch["sample_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    assert batch["pixel_values"].shape == (2, 1, 3, 4, 4)
    assert batch["image_mask"].tolist() == [[True], [False]]
    assert batch["image_sample"].tolist() == [[0], [-1]]
    assert batch["image_position"].tolist() == [[1], [-1]]
    assert batch["pixel_values"][1].abs().sum() == 0


def test_packing_fills_rows_first_fit_with_restarting_positions() -> None:
    c = MultimodalCollator(max_tokens=8, image_token_id=IMG, pack=True)
    samples = [
        _sample("a", [1, IMG, 5, 2], 1),
        _sample("b", [1, 6, 6, 6, 6, 2], 0),
        _sample("c", [1, IMG, IMG, IMG, 2], 3),
        _sample("d", [1, 7, 2], 0),
    ]
    batch = c(samples)
    # a (4) + d (3) share row 0; b (6) row 1; c (5) does not fit row 0 (7 + 5) nor row 1.
    assert batch["input_ids"].shape == (3, 7)
    assert batch["sample_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch["labels"][0].tolist() == [-100, -100, 5, 2, -100, 7, 2]
    assert batch["image_mask"].tolist() == [[True, False, False], [False] * 3, [True] * 3]
    assert batch["image_position"][2].tolist() == [1, 2, 3]
    assert batch["image_sample"][2].tolist() == [0, 0, 0]
    assert batch["pixel_values"][2, :, 0, 0, 0].tolist() == [1.0, 2.0, 3.0]
    assert c.stats == {"samples": 4, "truncated": 0, "dropped": 0, "rows": 3}


def test_spliced_style_expands_each_marker_and_counts_image_tokens() -> None:
    c = MultimodalCollator(max_tokens=12, image_token_id=IMG, image_seq_length=3)
    batch = c([_sample("a", [1, IMG, 5, IMG, 2], 2), _sample("b", [1, 4, 2], 0)])
    # a expands to 9 tokens; b (3) fits beside it.
    assert batch["input_ids"][0].tolist() == [1, IMG, IMG, IMG, 5, IMG, IMG, IMG, 2, 1, 4, 2]
    assert (batch["labels"][0] == IGNORE_INDEX).tolist() == [True] * 4 + [False] + [True] * 3 + [
        False,
        True,
        False,
        False,
    ]
    assert batch["image_position"][0].tolist() == [1, 5]
    assert batch["sample_ids"][0].tolist() == [0] * 9 + [1] * 3


def test_text_only_batch_has_zero_image_slots() -> None:
    batch = MultimodalCollator(max_tokens=8, image_token_id=IMG)([_sample("a", [1, 4, 2], 0)])
    assert batch["pixel_values"].shape == (1, 0, 3, 4, 4)
    assert batch["image_mask"].shape == (1, 0)


def test_fixed_shapes_for_pipelines() -> None:
    c = MultimodalCollator(
        max_tokens=10, image_token_id=IMG, max_images_per_row=2, pad_to_max_tokens=True
    )
    for samples in ([_sample("a", [1, 4, 2], 0)], [_sample("b", [1, IMG, IMG, 2], 2)] * 3):
        batch = c(samples)
        assert batch["input_ids"].shape[1:] == (10,)
        assert batch["pixel_values"].shape[1:] == (2, 3, 4, 4)
    # two two-image samples do not share a row of two slots
    assert batch["input_ids"].shape[0] == 3


def test_marker_count_mismatch_names_sample_and_both_counts() -> None:
    bad = _sample("q-17", [1, IMG, 5, IMG, 2], 1)
    with pytest.raises(ValueError, match=r"sample 'q-17' has 2 image marker.*but 1 image"):
        MultimodalCollator(max_tokens=8, image_token_id=IMG)([bad])


def test_too_many_images_for_the_slots_is_refused() -> None:
    c = MultimodalCollator(max_tokens=8, image_token_id=IMG, max_images_per_row=1)
    with pytest.raises(ValueError, match=r"sample 'x' has 2 images, more than max_images_per_row"):
        c([_sample("x", [1, IMG, IMG, 2], 2)])


def test_overflow_truncate_drop_error_are_counted() -> None:
    long = _sample("long", [1, 4, IMG, 5, 6, 7, 2], 1)
    short = _sample("short", [1, 4, 2], 0)
    # spliced, 2 tokens per image: long is 8 tokens; the image at 2..3 fits a cut at 5
    c = MultimodalCollator(max_tokens=5, image_token_id=IMG, image_seq_length=2, pack=False)
    batch = c([long, short])
    assert batch["input_ids"][0].tolist() == [1, 4, IMG, IMG, 5]
    assert batch["image_mask"][0].tolist() == [True] and c.stats["truncated"] == 1
    # a cut through the image's tokens drops the image and its tokens
    c3 = MultimodalCollator(max_tokens=3, image_token_id=IMG, image_seq_length=2, pack=False)
    batch = c3([long])
    assert batch["input_ids"].tolist() == [[1, 4]] and batch["pixel_values"].shape[1] == 0
    drop = MultimodalCollator(max_tokens=5, image_token_id=IMG, overflow="drop")
    batch = drop([long, short])
    assert batch["input_ids"].tolist() == [[1, 4, 2]] and drop.stats["dropped"] == 1
    with pytest.raises(ValueError, match=r"sample 'long' has 7 tokens.*max_tokens \(5\)"):
        MultimodalCollator(max_tokens=5, image_token_id=IMG, overflow="error")([long])
    with pytest.raises(ValueError, match="all 1 sample"):
        drop([long])


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_tokens", 0, "max_tokens"),
        ("image_seq_length", -1, "image_seq_length"),
        ("max_images_per_row", -1, "max_images_per_row"),
        ("overflow", "skip", "overflow"),
    ],
)
def test_bad_arguments_name_the_field(field: str, value: object, match: str) -> None:
    kwargs: dict[str, object] = {"max_tokens": 8, "image_token_id": IMG, field: value}
    with pytest.raises(ValueError, match=match):
        MultimodalCollator(**kwargs)  # type: ignore[arg-type]


def test_malformed_sample_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"sample 'z' has no 'pixel_values'"):
        MultimodalCollator(max_tokens=8, image_token_id=IMG)(
            [{"id": "z", "input_ids": torch.tensor([1]), "labels": torch.tensor([1])}]
        )


def test_contrastive_pairs_are_single_image_samples_with_a_caption() -> None:
    c = MultimodalCollator(max_tokens=32, image_token_id=IMG)
    no_caption = _sample("n", [1, IMG, 2], 1)
    no_caption["labels"] = torch.full((3,), IGNORE_INDEX)
    batch = c(
        [
            _sample("one", [1, IMG, 5, 2], 1),
            _sample("three", [1, IMG, IMG, IMG, 2], 3),
            _sample("text", [1, 4, 2], 0),
            no_caption,
            _sample("one again", [1, IMG, 6, 2], 1),
        ]
    )
    assert batch["image_mask"].sum() == 6
    assert contrastive_pairs(batch).tolist() == [[True, False, False, False, False, True]]


def test_overflow_counts_travel_with_the_batch_from_worker_processes() -> None:
    """Truncated samples per row and dropped samples (charged to row 0) are the batch's
    ``overflow [B, 2]``, so they reach the training process under ``num_workers=2``, where
    a worker's ``collator.stats`` never does."""
    from torch.utils.data import DataLoader

    long = _sample("long", [1, 4, 5, 6, 7, 2], 0)
    short = _sample("short", [1, 4, 2], 0)
    c = MultimodalCollator(max_tokens=5, image_token_id=IMG, pack=False)
    assert c([long, short, long])["overflow"].tolist() == [[1, 0], [0, 0], [1, 0]]
    drop = MultimodalCollator(max_tokens=5, image_token_id=IMG, overflow="drop")
    assert drop([long, short, long])["overflow"].tolist() == [[0, 2]]
    data = [long, short] * 6
    loader = DataLoader(data, batch_size=4, collate_fn=c, num_workers=2)  # type: ignore[arg-type]
    total = sum(batch["overflow"].sum(0) for batch in loader)
    assert total.tolist() == [6, 0]
    assert c.stats["truncated"] == 2  # the two direct calls: the workers counted in copies
