"""What ranks compare before they build a layout: a setting written the same way on every rank
gives the same text on every rank (no process-specific address), so `agree` never refuses
ranks that agree; values that differ still differ."""

from __future__ import annotations

import torch

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.step.agree import settings_fields


def _split(model, n):  # a split function, as a user passes split=...
    return []


class _Opaque:  # an object with the default repr (it names its address)
    pass


def test_a_function_or_object_setting_reads_alike_in_every_process() -> None:
    # Two functions of the same name made by one factory (as two processes make them) and two
    # default-repr objects: the same text, as in two processes.
    def factory():
        def split(model, n):
            return []

        return split

    one = settings_fields(ZeroPPConfig(pp_size=2), split=factory(), init=_Opaque())
    two = settings_fields(ZeroPPConfig(pp_size=2), split=factory(), init=_Opaque())
    assert one == two
    assert "0x" not in one["split"] and "0x" not in one["init"]


def test_settings_that_differ_read_differently() -> None:
    assert settings_fields(ZeroPPConfig(pp_size=2)) != settings_fields(ZeroPPConfig(pp_size=4))
    a = settings_fields(ZeroPPConfig(), split=_split)
    b = settings_fields(ZeroPPConfig(), split="call")
    assert a["split"] != b["split"]
    assert settings_fields(ZeroPPConfig(param_dtype=torch.bfloat16))["param_dtype"] == (
        "torch.bfloat16"
    )
