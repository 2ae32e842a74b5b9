"""ZeroPPStrategy reads `ZEROPP_*` variables as the Accelerate front does (`core.settings.env`): a setting
left out takes the variable's value, one given in code wins (even when it equals the default), a
typo is an error, and a bad value from a variable is reported with the variable."""

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
    # "auto" written in code is a choice too: it wins over ZEROPP_SPLIT (it used to lose).
    assert ZeroPPStrategy(split="auto")._split == "auto"


def test_an_argument_equal_to_the_default_still_wins(monkeypatch):
    monkeypatch.setenv("ZEROPP_NONFINITE", "skip")
    monkeypatch.setenv("ZEROPP_SCHEDULE", "gpipe")
    monkeypatch.setenv("ZEROPP_DP_REPLICATE_SIZE", "2")
    config = ZeroPPStrategy(nonfinite="raise", schedule="1f1b", dp_replicate_size=1).zeropp_config
    assert (config.nonfinite, config.schedule, config.dp_replicate_size) == ("raise", "1f1b", 1)


def test_a_bad_value_from_a_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "3")
    strategy = ZeroPPStrategy()
    with pytest.raises(
        ValueError,
        match=r"pp_size \(3\) .* but the world has 4 .*\(settings from the environment: "
        r"ZEROPP_PP_SIZE=3 \(pp_size\)\)",
    ):
        strategy._settings.resolve(4)


def test_a_misspelt_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZ", "2")
    with pytest.raises(
        ValueError, match=r"unknown environment variable ZEROPP_PP_SIZ=.*ZEROPP_PP_SIZE"
    ):
        ZeroPPStrategy()


def test_every_config_setting_is_a_strategy_argument():
    import dataclasses
    import inspect

    from lightning_zeropp.core.settings.config import ZeroPPConfig

    arguments = set(inspect.signature(ZeroPPStrategy.__init__).parameters)
    missing = {f.name for f in dataclasses.fields(ZeroPPConfig)} - arguments
    assert not missing, f"ZeroPPStrategy lacks {sorted(missing)}"
    strategy = ZeroPPStrategy(quantized_weights="int8", hpz_partition_size=2, node_size=2)
    config = strategy.zeropp_config
    assert (config.quantized_weights, config.hpz_partition_size) == ("int8", 2)


def test_the_signature_carries_types_that_tools_need_not_resolve():
    """Signature readers (LightningCLI's jsonargparse) get each setting's type as a type: under
    postponed annotations the dataclass holds strings, which jsonargparse before 4.53 could not
    read, so it dropped every setting and refused `--trainer.strategy.pp_size=2`."""
    import inspect

    from lightning_zeropp.fronts.settings import FIELDS

    params = inspect.signature(ZeroPPStrategy.__init__).parameters
    strings = [n for n in FIELDS if isinstance(params[n].annotation, str)]
    assert not strings, f"string annotations: {strings}"
    assert params["pp_size"].annotation == (int | None)
    assert params["dp_replicate_size"].annotation == (int | None)  # None: not given


def test_lightning_cli_takes_the_settings(tmp_path):
    """`LightningCLI --trainer.strategy=... --trainer.strategy.pp_size=2`, with the installed
    jsonargparse (the dev extra's lower bound is the oldest the supported litgpt allows)."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    args = [
        "--trainer.strategy=lightning_zeropp.ZeroPPStrategy",
        "--trainer.strategy.pp_size=2",
        "--trainer.strategy.param_dtype=bf16",
        "--trainer.strategy.activation_checkpointing=true",
        "--trainer.strategy.schedule=zeropp",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
    ]
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroPPStrategy)
    config = strategy.zeropp_config
    assert (config.pp_size, config.param_dtype, config.schedule) == (2, "bf16", "zeropp")
    assert config.activation_checkpointing is True


def test_the_config_stays_as_given_and_the_layout_waits_for_setup(monkeypatch):
    """`zeropp_config` is the user's settings (one type, always); the resolved `layout` is set
    at setup_environment, when the world size is known."""
    from lightning_zeropp.core.settings.config import ZeroPPConfig

    monkeypatch.setenv("ZEROPP_PP_SIZE", "2")
    strategy = ZeroPPStrategy(num_microbatches=4)
    assert type(strategy.zeropp_config) is ZeroPPConfig and strategy.layout is None
    layout = strategy.zeropp_config.resolve(4)
    assert (layout.pp_size, layout.dp_size, layout.num_microbatches) == (2, 2, 4)
