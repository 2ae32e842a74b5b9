"""HF model families through both fronts against one process: the family table.

    .venv/bin/python bench/bench_families.py                # every family, both fronts
    .venv/bin/python bench/bench_families.py --tag before   # writes families_before.* instead
    .venv/bin/python bench/bench_families.py --only gpt2,opt --fronts accelerate

Each row trains a tiny model of one family (hidden 32, 4 layers, vocab 64, from its config, fp32,
dropout off) on right-padded rows of 3 to 12 tokens (attention mask, labels -100 on padding), and
the same model in one process on the same global batches, then compares:

- Accelerate: the run_clm-shaped loop of `tests/distributed/clm_loop.py` under
  `ZeroPPAccelerator` on 4 gloo ranks, pp 2 x dp_shard 2, 2 micro-batches, 4 updates of 8 rows,
  AdamW in decay / no-decay groups, cosine schedule, no clipping; then run_clm's eval loss over
  10 rows (a short last batch), against one process evaluating per-device batches of 2 (which
  DDP's eval equals).
- Lightning: `tests/distributed/hf_lightning_scenarios.py` (a LightningModule calling
  `self.model(ids, attention_mask=..., labels=...).loss`) under `ZeroPPStrategy` on 2 ranks,
  pp 2, 2 micro-batches, 3 steps of 8 rows, SGD.

Columns: the largest loss difference over the steps, the largest parameter difference after
training (every parameter of the one-process model), the largest difference between the
pipeline's copies of a tied weight after any step, and the error a run ended with. Writes
`bench/results/families.{md,json}` (or `families_<tag>.*`); the markdown shows the `before`
table too when `families_before.json` exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import machine  # noqa: E402

from tests.distributed.launch import launch  # noqa: E402

# (row, family, tied)
ROWS = [
    ("llama", "llama", False),
    ("llama-tied", "llama", True),
    ("gpt2", "gpt2", True),
    ("opt", "opt", True),
    ("gemma", "gemma", True),
    ("gemma2", "gemma2", True),
    ("phi3", "phi3", False),
    ("qwen2", "qwen2", False),
    ("mistral", "mistral", False),
    ("gpt_neox", "gpt_neox", False),
]
ACC_PLUGIN = {"pp_size": 2, "dp_shard_size": 2, "num_microbatches": 2}
ONE_PROCESS = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 2}
LIT_STRATEGY = {"pp_size": 2, "num_microbatches": 2}


def _launch(world: int, scenario: str, params: dict[str, Any], out: Path) -> list[Any] | str:
    try:
        return launch(world, scenario, {**params, "init_process_group": False}, out, timeout=400)
    except AssertionError as err:  # a rank died or hung: the table says so
        lines = [ln for ln in str(err).splitlines() if "Error" in ln]
        return f"launch failed: {lines[-1].strip() if lines else str(err)[:200]}"


def _compare(got: Any, ref: Any, keys: tuple[str, str]) -> dict[str, Any]:
    """Differences between one rank's result (the main process's) and the reference's."""
    if isinstance(got, str) or isinstance(ref, str):
        return {"error": got if isinstance(got, str) else f"reference: {ref}"}
    if "error" in got or "error" in ref:
        return {"error": got.get("error") or f"reference: {ref['error']}"}
    loss_key, params_key = keys
    losses = [abs(a - b) for a, b in zip(got[loss_key], ref[loss_key], strict=True)]
    ref_params, params = ref[params_key], got[params_key]
    missing = sorted(set(ref_params) - set(params))
    diffs = [
        float((params[k].float() - v.float()).abs().max())
        for k, v in ref_params.items()
        if k in params
    ]
    out = {
        "loss_diff": max(losses),
        "param_diff": max(diffs) if diffs else None,
        "first_loss": got[loss_key][0],
        "first_loss_ref": ref[loss_key][0],
        "tied_gap": max(got.get("updates") or got.get("gaps") or [0.0]),
    }
    if "eval_loss" in got:
        out["eval_diff"] = abs(got["eval_loss"] - ref["eval_loss"])
    if missing:
        out["error"] = f"parameters missing from the pipeline's state: {missing[:3]}"
    return out


