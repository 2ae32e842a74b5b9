"""Settings and `ZEROPP_*` variables not in test_config.py / test_accelerate.py's tables: each
mistake is a ValueError naming the value and the fix, raised where every rank checks it alone."""

from __future__ import annotations

import pytest

from lightning_zeropp import ZeroPPConfig, ZeroPPStrategy
from lightning_zeropp.accelerate.build import _settings
from lightning_zeropp.accelerate.build_checks import resolve_layout
from lightning_zeropp.core.settings import env


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(reduce_dtype="bf32"), r"reduce_dtype='bf32' is not a known dtype; use one of"),
        (dict(param_dtype="int8"), r"param_dtype='int8' is not a known dtype"),
        (dict(dp_replicate_size=0), r"dp_replicate_size=0 must be a positive integer"),
        (dict(num_microbatches=0), r"num_microbatches=0 must be a positive integer"),
        (dict(num_microbatches=2.0), r"num_microbatches=2.0 must be a positive integer"),
        (dict(pp_size="2"), r"pp_size='2' must be a positive integer"),  # a YAML string
        (dict(schedule="interleaved_1f1b", num_chunks=0), r"num_chunks=0 must be a positive"),
        (dict(schedule="zeropp", unit_size=0), r"unit_size=0 must be a positive integer"),
        (
            dict(pp_size=2, dp_shard_size=2, dp_replicate_size=2),
            r"pp_size \(2\) x dp_replicate_size \(2\) x dp_shard_size \(2\) = 8, but the world "
            r"has 4 processes; choose sizes",
        ),
        (
            dict(schedule="dualpipev", pp_size=2, num_microbatches=1),
            r"num_microbatches=1 is too few for schedule='dualpipev' with pp_size=2",
        ),
        (
            dict(schedule="zbv", pp_size=2, split_backward=True),
            r"split_backward=True applies to schedule='zeropp' only \(got schedule='zbv'\)",
        ),
        (dict(schedule=None), r"schedule=None is unknown; choose one of"),
        (dict(pp_size=2, split_points=["a"]), r"split_points=\['a'\] must be a list of integer"),
    ],
)
def test_more_bad_settings_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs).resolve(4)


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        (
            {"ZEROPP_RESHARD_AFTER_FORWARD": "maybe"},
            r"ZEROPP_RESHARD_AFTER_FORWARD='maybe' is not a boolean; use one of",
        ),
        ({"ZEROPP_NUM_CHUNKS": "1.5"}, r"ZEROPP_NUM_CHUNKS='1.5' is not an integer"),
        (
            {"ZEROPP_pp_size": "2"},  # the right name in the wrong case
            r"unknown environment variable ZEROPP_pp_size='2'; did you mean ZEROPP_PP_SIZE\? ",
        ),
    ],
)
def test_more_bad_variables_are_named(environ, match):
    with pytest.raises(ValueError, match=match):
        env.config_from_env(environ)


def test_a_bad_policy_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("ZEROPP_ACTIVATION_CHECKPOINTING", "some")
    with pytest.raises(
        ValueError,
        match=r"activation_checkpointing='some' is unknown.*ZEROPP_ACTIVATION_CHECKPOINTING=some",
    ):
        resolve_layout(_settings(None, None), 4)


def test_lightning_refuses_a_misspelt_variable_even_when_code_sets_everything(monkeypatch):
    monkeypatch.setenv("ZEROPP_SCHEDUEL", "gpipe")
    with pytest.raises(ValueError, match=r"ZEROPP_SCHEDUEL='gpipe'; did you mean ZEROPP_SCHEDULE"):
        ZeroPPStrategy(pp_size=2, dp_shard_size=2, schedule="gpipe", num_microbatches=4)
    monkeypatch.delenv("ZEROPP_SCHEDUEL")
    monkeypatch.setenv("ZEROPP_SPLIT", "")
    with pytest.raises(ValueError, match=r"ZEROPP_SPLIT is set but empty"):
        ZeroPPStrategy()


def test_strategy_settings_checked_at_construction():
    with pytest.raises(ValueError, match=r"split='calll' is unknown; use 'auto', 'call'"):
        ZeroPPStrategy(split="calll")
    from lightning_zeropp.lightning.network import Network
    from lightning_zeropp.models.lit_gpt import LitGPT

    with pytest.raises(ValueError, match=r"optimizer='sgdd' is unknown; use one of"):
        LitGPT(optimizer="sgdd")
    with pytest.raises(
        ValueError,
        match=r"module_name='modle' is not a submodule of LitGPT, whose submodules with parameters are \['model'\]; pass",
    ):
        Network.of(LitGPT(), "modle")


def test_core_step_mistakes_are_named(group):
    """A loss_fn returning per-token losses; targets of other rows than the inputs."""
    import torch
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core.engine import ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=16, seq_len=8, dim=16, num_heads=2, num_layers=2))
    per_token = lambda logits, y: F.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), y.flatten(), reduction="none"
    )
    engine = ZeroPPEngine(model, launch_layout(ZeroPPConfig(num_microbatches=2)), loss_fn=per_token)
    x = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"loss_fn returned \(16,\); it must return one scalar"):
        engine.train_step(x, target=x)
    with pytest.raises(ValueError, match=r"target= has 2 rows and the model inputs 4; pass"):
        engine.train_step(x, target=x[:2])


def test_a_traced_split_of_a_meta_model_is_refused(group):
    """Interleaved stages on one rank (two stages): a meta model cannot be traced."""
    import torch

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core.engine import ZeroPPEngine
    from lightning_zeropp.core.weights.materialize import empty_parameters
    from lightning_zeropp.models import GPT, GPTConfig

    with empty_parameters():
        model = GPT(GPTConfig(vocab_size=16, seq_len=8, dim=16, num_heads=2, num_layers=2))
    config = ZeroPPConfig(schedule="interleaved_1f1b", num_chunks=2, num_microbatches=2)
    example = (torch.zeros(1, 8, dtype=torch.long),)
    with pytest.raises(ValueError, match=r"split='trace' cannot cut a model whose parameters"):
        ZeroPPEngine(
            model, launch_layout(config), loss_fn=print, split="trace", example_args=example
        )
