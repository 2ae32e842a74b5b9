"""The planner: what a layout costs before it runs (`plan.memory`: model state and gathered
weights per rank; `plan.activations`: saved activations per pipeline rank; `plan.comm`: each
step's collectives and messages per rank).

It reads the model the way the engine splits it (`core.split`) and the layout the way the engine
resolves it (`ZeroPPConfig`), so its figures are those of the run it predicts.
"""

from lightning_zeropp.plan.activations import activation_peaks, stage_activation_bytes
from lightning_zeropp.plan.comm import predict_comm
from lightning_zeropp.plan.hardware import Hardware
from lightning_zeropp.plan.memory import RankMemoryPlan, predict_memory, stage_parameter_shapes
from lightning_zeropp.plan.steptime import StepTimePlan, predict_step_time

__all__ = [
    "Hardware",
    "StepTimePlan",
    "predict_step_time",
    "RankMemoryPlan",
    "activation_peaks",
    "predict_comm",
    "predict_memory",
    "stage_activation_bytes",
    "stage_parameter_shapes",
]
