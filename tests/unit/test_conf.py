"""Every Hydra config in conf/ composes and validates; bad overrides fail naming the key.

Composed with Hydra's compose API, checked with the recipes' own `check_config` (which resolves
the parallel settings through `ZeroPPConfig` against the cluster's world size). No model is built:
the Llama shapes are checked against the builder's signature and an analytic parameter count
(checked itself against a meta-device model for the smallest one).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
)
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_zeropp import ZeroPPConfig
from recipes.recipe_config import (
    CONF_DIR,
    check_config,
    check_model_facts,
    fill_model_facts,
    is_rank_zero,
    plan_summary,
    rank_zero_overrides,
    run_dir_note,
)

GROUPS = ("model", "cluster", "parallel", "trainer", "data")
# Values a config declares mandatory (`???`), given here so that it composes.
REQUIRED = {
    "model/hf_local": ["model.net.path=/models/some-llama"],
    "data/text_file": ["data.path=/data/corpus.txt"],
    "data/hf_disk": ["data.path=/data/saved_dataset"],
}
LLAMA_SIZES = {  # config name -> parameters it should have (the name's size class)
    "llama_125m": 125e6,
    "llama_1b": 1.1e9,
    "llama_7b": 6.7e9,
    "llama_13b": 13e9,
    "llama_70b": 69e9,
}
# Today's vocabularies: the shapes' parameter counts (Gemma 2's published 9.24B ties its head to
# the embedding; built untied, the head adds 256000 x 3584)
VOCAB_SHAPES = {"llama3_8b": (8.03e9, 128256), "gemma2_9b": (9.24e9 + 0.917e9, 256000)}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_config(overrides: list[str], hydra: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra)


def with_required(overrides: list[str]) -> list[str]:
    extra = [v for o in overrides for v in REQUIRED.get(o.replace("=", "/"), [])]
    return overrides + extra


# ------------------------------------------------------------------------------ every config
def test_groups_are_all_there():
    assert {p.name for p in CONF_DIR.iterdir() if p.is_dir()} == set(GROUPS)
    extra = {"gpt_tiny", "llama_tiny", "hf_local", *VOCAB_SHAPES}
    assert set(LLAMA_SIZES) | extra == set(options("model"))
    assert {"cpu4", "cpu8", "h100_1x8", "h100_4x8", "h100_16x8"} == set(options("cluster"))
    parallel = {"base", "zeropp", "zeropp_plus", "pp_1f1b", "fsdp", "ddp", "auto"}
    assert parallel == set(options("parallel"))
    assert {"markov", "text_file", "hf_disk"} == set(options("data"))


@pytest.mark.parametrize(
    "choice", [f"{g}={o}" for g in GROUPS for o in options(g)], ids=lambda c: c.replace("=", "/")
)
def test_every_config_composes_and_validates(choice):
    cfg = compose_config(with_required([choice]))
    plan = check_config(cfg)
    assert plan.world_size == cfg.cluster.devices * cfg.cluster.num_nodes
    assert plan.global_batch_size == (
        cfg.trainer.micro_batch_size * plan.zeropp.num_microbatches * plan.zeropp.dp_size
    )
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def _recipe_cluster_pairs() -> list:
    """Every (parallel, cluster) pair; the planner's search over the multi-node clusters
    (parallel=auto: seconds to tens of seconds each) is left to bench/slow_tests.py."""
    return [
        pytest.param(
            parallel,
            cluster,
            id=f"{parallel}-{cluster}",
            marks=[pytest.mark.slow]
            if parallel == "auto" and "x8" in cluster and cluster != "h100_1x8"
            else [],
        )
        for parallel in options("parallel")
        for cluster in options("cluster")
    ]


@pytest.mark.parametrize(("parallel", "cluster"), _recipe_cluster_pairs())
def test_every_parallel_recipe_fits_every_cluster(parallel, cluster):
    overrides = [f"parallel={parallel}", f"cluster={cluster}"]
    if parallel == "auto":  # the bundled 8-block model: 4 rows a rank leaves the planner room
        world = compose_config([f"cluster={cluster}"]).cluster
        overrides.append(f"parallel.auto.global_batch_size={16 * world.devices * world.num_nodes}")
    cfg = compose_config(overrides)
    z = check_config(cfg).zeropp
    world = cfg.cluster.devices * cfg.cluster.num_nodes
    assert z.pp_size * z.dp_replicate_size * z.dp_shard_size == world
    if parallel == "zeropp_plus":  # ZeRO-3 over the stage's ranks, ZeRO++ where they span nodes
        assert z.dp_replicate_size == 1 and z.node_size == cfg.cluster.devices
        spans_nodes = z.dp_shard_size > cfg.cluster.devices
        assert z.hpz_partition_size == (cfg.cluster.devices if spans_nodes else None)
    if parallel == "ddp":
        assert (z.pp_size, z.dp_shard_size, z.dp_replicate_size) == (1, 1, world)
    if parallel == "fsdp":
        assert (z.pp_size, z.dp_shard_size, z.reshard_after_forward) == (1, world, True)


def test_parallel_groups_hold_exactly_the_zeropp_settings():
    """So that every setting can be overridden without `+`, and nothing else can be set: the base
    holds every setting, and every other file extends it, saying only what it changes."""
    fields = {f.name for f in dataclasses.fields(ZeroPPConfig)}
    base = set(yaml.safe_load((CONF_DIR / "parallel" / "base.yaml").read_text()))
    assert base == fields, f"parallel/base.yaml: missing {fields - base}, extra {base - fields}"
    for name in options("parallel"):
        if name == "base":
            continue
        own = yaml.safe_load((CONF_DIR / "parallel" / f"{name}.yaml").read_text())
        assert own["defaults"] == ["base", "_self_"], name
        keys = set(compose_config([f"parallel={name}"]).parallel)
        if name == "auto":  # the layout is the planner's; the rest is kept as given
            assert set(own) - {"defaults"} == {"auto"} and keys == fields | {"auto"}, keys
            continue
        assert set(own) - {"defaults"} < fields, name
        assert keys == fields, f"parallel={name}: missing {fields - keys}, extra {keys - fields}"


def test_zeropp_plus_turns_on_the_three_techniques():
    parallel = compose_config(["parallel=zeropp_plus", "cluster=h100_4x8"]).parallel
    assert parallel["quantized_weights"] == "int8"
    assert parallel["quantized_gradients"] == "int4"
    assert parallel["hpz_partition_size"] == parallel["node_size"] == 8
    assert parallel["dp_replicate_size"] == 1


@pytest.mark.parametrize(
    "overrides",
    [
        # the ZeroPP authors' 7B layout, as conf/parallel/zeropp.yaml's comment gives it
        "parallel=zeropp cluster=h100_4x8 model=llama_7b parallel.pp_size=4 "
        "parallel.num_chunks=4 parallel.dp_shard_size=8",
        "parallel=zeropp_plus cluster=h100_16x8 model=llama_70b",
        "parallel=zeropp cluster=h100_1x8 model=llama_1b data.seq_len=2048",
        "parallel=pp_1f1b parallel.pp_size=4 parallel.num_microbatches=8",  # the recipe test's
    ],
)
def test_documented_combinations_validate(overrides):
    check_config(compose_config(overrides.split()))


# ------------------------------------------------------------------------------ model shapes
def llama_params(net: dict[str, Any]) -> int:
    """Parameters of a LlamaForCausalLM with untied embeddings, from its config fields."""
    h, inter, n = net["hidden_size"], net["intermediate_size"], net["num_hidden_layers"]
    head_dim = h // net["num_attention_heads"]
    kv = net["num_key_value_heads"] * head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # q, o; k, v; mlp; two norms
    return 2 * net["vocab_size"] * h + n * per_layer + h


def llama_net(name: str) -> dict[str, Any]:
    net = OmegaConf.to_container(compose_config([f"model={name}"]).model.net, resolve=True)
    assert isinstance(net, dict)
    return net


@pytest.mark.parametrize("name", sorted(LLAMA_SIZES))
def test_llama_configs_have_their_size_and_fit_the_builder(name):
    from lightning_zeropp.models.hf import build_causal_lm

    net = llama_net(name)
    assert net.pop("_target_") == "lightning_zeropp.models.hf.build_causal_lm"
    inspect.signature(build_causal_lm).bind(**net)  # the builder takes these arguments
    assert net["tie_word_embeddings"] is False and net["family"] == "llama"
    want = LLAMA_SIZES[name]
    assert abs(llama_params(net) - want) < 0.1 * want, f"{name}: {llama_params(net) / 1e9:.2f}B"


@pytest.mark.parametrize("name", sorted(VOCAB_SHAPES))
def test_todays_vocabulary_shapes_build_with_their_size(name):
    """Built on the meta device as the planner builds them: the published size and vocabulary."""
    cfg = compose_config([f"model={name}"])
    with torch.device("meta"):
        net = instantiate(cfg.model.net)
    size, vocab = VOCAB_SHAPES[name]
    count = sum(p.numel() for p in net.parameters())
    assert abs(count - size) < 0.01 * size, f"{name}: {count / 1e9:.3f}B"
    assert net.get_output_embeddings().weight.shape[0] == vocab == cfg.model.vocab_size


def test_llama_param_formula_matches_a_real_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    net = llama_net("llama_125m")
    config = AutoConfig.for_model(
        net.pop("family"), **{k: v for k, v in net.items() if k[0] != "_"}
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == llama_params(net)


def test_hf_local_facts_are_checked_once_the_model_is_built():
    """hf_local's vocabulary, depth and positional range come from the loaded checkpoint."""
    cfg = compose_config(["model=hf_local", "model.net.path=/m", "parallel=zeropp"])
    plan = check_config(cfg)  # nothing known yet: nothing to refuse
    loaded = SimpleNamespace(
        config=SimpleNamespace(vocab_size=320, num_hidden_layers=3, max_position_embeddings=512)
    )
    fill_model_facts(cfg.model, loaded)
    assert (cfg.model.vocab_size, cfg.model.num_layers, cfg.model.max_seq_len) == (320, 3, 512)
    with pytest.raises(ValueError, match=r"4 pipeline stages, but model\.num_layers=3"):
        check_model_facts(cfg, plan.zeropp)  # pp 2 x 2 chunks


