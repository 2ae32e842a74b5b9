"""lightning_zeropp: ZeroPP (pipeline parallelism over FSDP2) for Lightning and Accelerate."""

from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine

__all__ = ["ZeroPPConfig", "ZeroPPEngine"]
