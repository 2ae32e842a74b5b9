"""The settings reference: what each `ZeroPPConfig` field defaults to and does, in words.

The docs site renders its settings page from this table in the order of the config's fields
(`settings_table`, called by `docs/hooks/settings_page.py`), so the reference cannot drift from
the code: `tests/unit/test_settings_path.py` fails when a field has no row here or a row names no
field. Plain data and string formatting; imports nothing of the library.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SETTINGS_REFERENCE", "settings_table"]

# field name -> (the default, in words; what it does). Markdown, one line each.
SETTINGS_REFERENCE: dict[str, tuple[str, str]] = {
    "pp_size": (
        "what the other sizes leave; with none given, 2 when the world is even, else 1",
        "pipeline ranks",
    ),
    "dp_shard_size": (
        "the rest of the world",
        "ranks each stage is sharded over (ZeRO-3, FSDP2), consecutive ranks",
    ),
    "dp_replicate_size": (
        "1",
        "replicas of each shard group (HSDP)",
    ),
    "cp_size": (
        "1",
        "context parallelism: ranks each sequence is split over (chunks r and 2 cp - 1 - r on "
        "rank r, positions kept global, attention over the gathered keys and values); each "
        "stage's weights are sharded over dp_shard x cp",
    ),
    "num_microbatches": (
        "`pp_size`",
        "micro-batches per step and data-parallel rank",
    ),
    "schedule": (
        "`1f1b`",
        "`gpipe`, `1f1b`, `interleaved_1f1b`, `looped_bfs`, `interleaved_zb`, `zbv`, `dualpipev`, `zeropp`; torch's class names (`Interleaved1F1B`, `ZBVZeroBubble`) too, any case",
    ),
    "num_chunks": (
        "1 for single-stage schedules, 2 for interleaved / V / zeropp",
        "stages per pipeline rank (v)",
    ),
    "param_dtype": (
        "None (fp32)",
        "compute dtype (`bf16`: FSDP2 mixed precision)",
    ),
    "reduce_dtype": (
        "None (the parameters')",
        "dtype gradients are reduced in",
    ),
    "activation_checkpointing": (
        "False",
        'recompute blocks in backward: `True` / `"all"`, or `"except_last"` (all but the last stage)',
    ),
    "recompute_ranks": (
        "None (every rank)",
        "the pipeline ranks whose stages recompute as `activation_checkpointing` says (the planner chooses them per rank: [offload](offload.md))",
    ),
    "offload_activations": (
        "False",
        'saved activations to host memory in forward, back in backward: `True` / `"on"` (every pipeline rank), `"auto"` (the ranks holding the most micro-batches in flight: the first half under 1F1B), or a list of pipeline ranks; bit-identical ([offload](offload.md))',
    ),
    "reshard_after_forward": (
        "False under PP, True without",
        "free gathered weights after forward (gather again for backward)",
    ),
    "split_points": (
        "cut by cost: the busiest pipeline rank's FLOPs least (docs/cost-cut.md)",
        "block indices where stages 1, 2, ... start",
    ),
    "unit_size": (
        "`pp_size` (its minimum)",
        "zeropp: U, micro-batches per unit",
    ),
    "split_backward": (
        "on for zeropp",
        "zeropp: input- and weight-gradient tasks apart",
    ),
    "grad_reduce": (
        "`step`",
        "zeropp: reduce-scatter gradients per `step`, `unit` or `microbatch`",
    ),
    "nonfinite": (
        "`raise`",
        "a NaN/inf loss: `raise` naming step and stage, or `skip` the step's gradients",
    ),
    "save_on_sigterm": (
        "False",
        "on SIGTERM every rank stops at the next step and exits 143 naming it; `True` first saves a checkpoint a restart resumes from ([reliability](reliability.md))",
    ),
    "loss_chunk": (
        "None",
        "tokens per chunk of the head and the cross-entropy on the last stage (bundled GPT, HF causal LMs' own loss): whole logits never exist; 0 = whole logits; None = 1024 where the run can chunk (the call split, no context parallelism), else whole logits; a number there is refused ([chunked loss](chunked-loss.md))",
    ),
    "quantized_weights": (
        "None",
        "ZeRO++ qwZ: `int8` (or `bf16`, `fp`) weight gathers",
    ),
    "hpz_partition_size": (
        "None",
        "ZeRO++ hpZ: ranks that keep a second weight copy for backward",
    ),
    "quantized_gradients": (
        "None",
        "ZeRO++ qgZ: `int8` or `int4` two-hop gradient reduction",
    ),
    "gradient_error_feedback": (
        "on for `int4`",
        "ZeRO++: carry each hop's quantization error into the next step",
    ),
    "quant_block_size": (
        "256",
        "ZeRO++: elements per quantization block",
    ),
    "cpu_offload": (
        "False",
        "FSDP2's CPU offload of parameters, gradients and optimizer state",
    ),
    "compile": (
        "False",
        "`torch.compile` each block: whole blocks, or the regions between the weights under split backward (below)",
    ),
    "node_size": (
        "the launcher's `LOCAL_WORLD_SIZE`, else the world",
        "ranks per node (where ZeRO++'s cross-node hops begin)",
    ),
}


def settings_table(field_names: Iterable[str]) -> str:
    """The Markdown table of the settings, one row per field name in the order given."""
    lines = ["| setting | default | what it does |", "|---|---|---|"]
    for name in field_names:
        default, what = SETTINGS_REFERENCE[name]
        lines.append(f"| `{name}` | {default} | {what} |")
    return "\n".join(lines) + "\n"
