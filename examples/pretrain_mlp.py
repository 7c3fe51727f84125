"""A plain PyTorch model trained through Unicron's in-place API (``unicron.runtime.pretrain``).

The job gives three functions, as it would to Megatron-LM's ``pretrain``; Unicron's runtime runs the
micro-batch loop, the backward, the gradient all-reduce over data-parallel ranks and AdamW, and when a
rank dies mid-iteration the survivors recompute its micro-batches and finish the iteration with the
exact gradient (a relaunched rank rejoins with the state of a live one). Nothing here handles failures.

* the model: an MLP regressor (``torch.nn.Sequential``), not a Megatron model;
* the forward step: mean squared error of one micro-batch;
* the data: micro-batch ``mb`` of ``iteration`` is drawn from a generator seeded by ``(seed,
  iteration, mb)`` only, so whichever rank computes it sees the same samples: the one rule the
  runtime asks of data (``unicron.runtime.data.IndexedTokens`` does the same for a Megatron indexed
  dataset).

Run it under Unicron (``docs/jobs.md``, "The in-place API")::

    {"name": "mlp", "command": ["python", "examples/pretrain_mlp.py", "--iterations", "200"],
     "min_gpus": 2, "recovery": "inprocess"}

The runtime's flags (``--global-batch-size``, ``--micro-batch-size``, ``--iterations``, ``--lr``,
``--ckpt``, ``--out-dir``, ...) and this script's own (``--width``, ``--depth``, ``--features``,
``--dtype``) are listed by ``python examples/pretrain_mlp.py --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import torch.nn.functional as F

from unicron.runtime import ConfigError, DataContext, ModelContext, ModelType, pretrain

DTYPES = {"float32": torch.float32, "float64": torch.float64}
Batch = tuple[torch.Tensor, torch.Tensor]


def add_mlp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("mlp")
    g.add_argument("--features", type=int, default=16, help="input features (default 16)")
    g.add_argument("--outputs", type=int, default=4, help="regression targets (default 4)")
    g.add_argument("--width", type=int, default=64, help="hidden units per layer (default 64)")
    g.add_argument("--depth", type=int, default=2, help="hidden layers (default 2)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (default float32)")
    return parser


class Regression:
    """Samples of ``y = sin(x @ A) + 0.1 * noise``, addressed by (iteration, micro-batch)."""

    def __init__(self, ctx: DataContext) -> None:
        args = ctx.args
        self.mbs, self.seed, self.dtype = ctx.micro_batch_size, ctx.seed, DTYPES[args.dtype]
        self.features, self.outputs = args.features, args.outputs
        self.teacher = torch.randn(args.features, args.outputs, generator=torch.Generator().manual_seed(7),
                                   dtype=self.dtype)

    def batch(self, iteration: int, mb: int) -> Batch:
        digest = hashlib.blake2b(f"{self.seed}:{iteration}:{mb}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        x = torch.randn(self.mbs, self.features, generator=g, dtype=self.dtype)
        noise = torch.randn(self.mbs, self.outputs, generator=g, dtype=self.dtype)
        return x, torch.sin(x @ self.teacher) + 0.1 * noise


def datasets_provider(ctx: DataContext) -> Regression:
    if min(ctx.args.features, ctx.args.outputs, ctx.args.width, ctx.args.depth) < 1:
        raise ConfigError("--features, --outputs, --width and --depth must be >= 1")  # one line, exit 2
    return Regression(ctx)


def model_provider(ctx: ModelContext) -> torch.nn.Module:
    args = ctx.args
    layers: list[torch.nn.Module] = []
    width_in = args.features
    for _ in range(args.depth):
        layers += [torch.nn.Linear(width_in, args.width), torch.nn.Tanh()]
        width_in = args.width
    layers.append(torch.nn.Linear(width_in, args.outputs))
    return torch.nn.Sequential(*layers).to(DTYPES[args.dtype])


def forward_step(batch: Batch, model: torch.nn.Module) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def main(argv: list[str] | None = None) -> int:
    return pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                    extra_args_provider=add_mlp_arguments, argv=argv, prog="pretrain_mlp")


if __name__ == "__main__":
    sys.exit(main())
