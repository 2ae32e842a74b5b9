"""SIGTERM's handler only records the signal; the stop is agreed on and exits 143 named."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from lightning_zeropp.core.step.preempt import SIGTERM_EXIT_CODE, PreemptedError, Preemption


def test_the_handler_records_sigterm_and_the_stop_exits_143_naming_it() -> None:
    preemption = Preemption()
    before = signal.getsignal(signal.SIGTERM)
    preemption.install()
    try:
        assert preemption.flag(rank=1, world=4) == 4  # nothing received: no stop
        assert preemption.stopped(4, 4) is None
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not acted on: this test goes on
        assert preemption.received and preemption.flag(rank=1, world=4) == 1
        with pytest.raises(PreemptedError, match="stopped by SIGTERM") as stop:
            preemption.agree_now(torch.device("cpu"))  # one process: no collective
    finally:
        preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it replaced is back
    assert isinstance(stop.value, SystemExit) and stop.value.code == SIGTERM_EXIT_CODE == 143


def test_save_on_sigterm_is_a_checked_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_zeropp.core.settings.config import ZeroPPConfig
    from lightning_zeropp.fronts.settings import merge_settings

    assert ZeroPPConfig(save_on_sigterm=True).resolve(2).save_on_sigterm is True
    with pytest.raises(ValueError, match="save_on_sigterm='yes' must be True or False"):
        ZeroPPConfig(save_on_sigterm="yes").resolve(2)  # type: ignore[arg-type]
    monkeypatch.setenv("ZEROPP_SAVE_ON_SIGTERM", "1")
    assert merge_settings({}).config.save_on_sigterm is True
