"""Training text and batches for the GPT example, identical under every parallel layout.

The text is generated, not downloaded: simple English sentences from a small grammar, drawn by
a seeded random.Random, so every rank (and every run, on every machine) sees the same ~64 KB
without any file or network. `--data PATH` trains on any text file instead. Characters are the
tokens (vocabulary = the sorted set of characters of the text).

Batches depend only on (seed, step): the step's global batch is cut into dp equal slices by
row, so a layout change, or a resume at step k, reads exactly the rows an uninterrupted
single-process run reads. The data position in a checkpoint is therefore just the step.
"""
from __future__ import annotations

import random
from typing import List, Optional, Tuple

import torch

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a little bird", "the teacher", "our neighbour",
            "the children", "a young girl", "the farmer", "her brother", "the baker", "a tired student"]
VERBS = ["sees", "likes", "finds", "follows", "watches", "helps", "calls", "remembers", "paints", "carries"]
OBJECTS = ["a red ball", "the small boat", "an apple", "the blue door", "a quiet song", "the letter",
           "a warm coat", "the green hat", "a long story", "the map"]
PLACES = ["in the garden", "at the market", "near the river", "under the tree", "by the sea", "on the hill",
          "in the kitchen", "at school"]
TIMES = ["today", "every morning", "at night", "on sunday", "after lunch", "in the spring", "once again"]


def generate_text(num_chars: int = 64_000, seed: int = 1234) -> str:
    """Deterministic sentences ("The cat sees a red ball near the river today."), in paragraphs."""
    rng = random.Random(seed)
    out: List[str] = []
    length = 0
    while length < num_chars:
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.7:
            sentence += f" {rng.choice(PLACES)}"
        if rng.random() < 0.5:
            sentence += f" {rng.choice(TIMES)}"
        if rng.random() < 0.3:
            sentence += f" and then {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        piece = sentence[0].upper() + sentence[1:] + (".\n" if rng.random() < 0.2 else ". ")
        out.append(piece)
        length += len(piece)
    return "".join(out)[:num_chars]


class CharTokenizer:
    """Characters <-> ids, the vocabulary being the sorted characters of the training text."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def load_corpus(path: Optional[str] = None) -> Tuple[torch.Tensor, CharTokenizer]:
    """(token ids of the whole text (n,), tokenizer): the generated text, or the file at `path`."""
    if path is None:
        text = generate_text()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    tokenizer = CharTokenizer(text)
    return tokenizer.encode(text), tokenizer


def global_batch(data: torch.Tensor, step: int, seed: int, batch_size: int, seq_len: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of step `step`, both (batch_size, seq_len), the same on every rank."""
    if len(data) < seq_len + 2:
        raise ValueError(f"global_batch: the text has {len(data)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    rows = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])  # (B, s + 1)
    return rows[:, :-1], rows[:, 1:]


def dp_slice(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's rows of the global batch: (B, ...) -> (B / dp, ...)."""
    rows = batch.shape[0] // dp_size
    return batch[dp_rank * rows: (dp_rank + 1) * rows]
