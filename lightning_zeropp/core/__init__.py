"""The core: pure torch. Knows nothing of Lightning, Accelerate, transformers or Hydra.

Rooms, in build order (each imports only rooms below it; `docs/architecture.md` has the map):
`settings/` -> `schedule/` -> `mesh.py`, `shard/` -> `split/`, `step/`, `measure/` ->
`weights/` -> `engine_build.py`, `engine_schedules.py`, `engine_reports.py` -> `engine.py`;
`_torch_private/` is the one home of torch's private names.
"""

# First, before any other torch use: refuses a torch release outside the supported range.
from lightning_zeropp.core import _torch_private  # noqa: F401  # isort: skip
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.mesh import ParallelDims, build_mesh
from lightning_zeropp.core.schedule.build import SCHEDULES
from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.step.failure import (
    FailureBoard,
    PeerFailedError,
    describe_rank,
)

__all__ = ["SCHEDULES", "ParallelDims", "ZeroPPConfig", "ZeroPPEngine", "build_mesh"]
__all__ += ["FailureBoard", "PeerFailedError", "describe_rank"]