def test_bundled_gpt_config_builds():
    cfg = compose_config([])
    net = instantiate(cfg.model.net)
    assert net.cfg.num_layers == cfg.model.num_layers and net.cfg.seq_len == cfg.data.seq_len


# ------------------------------------------------------------------------------ bad overrides
@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["parallel.foo=1"], ConfigCompositionException, r"parallel\.foo"),
        (["trainer.max_step=3"], ConfigCompositionException, r"trainer\.max_step\b"),
        (["model=llama_9b"], MissingConfigException, r"model/llama_9b"),
        (["+parallel.foo=1"], ValueError, r"parallel\.foo is not a ZeroPPConfig setting"),
        (["parallel.pp_size=3"], ValueError, r"cluster=cpu4 .*pp_size \(3\) x"),
        (["parallel.pp_size=two"], ValueError, r"pp_size='two' must be a positive integer"),
        (["parallel.schedule=pipedream"], ValueError, r"schedule='pipedream' is unknown"),
        (["parallel.num_microbatches=1"], ValueError, r"num_microbatches=1 is too few"),
        (["parallel=ddp", "parallel.dp_shard_size=null"], ValueError, r"dp_replicate_size=null"),
        (["parallel=zeropp", "cluster=cpu8", "parallel.pp_size=8"], ValueError, "num_layers=8"),
        (["trainer.max_steps=-1"], ValueError, r"trainer\.max_steps=-1 must be a positive"),
        (["trainer.micro_batch_size=1.5"], ValueError, r"trainer\.micro_batch_size=1\.5"),
        (["trainer.lr=fast"], ValueError, r"trainer\.lr='fast'"),
        (["trainer.optimizer=adam"], ValueError, r"trainer\.optimizer='adam' is unknown"),
        (["trainer.precision=bf16-mixed"], ValueError, r"parallel\.param_dtype=bf16"),
        (["trainer.gradient_clip_val=0"], ValueError, r"trainer\.gradient_clip_val=0"),
        (["cluster.devices=0"], ValueError, r"cluster\.devices=0 must be a positive"),
        (["cluster.accelerator=tpu"], ValueError, r"cluster\.accelerator='tpu'"),
        (["model=hf_local"], ValueError, r"missing required value\(s\): model\.net\.path"),
        (["data=text_file"], ValueError, r"data\.path"),
        (["model=llama_125m", "data.seq_len=4096"], ValueError, r"model\.max_seq_len=2048"),
    ],
)
def test_bad_overrides_fail_naming_the_key(overrides, error, match):
    with pytest.raises(error, match=match):
        check_config(compose_config(overrides))


