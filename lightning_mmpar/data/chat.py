"""A conversation with image markers as token ids and labels on the assistant's turns only.

Turns are ``(role, text)`` with role ``"human"`` / ``"gpt"`` (LLaVA's names; ``"user"`` /
``"assistant"`` / ``"system"`` are accepted too). Every ``<image>`` marker in the text becomes ONE
``image_token_id`` (the collator expands it, :mod:`lightning_mmpar.data.packing`), so the
sample's markers line up with its images in order of appearance.

**With a chat template** (a transformers tokenizer whose ``chat_template`` is set): the text is
the template's rendering (``apply_chat_template(..., tokenize=False)``). The assistant turns are
found as LLaVA's ``preprocess`` and TRL's prompt-completion path do, by rendering prefixes: the
span of assistant turn ``i`` runs from the end of the rendering of the turns before it with the
generation prompt (``add_generation_prompt=True``) to the end of the rendering that includes
it (its end-of-turn tokens included: the model learns to stop). The text is tokenised piece by
piece at those boundaries, so every label lands exactly on its span.

**Without one** (the package's :class:`~lightning_mmpar.data.tokenizer.WordTokenizer`, or a
transformers tokenizer without a template): ``<bos>``, then each turn's tokens, each assistant
turn followed by ``<eos>`` (its target too).

Labels are the ids on assistant spans and ``IGNORE_INDEX`` (-100) everywhere else: system and
user turns, template tokens outside the assistant spans, and every image marker. The caption loss
shifts them (``labels[t]`` is the target of position ``t - 1``'s prediction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_mmpar.data.tokenizer import IGNORE_INDEX

__all__ = ["IMAGE_MARKER", "ChatEncoder", "image_token_id"]

IMAGE_MARKER = "<image>"
"""The image marker of LLaVA-format text (one per image, in order)."""
ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
"""Turn ``from`` names accepted -> chat-template role."""


def image_token_id(tokenizer: Any, token: str = IMAGE_MARKER) -> int:
    """Id of ``token`` in ``tokenizer`` (a :class:`WordTokenizer` or an :class:`HFTokenizer`).

    Raises:
        ValueError: the tokenizer has no such token (with the fix: add it).
    """
    vocab_ids = getattr(tokenizer, "_ids", None)
    if isinstance(vocab_ids, dict) and token in vocab_ids:
        return int(vocab_ids[token])
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None:
        found = hf.convert_tokens_to_ids(token)
        if found is not None and found != hf.unk_token_id:
            return int(found)
    raise ValueError(
        f"the tokenizer has no image token {token!r}: add it as a special token "
        f"(transformers: tokenizer.add_special_tokens({{'additional_special_tokens': "
        f"[{token!r}]}}) then save_pretrained; WordTokenizer: append it to the vocab) and size "
        "the model's embeddings for it."
    )


class ChatEncoder:
    """Turns -> ``(input_ids [L], labels [L])`` long tensors (module docstring).

    Args:
        tokenizer: a :class:`~lightning_mmpar.data.tokenizer.WordTokenizer` or
            :class:`~lightning_mmpar.data.hf_tokenizer.HFTokenizer` (``encode`` adds
            ``<bos>``/``<eos>``, which pieces drop).
        image_token: the marker's token (default ``<image>``); its id is ``image_token_id``.
        use_template: apply the tokenizer's chat template when it has one (default); False:
            the plain format even so.
        marker_ids: the ids one marker becomes, the image token in the middle (Qwen-VL:
            vision start, image pad, vision end; ``image_token`` is then the marker text
            only); default: the image token alone.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        image_token: str = IMAGE_MARKER,
        use_template: bool = True,
        marker_ids: Sequence[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.marker_ids = tuple(marker_ids or ())
        if self.marker_ids:  # Qwen-VL: vision start, image token, vision end
            self.image_token_id = self.marker_ids[len(self.marker_ids) // 2]
        else:
            self.image_token_id = image_token_id(tokenizer, image_token)
        hf = getattr(tokenizer, "tokenizer", None)
        self.template = hf if use_template and getattr(hf, "chat_template", None) else None

    def piece(self, text: str) -> list[int]:
        """Ids of ``text`` (no ``<bos>``/``<eos>``), each marker one ``image_token_id``."""
        out: list[int] = []
        for n, part in enumerate(text.split(self.image_token)):
            if n:
                out.extend(self.marker_ids or (self.image_token_id,))
            if part:
                out.extend(self.tokenizer.encode(part)[1:-1])
        return out

    def __call__(
        self, turns: Sequence[tuple[str, str]], sample_id: str = "?"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and labels of ``turns`` (``(from, value)`` pairs).

        Raises:
            ValueError: an unknown role, or no assistant turn (nothing to learn), naming the
                sample.
        """
        roles = [_role(who, sample_id) for who, _ in turns]
        if "assistant" not in roles:
            raise ValueError(
                f"sample {sample_id!r}: no 'gpt' (assistant) turn, so no target token; every "
                "conversation needs at least one answer."
            )
        pieces = self._template_pieces(turns, roles) if self.template else self._plain(turns, roles)
        ids: list[int] = []
        labels: list[int] = []
        for tokens, target in pieces:
            ids.extend(tokens)
            labels.extend(
                t if target and t != self.image_token_id else IGNORE_INDEX for t in tokens
            )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)

    def _plain(
        self, turns: Sequence[tuple[str, str]], roles: list[str]
    ) -> list[tuple[list[int], bool]]:
        eos = int(self.tokenizer.eos_id)
        out: list[tuple[list[int], bool]] = [([int(self.tokenizer.bos_id)], False)]
        for (_, text), role in zip(turns, roles, strict=True):
            answer = role == "assistant"
            out.append(([*self.piece(text), eos] if answer else self.piece(text), answer))
        return out

    def _template_pieces(
        self, turns: Sequence[tuple[str, str]], roles: list[str]
    ) -> list[tuple[list[int], bool]]:
        messages = [
            {"role": role, "content": text} for (_, text), role in zip(turns, roles, strict=True)
        ]
        text = self._render(messages, False)
        spans: list[tuple[int, int]] = []
        for i, role in enumerate(roles):
            if role == "assistant":
                before = self._render(messages[:i], True) if i else ""
                through = self._render(messages[: i + 1], False)
                if not (text.startswith(before) and text.startswith(through)):
                    raise ValueError(
                        f"the tokenizer's chat template renders turn {i} differently as a "
                        "prefix than inside the whole conversation, so the assistant tokens "
                        "cannot be located; pass use_template=False or a prefix-stable template."
                    )
                spans.append((len(before), len(through)))
        out: list[tuple[list[int], bool]] = []
        done = 0
        for start, end in spans:
            out += [(self.piece(text[done:start]), False), (self.piece(text[start:end]), True)]
            done = end
        out.append((self.piece(text[done:]), False))
        return out

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        assert self.template is not None
        return str(
            self.template.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )


def _role(who: str, sample_id: str) -> str:
    if who not in ROLES:
        raise ValueError(
            f"sample {sample_id!r}: turn 'from' {who!r} is not one of {sorted(ROLES)}; LLaVA "
            "format uses 'human' and 'gpt'."
        )
    return ROLES[who]
