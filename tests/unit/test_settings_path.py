"""One settings path: where a setting is written, and one precedence in every front.

Adding a setting to ZeroPP means writing it in four places, which this test checks for every
field of `ZeroPPConfig`:
1. the field of `ZeroPPConfig` (`core/settings/config.py`), the request a user writes;
2. its typed field in `ZeroPPLayout` (`core/settings/layout.py`) and its check in
   `core/settings/resolve.py`;
3. its key, with the default and a comment, in `conf/parallel/base.yaml` (the recipes);
4. its words (default and meaning) in `core/settings/reference.py`, from which the docs site
   renders the settings page.
Everything else follows from the field: its `ZEROPP_*` variable and parser (from the field's
type), `ZeroPPStrategy`'s and `ZeroPPPlugin`'s keyword arguments and signatures, and the
checkpoint metadata.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import typing
from pathlib import Path

import pytest
import yaml

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.accelerate import ZeroPPPlugin
from lightning_zeropp.accelerate.build import _settings
from lightning_zeropp.core.settings import env
from lightning_zeropp.core.settings.config import ZeroPPConfig, ZeroPPLayout
from lightning_zeropp.core.settings.reference import SETTINGS_REFERENCE, settings_table
from lightning_zeropp.fronts.settings import merge_settings

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(ZeroPPConfig)]


def test_every_setting_is_written_in_the_four_places():
    layout = {f.name for f in dataclasses.fields(ZeroPPLayout)} - {"world_size"}
    assert layout == set(FIELDS), "ZeroPPLayout and ZeroPPConfig must have the same fields"
    base = yaml.safe_load((ROOT / "conf/parallel/base.yaml").read_text())
    for name in FIELDS:
        assert name in base, f"conf/parallel/base.yaml lacks {name}"
    assert set(SETTINGS_REFERENCE) == set(FIELDS), "core/settings/reference.py: one row per field"
    # the docs page's table, as the site renders it: every field once, in the config's order
    rows = re.findall(r"^\| `([a-z_]+)` \|", settings_table(FIELDS), flags=re.M)
    assert rows == FIELDS
    assert "<!-- settings-table -->" in (ROOT / "docs/settings.md").read_text()


def test_everything_else_follows_from_the_field():
    for name in FIELDS:
        assert f"ZEROPP_{name.upper()}" in env.CONFIG_VARS
        assert name in inspect.signature(ZeroPPStrategy).parameters
        assert name in inspect.signature(ZeroPPPlugin).parameters


def test_a_resolved_layout_is_frozen_and_decided():
    layout = ZeroPPConfig(schedule="zeropp").resolve(8, node_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.pp_size = 4  # type: ignore[misc]
    hints = typing.get_type_hints(ZeroPPLayout)
    optional = {n for n, h in hints.items() if type(None) in typing.get_args(h)}
    # None is a decision only where it means "off" or "no cast": never an unresolved size.
    assert optional == {
        "param_dtype", "reduce_dtype", "split_points", "unit_size",
        "quantized_weights", "hpz_partition_size", "quantized_gradients",
        "recompute_ranks",  # None: every pipeline rank recomputes as activation_checkpointing says
        "loss_chunk",  # None: 1024 tokens where the run can chunk, whole logits where it cannot
    }  # fmt: skip
    assert layout.resolve(8) is layout
    with pytest.raises(ValueError, match="resolved for 8 processes"):
        layout.resolve(4)


def test_one_precedence_in_every_front(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "4")
    monkeypatch.setenv("ZEROPP_SPLIT", "trace")
    lightning = ZeroPPStrategy(pp_size=2, split="auto")  # code wins, "auto" included
    plugin = ZeroPPPlugin(pp_size=2, split="auto").run_settings()
    merged = merge_settings({"pp_size": 2}, split="auto")
    for settings in (lightning._settings, plugin, merged):
        assert (settings.config.pp_size, settings.split) == (2, "auto")
    lightning = ZeroPPStrategy()  # left out: the variables
    plugin = ZeroPPPlugin().run_settings()
    for settings in (lightning._settings, plugin):
        assert (settings.config.pp_size, settings.split) == (4, "trace")


def test_a_bad_value_from_a_variable_names_it_in_every_front(monkeypatch):
    monkeypatch.setenv("ZEROPP_PP_SIZE", "3")
    for settings in (ZeroPPStrategy()._settings, ZeroPPPlugin(schedule="1f1b").run_settings()):
        with pytest.raises(ValueError, match=r"settings from the environment: ZEROPP_PP_SIZE=3"):
            settings.resolve(4)
    with pytest.raises(ValueError) as err:  # given in code: no variable to name
        ZeroPPPlugin(pp_size=3).run_settings().resolve(4)
    assert "environment" not in str(err.value)


def test_only_overridden_variables_are_reported_ignored(monkeypatch, caplog):
    monkeypatch.setenv("ZEROPP_SCHEDULE", "gpipe")
    with caplog.at_level(logging.WARNING):
        # ZeroPPAccelerator's path: the plugin's settings over the variables, nothing ignored
        used = _settings(ZeroPPPlugin(pp_size=2).run_settings(), None)
    assert used.config.schedule == "gpipe" and "ignoring" not in caplog.text
    with caplog.at_level(logging.WARNING):
        # a whole ZeroPPConfig in code: the variables are ignored, and said to be
        _settings(ZeroPPConfig(pp_size=2), None)
    assert "ignoring ZEROPP_SCHEDULE" in caplog.text
