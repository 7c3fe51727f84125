"""``python -m unicron.runtime.train`` / ``unicron train``: managed training of a small Megatron GPT.

One user of :func:`unicron.runtime.pretrain`: a Megatron-core ``GPTModel`` (:mod:`unicron.runtime.model`),
its vocabulary-parallel cross-entropy as the forward step, and token data (generated, a file, or a
Megatron indexed dataset with ``--data-path``, :mod:`unicron.runtime.data`).

One process per rank, torchrun-style environment (set by the agent or :mod:`unicron.cluster.launch`):
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (the task's store sidecar,
:mod:`unicron.runtime.store`), and optionally ``UNICRON_AGENT_SOCKET``, ``UNICRON_TASK``,
``UNICRON_GENERATION``, ``UNICRON_NODE``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from unicron.runtime import api
from unicron.runtime.api import Providers, Rank
from unicron.runtime.data import TokenSource, make_source
from unicron.runtime.flags import EXIT_CONFIG, add_gpt_arguments
from unicron.runtime.job import DataContext, ModelContext
from unicron.runtime.model import ModelConfig, ModelType, build_gpt, lm_loss, tp_group_of

__all__ = ["EXIT_CONFIG", "PROG", "build", "main", "run"]

PROG = "unicron train"
Tokens = tuple[torch.Tensor, torch.Tensor]


def model_config(args: argparse.Namespace) -> ModelConfig:
    cfg = ModelConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
        dtype=args.dtype, dropout=args.dropout, init_seed=args.init_seed,
    )
    cfg.validate(args.tp)
    return cfg


def datasets_provider(ctx: DataContext) -> TokenSource:
    """Token windows for the GPT; the model's flags are checked here, before the rank connects."""
    args = ctx.args
    model_config(args)
    return make_source(args.data_file or None, args.vocab, args.seq, ctx.micro_batch_size, ctx.seed,
                       data_path=args.data_path or None, micro_batches=ctx.micro_batches)


def model_provider(ctx: ModelContext) -> torch.nn.Module:
    model: torch.nn.Module = build_gpt(model_config(ctx.args), ctx.tp_group)
    return model


def forward_step(batch: Tokens, model: torch.nn.Module) -> torch.Tensor:
    # the data source yields CPU tensors; the model is wherever --device put it (Megatron's get_batch
    # moves its batch to the GPU the same way)
    device = next(model.parameters()).device
    tokens, labels = (t.to(device) for t in batch)
    return lm_loss(model, tokens, labels, tp_group_of(model))


GPT = Providers(datasets_provider, model_provider, forward_step)


def build(args: argparse.Namespace) -> Rank[Tokens]:
    """The GPT rank from parsed flags (:func:`unicron.runtime.api.build`); the benchmark worker uses it."""
    return api.build(args, GPT, ModelType.encoder_or_decoder)


def run(args: argparse.Namespace) -> int:
    return api.run(args, GPT, ModelType.encoder_or_decoder, prog=PROG)


def main(argv: Sequence[str] | None = None) -> int:
    return api.pretrain(
        datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
        extra_args_provider=add_gpt_arguments, argv=argv, prog="python -m unicron.runtime.train",
    )


if __name__ == "__main__":
    sys.exit(main())
