"""Where an emulated device sat idle, and why: `bench_emulated.py`'s diagnosis of its misses.

Each rank records, for the last timed step, its device's tasks (kind, start, end) and the host's
waits on others (a receive, a collective by name; `emulated_device.EmulatedDevice.waiting`).
Every moment a rank's device is idle inside the step is put down to what its host was doing
then: waiting for a receive (a peer had not yet sent: the schedule's own bubble, or a peer that
fell behind), in a collective (named: a gather, a reduction, the step's agreement all-reduce),
in the garbage collector (`gc<generation>`, when the run records its pauses), or none of these
("host": the host was running Python, or waiting for a core, and had not queued the next task:
per-action overhead or a loaded machine).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["idle_causes", "idle_lines", "mean_idle", "rounded", "row_idle", "write_markdown"]

ANALYSIS = "## Misses and their causes"

Span = tuple[str, float, float]


def _gaps(
    window: tuple[float, float], busy: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The parts of `window` that no interval of `busy` covers."""
    start, end = window
    gaps, cursor = [], start
    for a, b in sorted(busy):
        if a > cursor:
            gaps.append((cursor, min(a, end)))
        cursor = max(cursor, b)
    if cursor < end:
        gaps.append((cursor, end))
    return [(a, b) for a, b in gaps if b > a]


def idle_causes(
    spans: list[Span], waits: list[Span], window: tuple[float, float]
) -> dict[str, float]:
    """Seconds of device idleness in `window` by the host's wait then ("host" when none;
    "host after recv" when the host's own time starts as a receive ends: the host must see a
    message's data before it runs, and queues, the work that needs it)."""
    causes: dict[str, float] = defaultdict(float)
    recv_ends = [e for k, _, e in waits if k == "recv"]
    for a, b in _gaps(window, [(s, e) for _, s, e in spans]):
        cuts = sorted({a, b, *(x for _, s, e in waits for x in (s, e) if a < x < b)})
        after_recv = False
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            mid = (lo + hi) / 2
            kinds = [k for k, s, e in waits if s <= mid < e]
            if kinds:
                after_recv = False
                causes[kinds[0]] += hi - lo
                continue
            after_recv = after_recv or any(abs(lo - e) < 1e-3 for e in recv_ends)
            causes["host after recv" if after_recv else "host"] += hi - lo
    return dict(causes)


def row_idle(row: dict[str, Any]) -> tuple[str, float, dict[str, float]]:
    """The rank idle longest in a row's recorded step: (rank, window seconds, causes). The
    window runs from the first task any rank's device started to the last one's end."""
    spans, waits = row["spans"], row["waits"]
    start = min(s for r in spans.values() for _, s, _ in r)
    end = max(e for r in spans.values() for _, _, e in r)
    worst: tuple[str, float, dict[str, float]] | None = None
    for rank in spans:
        causes = idle_causes(spans[rank], waits.get(rank, []), (start, end))
        if worst is None or sum(causes.values()) > sum(worst[2].values()):
            worst = (rank, end - start, causes)
    assert worst is not None
    return worst


