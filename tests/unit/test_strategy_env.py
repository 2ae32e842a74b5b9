"""ZeroPPStrategy reads `ZEROPP_*` variables as the Accelerate front does (`core.env`): a setting
left at its default takes the variable's value, one given in code wins, a typo is an error."""

from __future__ import annotations

import pytest

from lightning_zeropp import ZeroPPStrategy


def test_unset_arguments_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "4")
    monkeypatch.setenv("ZEROPP_SCHEDULE", "zeropp")
    monkeypatch.setenv("ZEROPP_NONFINITE", "skip")
    monkeypatch.setenv("ZEROPP_SPLIT", "trace")
    strategy = ZeroPPStrategy(num_microbatches=8)
    config = strategy.zeropp_config
    assert (config.pp_size, config.schedule, config.nonfinite) == (4, "zeropp", "skip")
    assert config.num_microbatches == 8 and strategy._split == "trace"


def test_arguments_given_in_code_win(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "4")
    monkeypatch.setenv("ZEROPP_SPLIT", "trace")
    strategy = ZeroPPStrategy(pp_size=2, split="stack")
    assert strategy.zeropp_config.pp_size == 2 and strategy._split == "stack"


def test_a_misspelt_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZ", "2")
    with pytest.raises(
        ValueError, match=r"unknown environment variable ZEROPP_PP_SIZ=.*ZEROPP_PP_SIZE"
    ):
        ZeroPPStrategy()
