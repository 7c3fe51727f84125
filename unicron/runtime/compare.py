"""How close two sets of parameters are: the exactness measures of tests and benchmarks.

``max_rel_diff`` is the relative error of the whole parameter vector in the infinity norm:
``max|a - b| / max|b|`` over every element of every tensor. Element-wise relative error is not used:
some gradients are exactly zero in theory (e.g. the key bias of softmax attention) and pure rounding
noise in practice; Adam normalises that noise to steps of the learning rate's size, so such an element
differs between two summation orders by far more than its (tiny) magnitude. ``per_tensor`` shows it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _common(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    if set(a) != set(b):
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))[:5]}")
    return sorted(a)


def max_rel_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """max |a-b| / max |b| over all elements of all tensors (b is the reference)."""
    names = _common(a, b)
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in names)
    scale = max(float(b[k].double().abs().max()) for k in names)
    return diff / scale if scale else diff


def per_tensor(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """max |a-b| / max |b| of each tensor on its own."""
    out: dict[str, float] = {}
    for k in _common(a, b):
        d = float((a[k].double() - b[k].double()).abs().max())
        s = float(b[k].double().abs().max())
        out[k] = d / s if s else d
    return out


def bitwise_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in _common(a, b))


def load_params(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)
    return out
