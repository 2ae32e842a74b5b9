"""The planner: what a layout costs before it runs, and which layout to run.

- `plan.profile`: the model on the meta device, block by block (saved bytes, FLOPs, outputs);
- `plan.loss_chunk`: whether the run computes its head and loss in chunks (`loss_chunk`), as
  the engine decides: then the last stage keeps the hidden states, not the logits;
- `plan.memory`, `plan.activations`: model state, gathered weights and activations per rank;
- `plan.comm`: each step's collectives and messages per rank;
- `plan.stage_costs`, `plan.simulate`, `plan.steptime`: each stage's costs, and a step replayed
  per rank against its dependencies, priced by `plan.hardware`;
- `plan.plus`: ZeRO++'s traffic and memory per FSDP unit;
- `plan.megatron`: Megatron-style TP x PP x DP, priced the same way, for comparisons;
- `plan.published`: the published runs the cluster files' efficiency ranges come from;
- `plan.search`: the layouts that fit, fastest first; `python -m lightning_zeropp.plan` (what
  it prints of a layout: `plan.report`).

It reads the model the way the engine splits it (`core.split`) and the layout the way the engine
resolves it (`ZeroPPConfig`), so its figures are those of the run it predicts.
"""

from lightning_zeropp.plan.activations import activation_peaks, stage_activation_bytes
from lightning_zeropp.plan.comm import predict_comm
from lightning_zeropp.plan.hardware import Hardware
from lightning_zeropp.plan.megatron import ThreeD, predict_3d
from lightning_zeropp.plan.memory import RankMemoryPlan, predict_memory, stage_parameter_shapes
from lightning_zeropp.plan.peaks import rank_memory
from lightning_zeropp.plan.search import Candidate, search
from lightning_zeropp.plan.steptime import StepTimePlan, predict_range, predict_step_time

__all__ = [
    "Candidate",
    "Hardware",
    "RankMemoryPlan",
    "StepTimePlan",
    "ThreeD",
    "activation_peaks",
    "predict_3d",
    "predict_comm",
    "predict_memory",
    "predict_range",
    "predict_step_time",
    "rank_memory",
    "search",
    "stage_activation_bytes",
    "stage_parameter_shapes",
]
