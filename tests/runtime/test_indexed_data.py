"""Megatron-core indexed datasets (``.bin``/``.idx``) as training data: files written by Megatron-core's own
``IndexedDatasetBuilder``, read by ``IndexedTokens``, addressed by (iteration, micro-batch) only; bad files
are refused with one line naming the path; ``unicron train --data-path`` trains on one."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.runtime.conftest import Runner, train_args
from unicron.kernel.errors import ConfigError
from unicron.runtime import train
from unicron.runtime.data import IndexedTokens, make_source
from unicron.runtime.flags import add_arguments
from unicron.runtime.job import DataContext

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

SEQ, MBS, B = 8, 2, 4


def build(prefix: Path, docs: list[list[int]], dtype: type[np.number] = np.uint16) -> tuple[str, np.ndarray]:
    """Write ``docs`` with Megatron-core's builder; returns the prefix and the token stream."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix), np.concatenate([np.asarray(d) for d in docs])


def corpus(tmp_path: Path, dtype: type[np.number] = np.uint16) -> tuple[str, np.ndarray]:
    rng = np.random.default_rng(0)
    docs = [[*rng.integers(1, 128, size=n).tolist(), 0] for n in (30, 7, 51, 12, 40)]  # 0: end of document
    return build(tmp_path / "corpus", docs, dtype)


def test_samples_are_megatron_windows_in_a_seeded_order_addressed_by_micro_batch(tmp_path: Path) -> None:
    prefix, stream = corpus(tmp_path)
    src = IndexedTokens(prefix, vocab=128, seq=SEQ, micro_batch_size=MBS, seed=5, micro_batches=B)
    n = (len(stream) - 1) // SEQ
    assert src.samples == n
    starts = set()
    for number in range(n):  # one pass: every window exactly once, each a slice of the stream
        window = src.sample(number)
        start = next(s * SEQ for s in range(n) if np.array_equal(stream[s * SEQ : s * SEQ + SEQ + 1], window))
        starts.add(start)
    assert len(starts) == n
    tokens, labels = src.batch(3, 1)
    assert tokens.shape == labels.shape == (MBS, SEQ) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    first = (3 * B + 1) * MBS  # sample numbers of (iteration 3, micro-batch 1)
    assert torch.equal(tokens[0], torch.from_numpy(src.sample(first)[:-1]))
    again = IndexedTokens(prefix, vocab=128, seq=SEQ, micro_batch_size=MBS, seed=5, micro_batches=B)
    assert torch.equal(again.batch(3, 1)[0], tokens)  # a function of (iteration, mb): any rank, any process
    other = IndexedTokens(prefix, vocab=128, seq=SEQ, micro_batch_size=MBS, seed=6, micro_batches=B)
    assert [other.sample(i).tolist() for i in range(n)] != [src.sample(i).tolist() for i in range(n)]
    # the next pass is another permutation of the same windows
    assert sorted(src.sample(n + i).tolist() for i in range(n)) == sorted(src.sample(i).tolist() for i in range(n))


def test_bad_files_get_one_line_naming_the_path(tmp_path: Path) -> None:
    def refused(prefix: str, match: str, **kw: int) -> None:
        with pytest.raises(ConfigError, match=match) as err:
            IndexedTokens(prefix, vocab=kw.get("vocab", 128), seq=kw.get("seq", SEQ), micro_batch_size=MBS,
                          seed=1, micro_batches=B)
        assert "\n" not in str(err.value) and prefix in str(err.value)

    refused(str(tmp_path / "missing"), r"missing\.idx does not exist")
    prefix, _ = corpus(tmp_path)
    refused(prefix, "holds 145 tokens; a sample needs seq\\+1=201", seq=200)
    floats, _ = build(tmp_path / "floats", [[1, 2, 3, 4]], np.float32)
    refused(floats, "float32 values; token ids must be integers")
    (tmp_path / "junk.idx").write_bytes(b"not an index at all")
    (tmp_path / "junk.bin").write_bytes(b"\0" * 64)
    refused(str(tmp_path / "junk"), "cannot be read as a Megatron indexed dataset .*does not start with")
    cut, _ = build(tmp_path / "cut", [list(range(50))])
    Path(f"{cut}.bin").write_bytes(Path(f"{cut}.bin").read_bytes()[:40])
    refused(cut, "the file is truncated")
    big, _ = build(tmp_path / "big", [[500] * 40], np.int32)
    src = IndexedTokens(big, vocab=128, seq=SEQ, micro_batch_size=MBS, seed=1, micro_batches=B)
    with pytest.raises(ConfigError, match="token id 500 is outside the vocabulary \\(--vocab 128\\)"):
        src.batch(0, 0)
    with pytest.raises(ConfigError, match="not both"):
        make_source("x.npy", 128, SEQ, MBS, 1, data_path=prefix)


def test_unicron_train_data_path_reads_the_indexed_dataset(tmp_path: Path) -> None:
    prefix, _ = corpus(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data-path", prefix, "--seq", str(SEQ), "--micro-batch-size", str(MBS)])
    ctx = DataContext(args=args, micro_batch_size=MBS, micro_batches=B, iterations=1, seed=1, tp=1)
    src = train.datasets_provider(ctx)
    assert isinstance(src, IndexedTokens) and src.path == prefix and src.micro_batches == B


def test_unicron_train_trains_on_an_indexed_dataset(runner: Runner, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    prefix, _ = build(tmp_path / "text", [list(rng.integers(0, 128, size=300)) for _ in range(4)])
    done = runner.run(2, train_args(2, "float32", False, "--data-path", prefix))
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    losses = done.result(0)["losses"]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert done.result(1)["losses"] == losses  # both replicas trained on the same global batches
