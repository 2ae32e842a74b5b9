"""The profile pass of bench_lightning.py: where a step's time goes, by cProfile.

PROFILE_ITEMS names the functions to total per step (Lightning's loop, the strategy, the pipeline
schedule and its chunks, ZeroPP's capture, log replay and gradient stash, autograd, AdamW, waits
on collectives); `profile_summary` reduces a profiler (or a saved .pstats file) to their seconds
and calls per step plus the top functions by cumulative and own time; `profile_section` renders
one profiled row for the Markdown.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Any

__all__ = ["PROFILE_ITEMS", "profile_section", "profile_summary"]

# (label, file path suffix or "~" for built-ins, function names, "ct" cumulative or "tt" own time).
# Indentation in the label is nesting (each line includes the indented lines under it).
PROFILE_ITEMS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("optimizer.step (Lightning's closure: training_step + backward inside)", "torch/optim/adam.py", ("step",), "ct"),
    ("  Lightning `_AutomaticOptimization._training_step`", "loops/optimization/automatic.py", ("_training_step",), "ct"),
    ("    strategy.training_step: ZeroPPStrategy", "lightning_zeropp/lightning/strategy.py", ("training_step",), "ct"),
    ("    strategy.training_step: Lightning's (DDP / FSDP)", "lightning/pytorch/strategies/", ("training_step",), "ct"),
    ("      ZeroPP: capture (user step up to the network call, whole batch)", "lightning_zeropp/lightning/", ("_capture_inputs", "capture"), "ct"),
    ("      ZeroPP: engine.train_step", "lightning_zeropp/core/engine.py", ("train_step",), "ct"),
    ("        pipeline schedule .step (torch.distributed.pipelining)", "torch/distributed/pipelining/schedules.py", ("step",), "ct"),
    ("          stage forward_one_chunk", "torch/distributed/pipelining/stage.py", ("forward_one_chunk",), "ct"),
    ("          stage backward_one_chunk", "torch/distributed/pipelining/stage.py", ("backward_one_chunk",), "ct"),
    ("          stage backward_weight_one_chunk (split backward's weight gradients)", "torch/distributed/pipelining/stage.py", ("backward_weight_one_chunk",), "ct"),
    ("          fx Interpreter.run (traced stages run node by node; with their ops)", "torch/fx/interpreter.py", ("run",), "ct"),
    ("          waiting for p2p (_wait_batch_p2p)", "torch/distributed/pipelining/schedules.py", ("_wait_batch_p2p",), "ct"),
    ("          waiting for FSDP all-gathers in the runtime (_assert_unsharded)", "torch/distributed/pipelining/schedules.py", ("_assert_unsharded",), "ct"),
    ("          stage perform_reduce_grad (gradient reduce-scatter, end of step)", "torch/distributed/pipelining/stage.py", ("perform_reduce_grad",), "ct"),
    ("          ZeroPP: scheduled loss (the user's training_step, per micro-batch)", "lightning_zeropp/lightning/", ("_scheduled_loss", "scheduled_loss"), "ct"),
    ("          ZeroPP: call-split stage forward (the model's own forward, stubs)", "lightning_zeropp/core/split/call_stages.py", ("run",), "ct"),
    ("        ZeroPP: broadcast_loss", "lightning_zeropp/core/step/loss.py", ("broadcast_loss",), "ct"),
    ("      ZeroPP: LogRecorder.replay (log values to every stage)", "lightning_zeropp/lightning/logging.py", ("replay",), "ct"),
    ("        broadcast_object_list", "torch/distributed/distributed_c10d.py", ("broadcast_object_list",), "ct"),
    ("      ZeroPP: StepGrads take + apply", "lightning_zeropp/core/step/grads.py", ("__init__", "apply"), "ct"),
    ("    LitGPT.training_step (all calls)", "lightning_zeropp/models/lit_gpt.py", ("training_step",), "ct"),
    ("      LightningModule.log (Lightning's, sync_dist all-reduce inside)", "lightning/pytorch/core/module.py", ("log",), "ct"),
    ("  backward: autograd engine (run_backward, with FSDP / DDP hooks; ZeroPP: inside the schedule)", "~", ("<method 'run_backward' of 'torch._C._EngineBase' objects>",), "ct"),
    ("  AdamW math (torch.optim.adam.adam)", "torch/optim/adam.py", ("adam",), "ct"),
    ("  optimizer.zero_grad", "torch/optim/optimizer.py", ("zero_grad",), "ct"),
    ("waiting on collectives / p2p (c10d wait, own time)", "~", ("<built-in method torch._C._distributed_c10d.wait>", "<method 'wait' of 'torch._C._distributed_c10d.Work' objects>"), "tt"),
    ("dist.barrier (own + wait)", "torch/distributed/distributed_c10d.py", ("barrier",), "ct"),
    ("dist.broadcast / all_reduce (Python entry)", "torch/distributed/distributed_c10d.py", ("broadcast", "all_reduce"), "ct"),
]  # fmt: skip


def profile_summary(prof: cProfile.Profile | str | Path | None, steps: int) -> dict[str, Any]:
    """Per-step seconds of the PROFILE_ITEMS and the top functions by cumulative and own time
    (from a profiler or a saved .pstats file)."""
    assert prof is not None
    if isinstance(prof, Path):
        prof = str(prof)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    items = []
    for label, suffix, names, kind in PROFILE_ITEMS:
        total, calls = 0.0, 0
        for (path, _line, func), (_cc, nc, tt, ct, _callers) in stats.items():
            hit = path == "~" if suffix == "~" else path.replace("\\", "/").find(suffix) >= 0
            if hit and func in names:
                total += ct if kind == "ct" else tt
                calls += nc
        items.append({"label": label, "s_per_step": total / steps, "calls_per_step": calls / steps})

    def name(key: tuple[str, int, str]) -> str:
        path, line, func = key
        if path == "~":
            return func
        for marker in ("site-packages/", "/lightning_zeropp/", "/bench/"):
            if marker in path:
                path = path.split(marker, 1)[1]
                if marker == "/lightning_zeropp/":
                    path = "lightning_zeropp/" + path
                break
        return f"{path}:{line}({func})"

    def top(index: int, n: int = 25) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[:n]
        return [
            {
                "function": name(k),
                "calls_per_step": v[1] / steps,
                "own_s_per_step": v[2] / steps,
                "cum_s_per_step": v[3] / steps,
            }
            for k, v in ranked
        ]

    return {"steps": steps, "items": items, "top_cumulative": top(3), "top_own": top(2)}


def profile_section(p: dict[str, Any], world: int) -> list[str]:
    """The Markdown of one profiled row: PROFILE_ITEMS per step by rank, then top functions."""
    lines = [
        "",
        f"## Profile: `{p['row']}` (cProfile, {p['steps']} steps after {p['warmup']} warm-up; "
        f"profiled median step {p['median_step_s']:.2f} s, unprofiled ranks alongside)",
        "",
        "Seconds per step (cumulative time of the function and everything it calls, unless marked "
        "own); indentation is nesting (under ZeroPP the backward runs inside the schedule, under "
        "DDP / FSDP in Lightning's closure). cProfile slows Python-heavy code more than C++ kernels, so Python overheads are "
        "overstated relative to compute. Ranks 0 and "
        f"{world - 1} (for `zeropp_pp2`: the first and the last pipeline stage).",
        "",
        "| What | " + " | ".join(f"rank {k} s/step (calls)" for k in p["profiles"]) + " |",
        "|---|" + "---:|" * len(p["profiles"]),
        "| step (on_train_batch_start to end, mean) | "
        + " | ".join(f"{s:.3f}" for s in p["step_s_by_rank"].values())
        + " |",
        "| &nbsp;&nbsp;outside optimizer.step (Lightning's loop, hooks, results; derived) | "
        + " | ".join(
            f"{p['step_s_by_rank'][k] - prof['items'][0]['s_per_step']:.3f}"
            for k, prof in p["profiles"].items()
        )
        + " |",
    ]
    labels = [i["label"] for i in next(iter(p["profiles"].values()))["items"]]
    for idx, label in enumerate(labels):
        cells = [prof["items"][idx] for prof in p["profiles"].values()]
        if all(c["calls_per_step"] == 0 for c in cells):
            continue
        shown = label.lstrip(" ")
        indent = "&nbsp;" * 2 * (len(label) - len(shown))
        lines.append(
            f"| {indent}{shown} | "
            + " | ".join(f"{c['s_per_step']:.3f} ({c['calls_per_step']:g})" for c in cells)
            + " |"
        )
    for rank, prof in p["profiles"].items():
        lines += [
            "",
            f"Rank {rank}, top 15 by cumulative time (s per step; calls per step):",
            "",
            "| Function | Cumulative | Own | Calls |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{e['function']}` | {e['cum_s_per_step']:.3f} | {e['own_s_per_step']:.3f} | "
            f"{e['calls_per_step']:g} |"
            for e in prof["top_cumulative"][:15]
        ]
        lines += [
            "",
            f"Rank {rank}, top 12 by own time:",
            "",
            "| Function | Own | Cumulative | Calls |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{e['function']}` | {e['own_s_per_step']:.3f} | {e['cum_s_per_step']:.3f} | "
            f"{e['calls_per_step']:g} |"
            for e in prof["top_own"][:12]
        ]
    return lines