def mean_idle(row: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Every rank's idle time in a row's recorded step by cause, averaged over the ranks:
    (window seconds, causes)."""
    spans, waits = row["spans"], row["waits"]
    start = min(s for r in spans.values() for _, s, _ in r)
    end = max(e for r in spans.values() for _, _, e in r)
    total: dict[str, float] = defaultdict(float)
    for rank in spans:
        for kind, seconds in idle_causes(spans[rank], waits.get(rank, []), (start, end)).items():
            total[kind] += seconds / len(spans)
    return end - start, dict(total)


def idle_lines(rows: list[dict[str, Any]], mean: bool = False) -> list[str]:
    """A Markdown table: per row, the idlest rank's idle share of the recorded step by cause
    (`mean`: every rank's, averaged)."""
    lines = [
        f"| Row | {'Ranks' if mean else 'Idlest rank'} | Idle | Waiting to receive | In a collective | Garbage collector | "
        "Host after a receive | Host, other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        rank, window, causes = ("mean", *mean_idle(row)) if mean else row_idle(row)
        recv = causes.get("recv", 0.0)
        host = causes.get("host", 0.0)
        gc = sum(v for k, v in causes.items() if k.startswith("gc"))
        after = causes.get("host after recv", 0.0)
        coll = {
            k: v
            for k, v in causes.items()
            if k not in ("recv", "host", "host after recv") and not k.startswith("gc")
        }
        named = ", ".join(
            f"{k} {v / window:.1%}" for k, v in sorted(coll.items(), key=lambda kv: -kv[1])
        )
        total = sum(causes.values())
        lines.append(
            f"| {row['row']} | {rank} | {total / window:.1%} | {recv / window:.1%} | "
            f"{sum(coll.values()) / window:.1%}{f' ({named})' if named else ''} | "
            f"{gc / window:.1%} | {after / window:.1%} | {host / window:.1%} |"
        )
    return lines


def write_markdown(
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    path: Path,
    efficiency: float,
    standin: dict[str, Any],
) -> None:
    """`bench_emulated.py`'s results as Markdown at `path` (`efficiency`: the emulated GPU's
    sustained share of peak; `standin`: the stand-in GPT's config); a hand-written section
    headed `ANALYSIS` already in the file is kept."""
    m, s, link = meta["machine"], meta["scaling"], meta["links"]
    loads = [x for r in rows for x in r["load_1m"]]
    lines = [
        "# Every schedule on an emulated 8-GPU cluster, against the planner's plan",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores (8 ranks, one thread each); {m['date']}; "
        f"torch {m['torch']}; commit {m['commit']}; {meta['wall_s'] / 60:.0f} min",
        f"- Load (1-minute average, other work on the machine included) from {min(loads):.1f} "
        f"to {max(loads):.1f} during the rows; CPU steal {meta['steal_share']:.1%}",
        f"- Emulated: Llama-2-7B blocks at 4096 tokens a micro-batch on H100s at "
        f"{efficiency:.0%} of 989 TFLOP/s, {s['scale']:g}x slower: a block's forward "
        f"{s['forward_s'] * 1e3:.1f} ms, input and weight gradients the same each; stand-in "
        f"GPT {standin} (16 blocks), links of 4-rank nodes at NVLink and InfiniBand rates times "
        f"{s['bytes_ratio']:.2e} (stand-in / reference block bytes) / {s['scale']:g}: "
        f"{s['intra_Bps'] / 1e6:.1f} and {s['inter_Bps'] / 1e6:.2f} MB/s per rank each way",
        f"- Calibrated on those links (gloo, one way): inside a node "
        f"{link['intra_Bps'] / 1e6:.1f} MB/s + {link['intra_latency_s'] * 1e3:.2f} ms, across "
        f"{link['inter_Bps'] / 1e6:.2f} MB/s + {link['inter_latency_s'] * 1e3:.2f} ms: the plan's "
        "link figures",
        f"- Ranks at nice {meta['nice']} (they sleep most of the time; a prompt wake-up is what "
        "their timing needs on a shared machine)",
        f"- {meta['warmup']} warm-up and {meta['steps']} timed steps a row (median); a step is "
        "forward and backward of every micro-batch (no optimizer); bubble: the largest share of "
        "the step one rank's device is idle",
        "",
        "| Row | pp x shard | Measured step (s) | Best step (s) | Planned (s) | Error | "
        "Measured bubble | Planned bubble | Host late | CPU (cores) | Load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    if not meta.get("complete", True):
        lines[1:1] = ["", f"**Partial: the run stopped after {len(rows)} rows.**"]
    for r in rows:
        lay, got, plan = r["layout"], r["measured"], r["planned"]
        err = got["step_s"] / plan["step_s"] - 1
        lines.append(
            f"| {r['row']} | {lay.get('pp_size', 1)} x {lay['dp_shard_size']} | "
            f"{got['step_s']:.2f} | {min(got['steps_s']):.2f} | {plan['step_s']:.2f} | "
            f"{err:+.1%} | {got['bubble']:.1%} | "
            f"{plan['bubble']:.1%} | {got['host_late']:.1%} | {got['cpu_cores']:.2f} | "
            f"{r['load_1m'][0]:.0f}-{r['load_1m'][1]:.0f} |"
        )
    within = [r for r in rows if abs(r["measured"]["step_s"] / r["planned"]["step_s"] - 1) <= 0.1]
    best = [
        r for r in rows if abs(min(r["measured"]["steps_s"]) / r["planned"]["step_s"] - 1) <= 0.1
    ]
    lines += [
        "",
        f"Within 10% of the plan: {len(within)} of {len(rows)} rows (on the best step: "
        f"{len(best)}).",
        "",
        "Host late: the largest share of the step one rank's device sat idle while its host was "
        "neither receiving nor in a collective (the host fell behind its device: Python per "
        "action, or a machine too loaded to run 8 hosts). CPU: the ranks' CPU time over the step, "
        "in cores (2 on this machine). Load: the machine's 1-minute load average at the row's start "
        "and end. Best step: the shortest timed step (a loaded machine only ever adds delay).",
        "",
        "## Where the idle time went (the recorded step)",
        "",
        "Each rank's device idle time in the last timed step (from the first task any device "
        "ran to the last one's end), averaged over the ranks, by what its host was waiting on then "
        "(`emulated_report.py`). Waiting to receive: a peer had not sent yet (the schedule's "
        "bubble, or a peer that fell behind); in a collective: gloo's reduce-scatter blocks the "
        "host, so gradient reductions do not overlap compute here as they would on a GPU; "
        "garbage collector: its pauses (runs before bench_emulated timed them counted them as "
        "host); host: no recorded wait: the host had not queued the next task (Python per "
        "action, no free core), or it waited on an asynchronous collective's handle (FSDP's "
        "gathers under the multi-stage schedules' UNSHARD), which the device does not time.",
        "",
        *idle_lines(rows, mean=True),
    ]
    # a hand-written reading of a run (its heading names the run) survives re-rendering
    kept = path.read_text().split(ANALYSIS, 1) if path.exists() else []
    tail = ["", ANALYSIS + kept[1].rstrip("\n")] if len(kept) == 2 else []
    path.write_text("\n".join(lines + tail) + "\n")


def rounded(value: Any) -> Any:
    """`value` with its floats rounded to 5 decimals (seconds: 10 us)."""
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value
