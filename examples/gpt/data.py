"""The embedded dataset: the opening of *Alice's Adventures in Wonderland* (Lewis Carroll,
1865, public domain), lower-cased, as character ids.

Batches are drawn deterministically: step ``t`` takes ``batch_size`` windows of
``seq_length + 1`` characters at offsets from a generator seeded with ``(seed, t)``, so every
rank (and the 1-process reference) builds the same global batch without communicating, and
DP rank ``d`` keeps rows ``[d·B/dp, (d+1)·B/dp)``.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import torch

__all__ = ["ALPHABET", "corpus", "decode", "dp_rows", "encode", "global_batch"]

ALPHABET = "\n !\"'(),-.:;?0123456789abcdefghijklmnopqrstuvwxyz"
"""Character of each token id (id = index); anything else reads as ``?``."""

_TEXT = Path(__file__).with_name("alice.txt")


def encode(text: str) -> torch.Tensor:
    """Token ids (int64) of ``text``, lower-cased; characters outside :data:`ALPHABET` become
    ``?``."""
    unknown = ALPHABET.index("?")
    return torch.tensor([_index(c, unknown) for c in text.lower()], dtype=torch.int64)


def _index(char: str, unknown: int) -> int:
    found = ALPHABET.find(char)
    return unknown if found < 0 else found


def decode(ids: torch.Tensor) -> str:
    """The text of token ids."""
    return "".join(ALPHABET[int(i)] for i in ids.reshape(-1))


@cache
def corpus() -> torch.Tensor:
    """The whole text as ids; lines of a paragraph are joined by spaces, paragraphs by one
    newline."""
    paragraphs = _TEXT.read_text(encoding="utf-8").strip().split("\n\n")
    text = "\n".join(re.sub(r"\s+", " ", p).strip() for p in paragraphs)
    return encode(text)


def global_batch(step: int, batch_size: int, seq_length: int, seed: int = 0) -> torch.Tensor:
    """``[batch_size, seq_length + 1]`` token windows for ``step`` (same on every rank)."""
    ids = corpus()
    if ids.numel() <= seq_length + 1:
        raise ValueError(
            f"seq_length={seq_length} needs a text longer than {seq_length + 1} characters; "
            f"the embedded text has {ids.numel()}"
        )
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, ids.numel() - seq_length - 1, (batch_size,), generator=gen)
    return torch.stack([ids[int(s) : int(s) + seq_length + 1] for s in starts])


def dp_rows(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """DP rank ``dp_rank``'s equal share of the global batch's rows."""
    rows = tokens.shape[0] // dp_size
    return tokens[dp_rank * rows : (dp_rank + 1) * rows]
