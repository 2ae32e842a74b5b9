"""lightning_zeropp: ZeroPP (pipeline parallelism over FSDP2) for Lightning and plain torch.

Importing the package registers the Lightning strategy name "zeropp".
"""

from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
from lightning_zeropp.lightning import ZeroPPStrategy

__all__ = ["ZeroPPConfig", "ZeroPPEngine", "ZeroPPStrategy"]
