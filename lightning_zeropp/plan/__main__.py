"""`python -m lightning_zeropp.plan model=llama_7b cluster=h100_4x8 [key=value ...]`: the fastest
layouts that fit, with memory per rank, predicted step time and MFU, and the best one written as
a `conf/parallel/` file.

Keys (besides Hydra's `model=` and `cluster=` groups and any `model.*` / `cluster.*` override):
  global_batch=256   rows per step (sequences)
  seq_len=null       tokens per row (default: the model's context, model.max_seq_len, e.g.
                     4096 for llama_7b; data.seq_len for models sized to their data)
  dtype=bf16         compute dtype (param_dtype; gradients reduced in fp32)
  optimizer=adamw    adamw or sgd
  micro_batch=null   rows per micro-batch (null: any)
  cp_size=null       context parallelism: each sequence split over cp ranks (null: every cp
                     inside a node that splits seq_len into 2 x cp chunks; 1: none)
  compile=false      blocks compiled (torch.compile): whole, or under split backward only the
                     regions between their weights (priced between eager and compiled)
  quantized_weights=null, quantized_gradients=null, hpz_partition_size=null
                     ZeRO++ (qwZ int8/bf16, qgZ int8/int4, hpZ ranks), priced in every layout
  loss_chunk=null    the loss_chunk setting priced: the head and the loss in chunks of this
                     many tokens where the run computes them so (0: whole logits, e.g. an HF
                     model under the Lightning recipe, whose training_step reads the logits;
                     null: each layout that would chunk is priced both ways, and the layout
                     found says loss_chunk: 0 where whole logits fit); see docs/chunked-loss.md
  split=auto         the engine's split the run uses (auto: the model's own, else call); only
                     the call split, or one stage, computes the loss in chunks (a loss_chunk
                     given prices cp_size 1 only: context parallelism computes whole logits)
  top=10             layouts printed
  cut=balanced       stages cut by cost (balanced: the engine's default) or by parameters (even);
                     each layout's step under the other cut is printed beside it
  write=auto         the parallel/ file for the best layout (auto: conf/parallel/auto_<model>_<cluster>.yaml; none: skip)

The model is built on the meta device from its config (no weights, no download); the cluster's
bandwidths and `planner` figures (peak TFLOP/s, the share of it sustained eager and compiled,
memory) come from its `conf/cluster/` file. Step times and MFU are printed as the middle of the
cluster's efficiency range, with its ends in brackets. Every figure is a prediction: see
docs/planner.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning_zeropp.plan.report import GiB, describe, last_stage, other_cut

CONF = Path(__file__).resolve().parents[2] / "conf"
DEFAULTS: dict[str, Any] = {
    "global_batch": 256, "seq_len": None, "dtype": "bf16", "optimizer": "adamw",
    "micro_batch": None, "top": 10, "write": "auto", "compile": False,
    "quantized_weights": None, "quantized_gradients": None,
    "hpz_partition_size": None, "cut": "balanced", "cp_size": None, "loss_chunk": None,
    "split": "auto",
}  # fmt: skip
PLUS = ("quantized_weights", "quantized_gradients", "hpz_partition_size")


def split_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The planner's own keys (checked), and the rest as Hydra overrides."""
    import yaml

    own, hydra = dict(DEFAULTS), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in DEFAULTS:
            own[key] = yaml.safe_load(value)
        else:
            hydra.append(arg)
    for key in ("global_batch", "top"):
        if not isinstance(own[key], int) or isinstance(own[key], bool) or own[key] < 1:
            raise SystemExit(f"{key}={own[key]!r} must be a positive integer.")
    for key in ("seq_len", "micro_batch", "cp_size"):
        value = own[key]
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise SystemExit(f"{key}={value!r} must be a positive integer (or null).")
    chunk = own["loss_chunk"]
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0):
        raise SystemExit(f"loss_chunk={chunk!r} must be a whole number of tokens >= 0 (or null).")
    if own["split"] not in ("auto", "call", "trace", "stack"):
        raise SystemExit(f"split={own['split']!r} is not a split; use auto, call, trace or stack.")
    if not isinstance(own["compile"], bool):
        raise SystemExit(f"compile={own['compile']!r} must be true or false.")
    if own["cut"] not in ("balanced", "even"):
        raise SystemExit(f"cut={own['cut']!r} is not a cut; use balanced or even.")
    if own["dtype"] not in ("bf16", "fp16", "fp32"):
        raise SystemExit(f"dtype={own['dtype']!r} is not priced; use bf16, fp16 or fp32.")
    return own, hydra


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    import torch
    import yaml

    try:
        from hydra import compose, initialize_config_dir
        from hydra.utils import instantiate
        from omegaconf import OmegaConf
    except ImportError as err:
        raise SystemExit(
            f"the planner's command line reads conf/ with Hydra ({err}); install it with "
            "pip install 'lightning-zeropp[hydra]'"
        ) from None

    from lightning_zeropp.plan.hardware import Hardware
    from lightning_zeropp.plan.search import as_parallel_config, enumerate_layouts
    from lightning_zeropp.plan.search_cp import search_by_cp

    own, overrides = split_args(argv)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    seq_len = int(own["seq_len"] or _context(cfg))
    cfg.data.seq_len = seq_len  # the bundled GPT's position table follows it
    cp = own["cp_size"]
    if cp and seq_len % (2 * cp):
        raise SystemExit(
            f"cp_size={cp} does not split seq_len={seq_len} into 2 x cp_size = {2 * cp} equal "
            f"chunks; use a seq_len that is a multiple of {2 * cp}, or another cp_size."
        )
    if cp and cp > 1 and own["loss_chunk"]:  # the engine refuses it (`chunk_for_run`)
        raise SystemExit(
            f"loss_chunk={own['loss_chunk']} computes the loss in chunks, which context "
            f"parallelism (cp_size={cp}) does not: drop one of them."
        )
    cluster: Any = OmegaConf.to_container(cfg.cluster, resolve=True)  # a mapping of settings
    assert isinstance(cluster, dict)
    world = int(cluster["devices"]) * int(cluster["num_nodes"])
    dtype = own["dtype"] if cluster["accelerator"] == "gpu" else "fp32"
    hardware = Hardware.from_cluster(cluster, dtype)
    with torch.device("meta"):
        model = instantiate(cfg.model.net)
    if dtype != own["dtype"]:
        print(f"({cluster['name']} is a CPU cluster: pricing fp32, not {own['dtype']})")
    base = {"param_dtype": dtype if dtype != "fp32" else None, "compile": own["compile"]}
    base.update({key: own[key] for key in (*PLUS, "loss_chunk") if own[key] is not None})
    if own["split"] != "auto":  # how "auto" resolves for this model: the split priced
        from lightning_zeropp.core.split.methods import SPLIT_ATTR

        object.__setattr__(model, SPLIT_ATTR, own["split"])
    layouts = list(
        enumerate_layouts(
            world, _num_blocks(model), own["global_batch"], hardware.node_size, base,
            micro_batch=own["micro_batch"], seq_len=seq_len,
            cp_sizes=[cp] if cp else [1] if own["loss_chunk"] else None,
        )
    )  # fmt: skip
    print(
        f"{cfg.model.name} on {cluster['name']} ({world} ranks), global batch "
        f"{own['global_batch']} x {seq_len} tokens, {dtype}: pricing {len(layouts)} layouts ...",
        flush=True,
    )
    if not layouts:
        print(
            f"No layout splits global_batch={own['global_batch']} over {world} ranks"
            + (f" in micro-batches of {own['micro_batch']} rows" if own["micro_batch"] else "")
            + "; use a global batch with more factors in common with the world size."
        )
        return 1
    by_cp = search_by_cp(
        model, world, own["global_batch"], seq_len, hardware, layouts,
        optimizer=own["optimizer"], top=own["top"], cut=own["cut"],
    )  # fmt: skip
    best = sorted((c for found in by_cp.values() for c in found), key=lambda c: c.step_s)
    best = best[: own["top"]]
    if not best:
        assert hardware.memory_bytes is not None  # only a memory limit can refuse every layout
        print(
            f"No layout fits {hardware.memory_bytes / GiB:.0f} GiB per rank; try a smaller "
            "global_batch, more devices, a larger cp_size (up to the node), or cpu_offload."
        )
        return 1
    tokens = own["global_batch"] * seq_len
    other = "even" if own["cut"] == "balanced" else "balanced"
    print(
        f"{'#':>2} {'step (s) [range]':>22} {'MFU [range]':>19} {'tokens/s':>10} "
        f"{'GiB/rank':>9} {other + ' cut (s)':>15}  layout"
    )
    for i, c in enumerate(best):
        fast, slow = c.step_range_s
        low_mfu, high_mfu = (c.slow or c.step).mfu, (c.fast or c.step).mfu
        beside = other_cut(model, c.settings, world, own, seq_len, hardware, other)
        print(
            f"{i + 1:>2} {c.step_s:>7.3f} [{fast:.3f}-{slow:.3f}] "
            f"{c.step.mfu:>6.1%} [{low_mfu:.0%}-{high_mfu:.0%}] {tokens / c.step_s:>10.0f} "
            f"{c.memory_bytes / GiB:>9.1f} {beside:>15}  {describe(c.settings)}"
        )
    print(last_stage(model, best[0].settings, world, own["global_batch"], seq_len))
    if len(by_cp) > 1:
        print("the fastest layout that fits, per cp_size:")
        for cp, found in by_cp.items():
            line = "none fits" if not found else (
                f"{found[0].step_s:.3f} s, {found[0].memory_bytes / GiB:.1f} GiB/rank, "
                f"{describe(found[0].settings)}"
            )  # fmt: skip
            print(f"  cp {cp}: {line}")
    if own["write"] != "none":
        name = f"auto_{cfg.model.name}_{cluster['name']}"
        path = Path(own["write"] if own["write"] != "auto" else CONF / "parallel" / f"{name}.yaml")
        chosen = as_parallel_config(best[0], world)
        dp = world // (chosen["pp_size"] * chosen["cp_size"])
        micro = own["global_batch"] // dp // chosen["num_microbatches"]
        header = (
            f"# Chosen by `python -m lightning_zeropp.plan {' '.join(argv)}` for {cfg.model.name} "
            f"on {cluster['name']}:\n# predicted {best[0].step_s:.3f} s a step "
            f"({best[0].step_range_s[0]:.3f} to {best[0].step_range_s[1]:.3f}), MFU "
            f"{best[0].step.mfu:.1%}, {best[0].memory_bytes / GiB:.1f} GiB per rank (a prediction, "
            "not a measurement),\n# for a global batch of "
            f"{own['global_batch']} x {seq_len} tokens: train it with trainer.micro_batch_size="
            f"{micro} data.seq_len={seq_len}.\n"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + yaml.safe_dump(chosen, sort_keys=False))
        print(
            f"wrote {path}: train it as parallel={path.stem} trainer.micro_batch_size={micro} "
            f"data.seq_len={seq_len} (the batch it was priced for) when it sits in conf/parallel/"
        )
    return 0


def _context(cfg: Any) -> int:
    """The model's context length (`model.max_seq_len`), else the data's sequence length (a
    model sized to its data, such as the bundled GPT, reads it from there)."""
    from omegaconf import OmegaConf

    given = OmegaConf.select(cfg, "model.max_seq_len", default=None)
    return int(given) if given else int(cfg.data.seq_len)


def _num_blocks(model: Any) -> int:
    from lightning_zeropp.core.split.blocks import find_blocks

    return len(find_blocks(model)[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
