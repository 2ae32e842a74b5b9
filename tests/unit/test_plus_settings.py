"""ZeRO++'s and offload's settings: defaults, and a clear error for every value that cannot work."""

from __future__ import annotations

import pytest

from lightning_zeropp.core.measure.traffic import _share
from lightning_zeropp.core.settings.config import ZeroPPConfig, ZeroPPLayout
from lightning_zeropp.fronts.settings import merge_settings


def _resolve(world: int = 8, **settings) -> ZeroPPLayout:
    return ZeroPPConfig(**settings).resolve(world)


def test_defaults_are_off_and_node_size_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    settings = merge_settings({"dp_shard_size": 8, "pp_size": 1})  # what the fronts call
    cfg = settings.resolve(8)
    assert cfg.quantized_weights is cfg.quantized_gradients is cfg.hpz_partition_size is None
    assert (cfg.node_size, cfg.cpu_offload, cfg.gradient_error_feedback) == (4, False, False)
    # resolve itself is pure: the launcher's node size comes in as an argument, never read
    assert _resolve(dp_shard_size=8, pp_size=1).node_size == 8  # none given: one node
    assert ZeroPPConfig(pp_size=1).resolve(8, node_size=2).node_size == 2
    assert ZeroPPConfig(pp_size=1, node_size=4).resolve(8, node_size=2).node_size == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert merge_settings({"pp_size": 1}).resolve(8).node_size == 8  # no launcher: one node


def test_modes_are_parsed_and_error_feedback_defaults_on_for_int4():
    cfg = _resolve(pp_size=1, node_size=4, quantized_weights="INT8", quantized_gradients="int4")
    assert (cfg.quantized_weights, cfg.quantized_gradients) == ("int8", "int4")
    assert cfg.gradient_error_feedback is True
    cfg = _resolve(pp_size=1, node_size=4, quantized_weights="none", quantized_gradients="int8")
    assert cfg.quantized_weights is None and cfg.gradient_error_feedback is False


def test_hpz_inside_one_node_has_nothing_to_do():
    # pp 2 x dp_shard 2 on nodes of 4: every shard group lies inside a node.
    assert _resolve(pp_size=2, node_size=4, hpz_partition_size=4).hpz_partition_size is None
    assert _resolve(pp_size=1, node_size=4, hpz_partition_size=4).hpz_partition_size == 4


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"quantized_weights": "int4"}, r"quantized_weights='int4' is unknown"),
        ({"quantized_gradients": "bf16"}, r"quantized_gradients='bf16' is unknown"),
        ({"quantized_gradients": "fp8"}, r"quantized_gradients='fp8' is unknown"),
        ({"quant_block_size": 0}, r"quant_block_size=0 must be a positive integer"),
        ({"node_size": 3}, r"node_size=3 does not divide the world \(8 processes\)"),
        ({"node_size": 4, "hpz_partition_size": 3}, r"hpz_partition_size=3 must divide"),
        (
            {"node_size": 2, "hpz_partition_size": 4},
            r"hpz_partition_size=4 must divide dp_shard_size=8 and node_size=2",
        ),
        (
            {"node_size": 4, "dp_replicate_size": 2, "dp_shard_size": 4, "hpz_partition_size": 2},
            r"hpz_partition_size=2 with dp_replicate_size=2",
        ),
        (
            {
                "node_size": 4,
                "dp_replicate_size": 2,
                "dp_shard_size": 4,
                "quantized_gradients": "int8",
            },
            r"quantized_gradients='int8' with dp_replicate_size=2",
        ),
        ({"node_size": 4, "dp_shard_size": 8}, None),
        (
            {"quantized_weights": "int8", "gradient_error_feedback": True},
            r"gradient_error_feedback=True needs quantized_gradients",
        ),
    ],
)
def test_bad_settings_name_the_value_and_the_fix(settings, match):
    settings = {"pp_size": 1, **settings}
    if match is None:
        _resolve(**settings)
        return
    with pytest.raises(ValueError, match=match):
        _resolve(**settings)


def test_shard_groups_must_hold_whole_nodes_for_quantized_gradients():
    with pytest.raises(
        ValueError, match=r"dp_shard_size=6\) to hold whole nodes .* \(node_size=4\)"
    ):
        _resolve(world=12, pp_size=2, node_size=4, quantized_gradients="int8")


def test_direct_exchange_shares():
    # 4 ranks over 2 nodes, seen from one rank: 1 peer in its node, 2 in the other.
    assert _share("all_gather", 4, 2) == 2  # its input to each of them
    assert _share("reduce_scatter", 4, 2) == 0.5  # a quarter of its input to each
    assert _share("all_to_all", 4, 1) == 0.25
    assert _share("all_reduce", 4, 2) == 1.0
    assert _share("send", 2, 1) == 1.0
    assert _share("recv", 2, 1) == 0.0
    assert _share("all_gather", 4, 0) == 0.0


def test_switches_come_from_zeropp_variables(monkeypatch):
    from lightning_zeropp.core.settings.env import config_from_env

    monkeypatch.setenv("ZEROPP_QUANTIZED_GRADIENTS", "int4")
    monkeypatch.setenv("ZEROPP_HPZ_PARTITION_SIZE", "4")
    monkeypatch.setenv("ZEROPP_CPU_OFFLOAD", "true")
    cfg = config_from_env()
    assert (cfg.quantized_gradients, cfg.hpz_partition_size, cfg.cpu_offload) == ("int4", 4, True)
