"""Training data addressed by micro-batch identity: ``batch(iteration, mb)`` is the same on every rank.

Two sources: generated sequences (learnable: each is an arithmetic progression modulo the vocabulary,
so the loss visibly falls), or token windows cut from a file (``.npy`` of integer token ids, or any
other file read as bytes, one token per byte). Which windows a micro-batch gets derives from
``(seed, iteration, mb)`` only.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import numpy as np
import torch

from unicron.kernel.errors import ConfigError
from unicron.runtime.plan import mb_seed


class TokenSource(ABC):
    def __init__(self, vocab: int, seq: int, micro_batch_size: int, seed: int) -> None:
        self.vocab, self.seq, self.mbs, self.seed = vocab, seq, micro_batch_size, seed

    @abstractmethod
    def batch(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels), each ``[micro_batch_size, seq]`` int64; labels are tokens shifted by one."""


class SyntheticTokens(TokenSource):
    """Progressions ``(a + i*d) mod vocab`` with per-sample random start and stride."""

    def batch(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(mb_seed(self.seed, iteration, mb))
        start = torch.randint(0, self.vocab, (self.mbs, 1), generator=g)
        stride = torch.randint(1, max(2, min(self.vocab, 8)), (self.mbs, 1), generator=g)
        seqs = (start + stride * torch.arange(self.seq + 1).unsqueeze(0)) % self.vocab
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


class FileTokens(TokenSource):
    """Windows of ``seq + 1`` tokens at offsets drawn from the micro-batch's own generator."""

    def __init__(self, path: str, vocab: int, seq: int, micro_batch_size: int, seed: int) -> None:
        super().__init__(vocab, seq, micro_batch_size, seed)
        if not os.path.isfile(path):
            raise ConfigError(f"--data-file {path!r} does not exist; pass a .npy of token ids or any file")
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r")
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ConfigError(f"--data-file {path!r}: expected a 1-D integer array of token ids")
            tokens = torch.from_numpy(np.array(arr, dtype=np.int64))  # a writable copy
        else:
            with open(path, "rb") as fh:
                tokens = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8).to(torch.int64)
        if tokens.numel() < seq + 2:
            raise ConfigError(f"--data-file {path!r} has {tokens.numel()} tokens; need more than seq+1={seq + 1}")
        if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
            tokens = tokens.remainder(vocab)
        self.tokens = tokens

    def batch(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(mb_seed(self.seed, iteration, mb))
        starts = torch.randint(0, self.tokens.numel() - self.seq - 1, (self.mbs,), generator=g)
        idx = starts.unsqueeze(1) + torch.arange(self.seq + 1).unsqueeze(0)
        seqs = self.tokens[idx]
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def make_source(path: str | None, vocab: int, seq: int, micro_batch_size: int, seed: int) -> TokenSource:
    if path:
        return FileTokens(path, vocab, seq, micro_batch_size, seed)
    return SyntheticTokens(vocab, seq, micro_batch_size, seed)
