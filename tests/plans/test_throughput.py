"""The throughput model T(t, x): valid Megatron configurations, memory limits, Figure 4's shape."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plans.hardware import GPU_TYPES, gpu_type
from plans.models import GPT3, MODEL_LIMITS, ModelSpec, gpt3
from plans.throughput import Calibration, CostModel, calibrate, estimate, model_curve
from unicron.kernel.errors import InvalidRecord

A800 = gpu_type("A800-80GB")
COST = CostModel()


@pytest.mark.parametrize("size", list(GPT3))
def test_every_point_is_a_valid_megatron_configuration_that_fits(size: str) -> None:
    model = GPT3[size]
    curve = model_curve(model, A800, 8, COST)
    assert curve.gpus == tuple(sorted(curve.gpus))
    for x, flops, cfg in zip(curve.gpus, curve.flops, curve.configs, strict=True):
        assert cfg is not None
        assert cfg.gpus == x
        assert 8 % cfg.tp == 0 and model.heads % cfg.tp == 0
        assert model.layers % cfg.pp == 0
        assert model.global_batch % (cfg.dp * cfg.micro_batch) == 0
        assert cfg.memory_bytes <= A800.memory_bytes * (1 - COST.memory_reserve_fraction)
        assert flops == pytest.approx(model.flops_per_iteration / cfg.iteration_s)
        assert 0 < flops < x * A800.peak_flops


def test_memory_rules_out_large_models_on_few_gpus() -> None:
    curve = model_curve(GPT3["175B"], A800, 8, COST)
    # 175B parameters x 18 bytes of model state = 3.1 TB: at least 44 A800s before any activation.
    assert min(curve.gpus) >= 44
    assert curve.at(8) == 0.0
    assert model_curve(GPT3["1.3B"], A800, 8, COST).at(1) > 0


def test_recomputation_is_chosen_only_where_memory_forces_it() -> None:
    for size in GPT3:
        for cfg in model_curve(GPT3[size], A800, 8, COST).configs:
            assert cfg is not None
            if cfg.recompute:
                # The same layout without recomputation must not fit.
                row = np.array([[cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch, 0]])
                _, memory = estimate(GPT3[size], A800, 8, COST, row)
                assert memory[0] > A800.memory_bytes * (1 - COST.memory_reserve_fraction)


def test_gemm_efficiency_falls_with_tensor_parallelism() -> None:
    model = GPT3["1.3B"]
    rows = np.array([[tp, 1, 8 // tp, 4, 1] for tp in (1, 2, 4, 8)])
    iteration, _ = estimate(model, A800, 8, COST, rows)
    assert list(iteration) == sorted(iteration)  # same 8 GPUs, slower as TP grows


def test_throughput_is_not_monotonic_in_gpus_figure_4() -> None:
    dips = []
    for size in GPT3:
        curve = model_curve(GPT3[size], A800, 8, COST)
        for x in range(16, 129, 8):
            # Adding 8 GPUs can lower T: to zero where no configuration uses exactly x GPUs,
            # or below the previous point although both are runnable.
            if curve.at(x) < curve.at(x - 8):
                dips.append((size, x, curve.at(x) > 0))
    assert any(not runnable for *_, runnable in dips)
    assert any(runnable for *_, runnable in dips)
    # And the per-GPU efficiency of the best configuration falls with scale for the small model.
    small = model_curve(GPT3["1.3B"], A800, 8, COST)
    assert small.at(128) / 128 < small.at(8) / 8


def test_faster_gpus_give_more_throughput() -> None:
    model = GPT3["7B"]
    a800 = model_curve(model, GPU_TYPES["A800-80GB"], 8, COST).at(64)
    h100 = model_curve(model, GPU_TYPES["H100-80GB"], 8, COST).at(64)
    assert h100 > 2 * a800
    # More memory per GPU: the 70B model runs on fewer H200s (141 GB) than H100s (80 GB).
    assert min(model_curve(GPT3["70B"], GPU_TYPES["H200-141GB"], 8, COST).gpus) < min(
        model_curve(GPT3["70B"], GPU_TYPES["H100-80GB"], 8, COST).gpus
    )


def test_calibration_replaces_measured_points_and_scales_the_rest_by_the_nearest_ratio() -> None:
    curve = model_curve(GPT3["7B"], A800, 8, COST)
    measured = {16: 0.8 * curve.at(16), 128: 1.1 * curve.at(128)}
    cal = calibrate(curve, Calibration(measured))
    assert cal.at(16) == measured[16]
    assert cal.at(128) == measured[128]
    assert cal.at(8) == pytest.approx(0.8 * curve.at(8))
    assert cal.at(32) == pytest.approx(0.8 * curve.at(32))  # log2 distance 1 from 16, 2 from 128
    assert cal.at(64) == pytest.approx(1.1 * curve.at(64))
    assert cal.at(24) == 0.0  # still not a runnable count
    assert calibrate(curve, None) is curve


def test_bad_model_or_gpu_names_are_rejected_with_the_field() -> None:
    with pytest.raises(InvalidRecord, match="gpu_type"):
        gpu_type("V100")
    with pytest.raises(InvalidRecord, match=r"task\.model"):
        gpt3("3B")
    assert gpt3("gpt3-7b") is GPT3["7B"]
    with pytest.raises(InvalidRecord, match="calibration"):
        Calibration({0: 1.0})


def test_model_fields_are_bounded() -> None:
    """A global batch of 10**20 took the divisor enumeration hours; now every field has a bound."""
    with pytest.raises(InvalidRecord, match=r"model\.global_batch: must be at most 1048576"):
        ModelSpec(24, 2048, 16, 2048, 51200, 10**20)
    with pytest.raises(InvalidRecord, match=r"model\.hidden: must be at most"):
        ModelSpec(24, 10**400, 16, 2048, 51200, 512)
    lim = MODEL_LIMITS  # the largest of each is accepted
    big = ModelSpec(lim["layers"], lim["hidden"], lim["heads"], lim["seq_len"], lim["vocab"], lim["global_batch"])
    assert math.isfinite(big.flops_per_iteration)


def test_a_pinned_layout_leaves_only_data_parallelism_elastic() -> None:
    free = model_curve(GPT3["7B"], A800, 8, COST)
    pinned = model_curve(GPT3["7B"], A800, 8, COST, tp=4, pp=2, micro_batch=1)
    assert pinned.gpus and set(pinned.gpus) <= set(free.gpus)
    for x, cfg in zip(pinned.gpus, pinned.configs, strict=True):
        assert cfg is not None
        assert (cfg.tp, cfg.pp, cfg.micro_batch) == (4, 2, 1)
        assert pinned.at(x) <= free.at(x)  # a subset of the search can only be slower
