"""The planner's public surface, for the coordinator and the CLI. Keep it small and stable."""

from plans.baselines import BASELINES, EquallyPlanner, SizedPlanner, WeightedPlanner
from plans.hardware import GPU_TYPES, GpuType, gpu_type
from plans.lookup import LookupTable
from plans.models import GPT3, ModelSpec, gpt3
from plans.planner import Planner, WafPlanner
from plans.problem import ClusterSpec, TaskDemand, runs_nowhere, unmet_minimums
from plans.result import PlanResult, evaluate
from plans.throughput import Calibration, CostModel, ParallelConfig, ThroughputCurve
from plans.waf import ReliabilityModel

__all__ = [
    "BASELINES",
    "GPT3",
    "GPU_TYPES",
    "Calibration",
    "ClusterSpec",
    "CostModel",
    "EquallyPlanner",
    "GpuType",
    "LookupTable",
    "ModelSpec",
    "ParallelConfig",
    "PlanResult",
    "Planner",
    "ReliabilityModel",
    "SizedPlanner",
    "TaskDemand",
    "ThroughputCurve",
    "WafPlanner",
    "WeightedPlanner",
    "evaluate",
    "gpt3",
    "gpu_type",
    "runs_nowhere",
    "unmet_minimums",
]
