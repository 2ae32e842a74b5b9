"""The tables of `bench_faults.py`: fault cases named on every rank, hangs, and bad inputs clear
on every rank, per tree measured."""

from __future__ import annotations

import json

from common import ROOT, machine

__all__ = ["write"]


def _figures(result: dict) -> dict:
    cases, inputs = result["cases"], result["bad_inputs"]
    return {
        "named": sum(c["named_on_every_survivor"] for c in cases),
        "tried": len(cases),
        "hangs": sum(bool(c["hung"]) for c in cases),
        "clear": sum(i["clear_on_every_rank"] for i in inputs),
        "inputs": len(inputs),
    }


def write(results: dict[str, dict], hang_after_s: float) -> None:
    """`bench/results/faults.{json,md}` from each tree's results (`hang_after_s`: what counted
    as a hang)."""
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    facts = machine()
    (out / "faults.json").write_text(json.dumps({"machine": facts, **results}, indent=1))
    lines = [
        "# Faults and bad inputs (`bench/bench_faults.py`)",
        "",
        f"Machine: {json.dumps(facts)}",
        "",
        "4 CPU ranks, pp 2 x dp_shard 2, process-group timeout 20 s. A case is *named* when every "
        "survivor's error names the lost rank (a partition: a rank of the other side) as lost; a "
        f"*hang* is a rank still running {hang_after_s:g} s after the loss.",
        "",
        "| tree | fault cases named on every rank / tried | cases with a hang | new bad inputs "
        "clear on every rank / tried |",
        "|---|---|---|---|",
    ]
    for label, result in results.items():
        f = _figures(result)
        lines.append(
            f"| {label} ({result['commit']}) | {f['named']} / {f['tried']} | {f['hangs']} | "
            f"{f['clear']} / {f['inputs']} |"
        )
    for label, result in results.items():
        lines += ["", f"## {label} ({result['commit']}); partitions: {result['partition']}", ""]
        lines += ["| case | lost | named on every survivor | hung | slowest survivor done (s) |"]
        lines += ["|---|---|---|---|---|"]
        for c in result["cases"]:
            lost = f"rank {c['victim']} ({c['how']}, {c['where']})" if c["victim"] >= 0 else (
                "link between ranks 0-1 and 2-3 cut")  # fmt: skip
            lines.append(
                f"| {c['case']} | {lost} | {'yes' if c['named_on_every_survivor'] else 'no'} | "
                f"{c['hung'] or ''} | {c['slowest_s']} |"
            )
        lines += ["", "| bad input | clear on every rank | rank 0 saw |", "|---|---|---|"]
        for i in result["bad_inputs"]:
            said = i["rank0"].replace("|", "/").replace("\n", " ")
            lines.append(
                f"| {i['input']} | {'yes' if i['clear_on_every_rank'] else 'no'} | {said} |"
            )
        unnamed = [c for c in result["cases"] if not c["named_on_every_survivor"]]
        if unnamed:
            lines += ["", "What survivors raised where the lost rank was not named:", ""]
            for c in unnamed:
                for r in c["ranks"]:
                    if not r["named"]:
                        lines.append(f"- {c['case']}, rank {r['rank']}: `{r['error'][:250]}`")
    (out / "faults.md").write_text("\n".join(lines) + "\n")
