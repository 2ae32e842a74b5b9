"""The core: pure torch. Knows nothing of Lightning, Accelerate or Hydra."""

from lightning_zeropp.core.config import ZeroPPConfig
from lightning_zeropp.core.engine import ZeroPPEngine
from lightning_zeropp.core.failure import FailureBoard, PeerFailedError, describe_rank
from lightning_zeropp.core.mesh import ParallelDims, build_mesh
from lightning_zeropp.core.schedule import SCHEDULES

__all__ = ["SCHEDULES", "ParallelDims", "ZeroPPConfig", "ZeroPPEngine", "build_mesh"]
__all__ += ["FailureBoard", "PeerFailedError", "describe_rank"]
