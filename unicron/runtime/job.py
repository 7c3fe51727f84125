"""What a training job gives the runtime: its model, its forward step and its micro-batches.

The user's side of :func:`unicron.runtime.pretrain` (``docs/runtime.md``, "The in-place API"). The
runtime owns everything else (the micro-batch loop, backward, gradient reduction, redistribution,
regroups, checkpoints, reports), so these three are all it calls:

* ``MicroBatches.batch(iteration, mb)``: micro-batch ``mb`` (of ``B``) of ``iteration``. It must be a
  function of those two numbers only, never of the rank asking: after a failure any live replica may
  compute any micro-batch, and the gradient is exact only if it sees the same data;
* the model provider, called once per rank with a :class:`ModelContext` (the tensor-parallel group to
  build a Megatron-core model on) after the parameter seed was set, so every replica starts equal;
* the forward step ``forward_step(batch, model) -> loss``: the mean loss of the micro-batch, a scalar
  tensor the runtime back-propagates.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from unicron.kernel.errors import ConfigError
from unicron.runtime.comm import CommGroup

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

BatchT = TypeVar("BatchT")
BatchT_co = TypeVar("BatchT_co", covariant=True)


class MicroBatches(Protocol[BatchT_co]):
    """Training data addressed by micro-batch identity (``unicron.runtime.data`` has token sources)."""

    def batch(self, iteration: int, mb: int) -> BatchT_co:
        """Micro-batch ``mb`` (0 <= mb < B) of ``iteration``: the same on every rank that asks."""
        ...


@dataclass(frozen=True)
class DataContext:
    """What the datasets provider is told (Megatron passes ``train_val_test_num_samples``)."""

    #: the parsed command line (the runtime's flags and the job's own, ``extra_args_provider``)
    args: argparse.Namespace
    #: samples per micro-batch
    micro_batch_size: int
    #: micro-batches per iteration (B = global batch size / micro-batch size)
    micro_batches: int
    #: iterations to run (0: until stopped)
    iterations: int
    #: the data seed (``--seed``): order of samples and per-micro-batch RNG
    seed: int
    #: tensor-parallel size of the job (ranks of a replica see the same micro-batches)
    tp: int


@dataclass(frozen=True)
class ModelContext:
    """What the model provider is given. There is no pipeline parallelism: the model is whole
    (Megatron's ``pre_process`` and ``post_process`` are both true)."""

    #: the parsed command line
    args: argparse.Namespace
    #: this replica's tensor-parallel group (one rank with ``--tp 1``); the runtime re-forms it after a
    #: failure and rebinds every reference the model holds (module attributes, ProcessGroupCollections)
    tp_group: CommGroup
    pre_process: bool = True
    post_process: bool = True

    def pg_collection(self) -> ProcessGroupCollection:
        """Megatron-core's ``ProcessGroupCollection`` for a model on :attr:`tp_group` (pass it as
        ``pg_collection=``; the dimensions the runtime does not split get a one-rank group)."""
        from unicron.runtime.model import pg_collection

        return pg_collection(self.tp_group)  # (imported here: Megatron-core takes seconds to import)


ModelProvider = Callable[[ModelContext], torch.nn.Module]
ForwardStep = Callable[[BatchT, torch.nn.Module], torch.Tensor]


@dataclass(frozen=True)
class Job(Generic[BatchT]):
    """A job's three parts, resolved: what :class:`~unicron.runtime.scheduler.Trainer` runs."""

    model_provider: ModelProvider
    forward_step: ForwardStep[BatchT]
    data: MicroBatches[BatchT]
    args: argparse.Namespace = field(default_factory=argparse.Namespace)
    #: seed set before the model provider runs, so every replica builds the same parameters
    init_seed: int = 1234

    def build_model(self, tp_group: CommGroup) -> torch.nn.Module:
        torch.manual_seed(self.init_seed)
        model = self.model_provider(ModelContext(self.args, tp_group))
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"model_provider returned {type(model).__name__}; it must return a torch.nn.Module "
                "(a Megatron-core model is one)"
            )
        return model

    def loss(self, model: torch.nn.Module, iteration: int, mb: int) -> torch.Tensor:
        """The forward step on micro-batch ``mb`` of ``iteration``."""
        return self.forward(model, self.data.batch(iteration, mb))

    def forward(self, model: torch.nn.Module, batch: BatchT) -> torch.Tensor:
        """The forward step on a fetched micro-batch (the trainer fetches it in the data phase)."""
        loss = self.forward_step(batch, model)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise ConfigError(
                "forward_step_func must return the micro-batch's loss as a scalar tensor with a graph "
                f"(got {_describe(loss)})"
            )
        return loss


def grad_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    """The one dtype of a model's trainable parameters (the flat gradient buffer has one dtype)."""
    dtypes = sorted({str(p.dtype) for p in params})
    if not params:
        raise ConfigError("the model has no trainable parameters")
    if len(dtypes) > 1:
        raise ConfigError(f"the model's trainable parameters mix dtypes {dtypes}; cast the model to one "
                          "(e.g. model.to(torch.float32))")
    return params[0].dtype


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        grad = "with" if value.requires_grad else "without"
        return f"a tensor of shape {tuple(value.shape)} {grad} grad"
    return type(value).__name__
