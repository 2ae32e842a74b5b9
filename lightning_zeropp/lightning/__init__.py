"""The Lightning front: `Trainer(strategy="zeropp")` or `Trainer(strategy=ZeroPPStrategy(...))`."""

from lightning_zeropp.lightning.strategy import ZeroPPPrecision, ZeroPPStrategy

__all__ = ["ZeroPPPrecision", "ZeroPPStrategy"]
