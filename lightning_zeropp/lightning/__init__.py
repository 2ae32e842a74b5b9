"""The Lightning front: `Trainer(strategy="zeropp")` or `Trainer(strategy=ZeroPPStrategy(...))`;
`grad_norm`, Lightning's `grad_norm` over the whole pipelined model; `full_parameter` and
`param_norm`, a parameter's trained value and the weights' norms, read on every rank. Importing
it lets `MyModule.load_from_checkpoint` read a sharded checkpoint folder (`folder_load`)."""

# The strategy module first: importing Lightning runs the hook that imports it (see
# `lightning_zeropp/__init__.py`), which must find it already on its way.
from lightning_zeropp.lightning.strategy import ZeroPPStrategy  # isort: skip
from lightning_zeropp.lightning import folder_load
from lightning_zeropp.lightning.hooks import full_parameter, grad_norm, param_norm
from lightning_zeropp.lightning.precision import ZeroPPPrecision

folder_load.install()  # MyModule.load_from_checkpoint(sharded folder), in one process

__all__ = ["ZeroPPPrecision", "ZeroPPStrategy", "full_parameter", "grad_norm", "param_norm"]