# ------------------------------------------------------------------------------ run directory
def test_run_dir_is_keyed_on_an_id_every_rank_shares(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_dir())
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_dir() == "outputs/4242"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2c")  # torchrun inside SLURM: torchrun's id wins
    assert run_dir() == "outputs/3f2c"


def test_static_rendezvous_run_id_is_flagged():
    assert run_dir_note({"TORCHELASTIC_RUN_ID": "none"}) is not None  # torchrun's static default
    assert run_dir_note({"TORCHELASTIC_RUN_ID": "5f0e"}) is None
    assert run_dir_note({}) is None


def run_dir() -> str:
    return compose_config([], hydra=True).hydra.run.dir


@pytest.mark.parametrize(
    ("env", "argv", "want"),
    [
        ({}, [], []),  # a plain single process, or Lightning's launching process
        ({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}, [], []),  # torchrun rank 0
        (
            {"RANK": "9", "LOCAL_RANK": "1"},
            [],
            ["hydra.output_subdir=null", "hydra/job_logging=stdout"],
        ),
        (
            {"RANK": "8", "LOCAL_RANK": "0", "GROUP_RANK": "1"},
            [],
            ["hydra.output_subdir=null", "hydra/job_logging=stdout"],
        ),
        ({"SLURM_PROCID": "3"}, [], ["hydra.output_subdir=null", "hydra/job_logging=stdout"]),
        # Lightning's children already get hydra.output_subdir=null: not repeated
        ({"LOCAL_RANK": "2"}, ["x=1", "hydra.output_subdir=null"], ["hydra/job_logging=stdout"]),
        (
            {"LOCAL_RANK": "0", "NODE_RANK": "1"},
            [],
            ["hydra.output_subdir=null", "hydra/job_logging=stdout"],
        ),
    ],
)
def test_only_rank_zero_writes_hydra_files(env, argv, want):
    assert rank_zero_overrides(argv, env) == want
    assert is_rank_zero(env) == (want == [])


