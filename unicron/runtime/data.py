"""Training data addressed by micro-batch identity: ``batch(iteration, mb)`` is the same on every rank.

Three sources: generated sequences (learnable: each is an arithmetic progression modulo the vocabulary,
so the loss visibly falls), token windows cut from a file (``.npy`` of integer token ids, or any other
file read as bytes, one token per byte), or samples of a Megatron-core indexed dataset (``PREFIX.bin`` +
``PREFIX.idx``, what Megatron-LM's ``tools/preprocess_data.py`` writes). Which windows a micro-batch
gets derives from ``(seed, iteration, mb)`` only, so any rank computing a micro-batch (after a failure,
a survivor recomputing a dead rank's) sees the same tokens. Each is a
:class:`unicron.runtime.job.MicroBatches` for :func:`unicron.runtime.pretrain`.
"""

from __future__ import annotations

import os
import struct
import warnings
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
            try:
                arr = np.load(path, mmap_mode="r")
            except (ValueError, OSError, EOFError) as exc:  # not an .npy, or one of pickled objects
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ConfigError(f"--data-file {path!r}: not a .npy of token ids ({msg})") from exc
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ConfigError(f"--data-file {path!r}: expected a 1-D integer array of token ids")
            tokens = torch.from_numpy(np.array(arr, dtype=np.int64))  # a writable copy
        else:
            with open(path, "rb") as fh:
                tokens = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8).to(torch.int64)
        if tokens.numel() < seq + 1:
            raise ConfigError(f"--data-file {path!r} has {tokens.numel()} tokens; a window needs seq+1={seq + 1}")
        if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
            tokens = tokens.remainder(vocab)
        self.tokens = tokens

    def batch(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(mb_seed(self.seed, iteration, mb))
        # a window is seq + 1 tokens: the last one starts at numel - seq - 1 (randint's high is exclusive)
        starts = torch.randint(0, self.tokens.numel() - self.seq, (self.mbs,), generator=g)
        idx = starts.unsqueeze(1) + torch.arange(self.seq + 1).unsqueeze(0)
        seqs = self.tokens[idx]
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


class IndexedTokens(TokenSource):
    """Samples of a Megatron-core indexed dataset, as Megatron's ``GPTDataset`` cuts them.

    The documents of ``PREFIX.bin`` are one token stream (their end-of-document tokens, if the
    preprocessing added them, stay in it); sample ``s`` is tokens ``[s*seq, s*seq + seq + 1)``, so
    neighbours share one token (the last label of one is the first input of the next). Samples are
    taken in a shuffled order, a new permutation per pass over the data, drawn from ``seed`` and the
    pass: sample ``j`` of micro-batch ``mb`` of ``iteration`` is number ``(iteration*B + mb)*mbs + j``
    of that order, a function of the micro-batch's identity only. The index is read with Megatron-core's
    own reader (``megatron.core.datasets.indexed_dataset.IndexedDataset``); tokens are memory-mapped.
    """

    def __init__(self, path_prefix: str, vocab: int, seq: int, micro_batch_size: int, seed: int,
                 micro_batches: int) -> None:
        super().__init__(vocab, seq, micro_batch_size, seed)
        self.path, self.micro_batches = path_prefix, micro_batches
        self.tokens = _indexed_tokens(path_prefix)
        total = int(self.tokens.shape[0])
        if total < seq + 1:
            raise ConfigError(f"--data-path {path_prefix!r} holds {total} tokens; a sample needs seq+1={seq + 1}")
        self.samples = (total - 1) // seq
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) > 1:
                self._orders.pop(min(self._orders))
            order = self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.samples)
        return order

    def sample(self, number: int) -> np.ndarray:
        """Tokens of the ``number``-th sample of the shuffled order (``seq + 1`` of them)."""
        epoch, pos = divmod(number, self.samples)
        start = int(self._order(epoch)[pos]) * self.seq
        return np.asarray(self.tokens[start : start + self.seq + 1], dtype=np.int64)

    def batch(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = (iteration * self.micro_batches + mb) * self.mbs
        seqs = torch.from_numpy(np.stack([self.sample(first + j) for j in range(self.mbs)]))
        top = int(seqs.max())
        if top >= self.vocab or int(seqs.min()) < 0:
            raise ConfigError(f"--data-path {self.path!r}: token id {top} is outside the vocabulary "
                              f"(--vocab {self.vocab}); give the tokenizer's vocabulary size")
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


IDX_MAGIC = b"MMIDIDX\x00\x00"
"""First bytes of a Megatron-core ``.idx`` file (``indexed_dataset._INDEX_HEADER``)."""


def _indexed_tokens(prefix: str) -> np.ndarray:
    """The whole token stream of ``PREFIX.bin``, memory-mapped, after Megatron-core read the index."""
    for path in (prefix + ".idx", prefix + ".bin"):
        if not os.path.isfile(path):
            raise ConfigError(f"--data-path {prefix!r}: {path} does not exist; give the prefix of a "
                              "Megatron indexed dataset (PREFIX.bin and PREFIX.idx)")
    with open(prefix + ".idx", "rb") as fh:
        if fh.read(len(IDX_MAGIC)) != IDX_MAGIC:  # (checked first: a failed IndexedDataset() errs again in __del__)
            raise ConfigError(f"--data-path {prefix!r} cannot be read as a Megatron indexed dataset "
                              f"({prefix}.idx does not start with {IDX_MAGIC!r})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns at import that Transformer Engine / Apex are absent
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    try:
        ds = IndexedDataset(prefix, mmap=True)
        dtype, lengths = np.dtype(ds.index.dtype), np.asarray(ds.sequence_lengths, dtype=np.int64)
    except (AssertionError, ValueError, OSError, struct.error, KeyError) as exc:
        raise ConfigError(f"--data-path {prefix!r} cannot be read as a Megatron indexed dataset "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    if not np.issubdtype(dtype, np.integer):
        raise ConfigError(f"--data-path {prefix!r} holds {dtype} values; token ids must be integers")
    total = int(lengths.sum())
    size = os.path.getsize(prefix + ".bin")
    if size < total * dtype.itemsize:
        raise ConfigError(f"--data-path {prefix!r}: {prefix}.bin has {size} bytes, its index lists "
                          f"{total} tokens of {dtype} ({total * dtype.itemsize} bytes); the file is truncated")
    if total == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(total,))


def make_source(path: str | None, vocab: int, seq: int, micro_batch_size: int, seed: int,
                data_path: str | None = None, micro_batches: int = 1) -> TokenSource:
    """``--data-path`` (indexed dataset), else ``--data-file``, else generated tokens."""
    if data_path:
        if path:
            raise ConfigError("give --data-path or --data-file, not both")
        return IndexedTokens(data_path, vocab, seq, micro_batch_size, seed, micro_batches)
    if path:
        return FileTokens(path, vocab, seq, micro_batch_size, seed)
    return SyntheticTokens(vocab, seq, micro_batch_size, seed)