def accelerate_row(family: str, tied: bool, tmp: Path) -> dict[str, Any]:
    args = {"family": family, "tie_word_embeddings": tied, "max_grad_norm": None, "eval_rows": 10}
    case = {"id": "c", "args": args, "plugin": ACC_PLUGIN, "tied_gap": True, "catch": True}
    pipe = _launch(4, "clm_scenarios.run", {"cases": [case]}, tmp / "pp")
    one_case = {"id": "c", "args": {**args, **ONE_PROCESS}, "catch": True}
    one = _launch(1, "clm_scenarios.run", {"cases": [one_case]}, tmp / "one")
    got = pipe if isinstance(pipe, str) else pipe[0]["c"]
    ref = one if isinstance(one, str) else one[0]["c"]
    return _compare(got, ref, ("loss", "params"))


def lightning_row(family: str, tied: bool, tmp: Path) -> dict[str, Any]:
    common = {"family": family, "tie_word_embeddings": tied, "catch": True}
    pipe = _launch(
        2,
        "hf_lightning_scenarios.run",
        {**common, "strategy": LIT_STRATEGY, "devices": 2},
        tmp / "pp",
    )
    one = _launch(
        1, "hf_lightning_scenarios.run", {**common, "strategy": None, "devices": 1}, tmp / "one"
    )
    got = pipe if isinstance(pipe, str) else pipe[0]
    ref = one if isinstance(one, str) else one[0]
    return _compare(got, ref, ("losses", "params"))


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.1e}" if isinstance(value, float) else str(value)


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| model | front | loss diff | param diff | tied copies apart | eval diff | first loss "
        "(one process) | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        row, front = key.split("/")
        first = f"{r['first_loss']:.4f} ({r['first_loss_ref']:.4f})" if "first_loss" in r else "-"
        error = (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
        lines.append(
            f"| {row} | {front} | {_fmt(r.get('loss_diff'))} | {_fmt(r.get('param_diff'))} | "
            f"{_fmt(r.get('tied_gap'))} | {_fmt(r.get('eval_diff'))} | {first} | {error} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="", help="results/families_<tag>.*")
    parser.add_argument("--only", default="", help="comma-separated rows (default: all)")
    parser.add_argument("--fronts", default="accelerate,lightning")
    opts = parser.parse_args()
    rows = [r for r in ROWS if not opts.only or r[0] in opts.only.split(",")]
    fronts = opts.fronts.split(",")
    facts = machine()
    results: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_families_") as tmp:
        for row, family, tied in rows:
            for front in fronts:
                run = accelerate_row if front == "accelerate" else lightning_row
                t0 = time.monotonic()
                results[f"{row}/{front}"] = run(family, tied, Path(tmp) / row / front)
                took = time.monotonic() - t0
                print(f"{row}/{front} ({took:.0f} s): {results[f'{row}/{front}']}", flush=True)
    name = f"families_{opts.tag}" if opts.tag else "families"
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": facts, "results": results}, indent=1))
    text = [
        "# HF families against one process",
        "",
        "`.venv/bin/python bench/bench_families.py` (see its docstring for the runs). fp32; "
        "differences are absolute; `-` where not applicable; a tied model's copies must be 0.",
        "",
        f"Machine: {json.dumps(facts)}; {time.monotonic() - start:.0f} s wall.",
        "",
        *table(results),
        "",
    ]
    before = out / "families_before.json"
    if not opts.tag and before.exists():
        old = json.loads(before.read_text())
        text += [
            "## Before (the code before these fixes)",
            "",
            "The library as it was before the fixes for issue 21, run with this benchmark and "
            'its scenario files copied over it (hence the commit\'s "uncommitted changes").',
            "",
            f"Machine: {json.dumps(old['machine'])}",
            "",
            *table(old["results"]),
            "",
        ]
    (out / f"{name}.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