# ------------------------------------------------------------------------------ data
def test_text_file_data_builds_windows_and_holds_out_the_end(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello zeropp " * 200, encoding="utf-8")  # 2600 bytes
    cfg = compose_config(["data=text_file", f"data.path={corpus}", "data.seq_len=32"])
    check_config(cfg)
    train, val = instantiate(cfg.data.train), instantiate(cfg.data.val)
    assert len(train) == int(2600 * 0.95 - 1) // 32 and len(val) == (2600 - 2470 - 1) // 32
    x, y = train[0]
    assert x.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert bytes(x.tolist()).decode() == ("hello zeropp " * 3)[:32]
    missing = compose_config(["data=text_file", f"data.path={tmp_path / 'nope.txt'}"])
    # Hydra wraps the builder's error, and keeps its message: FileNotFoundError("data.path=...")
    with pytest.raises(InstantiationException, match="FileNotFoundError.*data.path="):
        instantiate(missing.data.train)


def test_hf_disk_data_without_datasets_says_what_to_install(tmp_path: Path):
    try:
        import datasets  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("datasets is installed: the missing-package error cannot occur")
    cfg = compose_config(["data=hf_disk", f"data.path={tmp_path}"])
    with pytest.raises(InstantiationException, match="ImportError.*pip install datasets"):
        instantiate(cfg.data.train)


def test_plan_summary_uses_the_documented_bandwidths():
    layout = ["parallel=zeropp", "parallel.dp_replicate_size=2", "parallel.dp_shard_size=8"]
    cfg = compose_config(["cluster=h100_4x8", "model=llama_7b", *layout])
    text = plan_summary(cfg, check_config(cfg), 6_738_415_616)
    assert "pp 2 x dp_replicate 2 x dp_shard 8" in text
    assert "over NVLink at 450 GB/s" in text
    # ZeRO++ across 2 nodes per stage: INT8 weights (+ a 4-byte scale per 256) over InfiniBand.
    cfg = compose_config(["cluster=h100_4x8", "parallel=zeropp_plus", "model=llama_7b"])
    text = plan_summary(cfg, check_config(cfg), 6_738_415_616)
    assert "pp 2 x dp_replicate 1 x dp_shard 16" in text
    moved = 6_738_415_616 / 2 * (1 + 4 / 256) * 15 / 16
    assert f"{moved / 1e9:.2f} GB over InfiniBand at 50 GB/s" in text


def test_trainer_recipe_config_composes():
    """conf/train_hf.yaml (recipes/train_hf.py): the main job's groups with an HF directory and
    the zeropp layout, plus the `hf` group, checked like every other config."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train_hf", overrides=["model.net.path=/models/some-llama"])
    assert cfg.model.name == "hf_local" and cfg.parallel.schedule == "zeropp"
    assert set(cfg.hf) == {"lora", "seq_buckets", "save_steps", "resume_from"}
    plan = check_config(cfg)
    assert plan.global_batch_size % plan.world_size == 0  # per-device batches for the Trainer
