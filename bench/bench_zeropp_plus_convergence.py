"""ZeRO++ convergence: 300 steps of the main job's model and data, quantized against not.

    .venv/bin/python bench/bench_zeropp_plus_convergence.py      # ~6 min on 2 cores

The main job's settings (`conf/`: the bundled GPT, the bundled Markov language, global batch 32,
AdamW lr 3e-3 with weight decay 0.1, 30 warm-up steps then cosine to 10%, clipping at 1.0), on
4 ranks as 2 nodes of 2 under FSDP2 (ZeRO-3 over all 4), fp32. Rows: unquantized; INT8
gradients (qgZ); INT4 gradients with error feedback; INT4 without it; all three techniques
(INT8 weights, hpZ, INT4 gradients with error feedback). Every row sees the same data in the
same order from the same initial weights.

Final loss: the mean of the last 20 steps' training losses (one step's loss is noisy). Writes
`bench/results/zeropp_plus_convergence.{md,json,png}` (the loss curves in one plot).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, launch_ranks, machine  # noqa: E402

BASE = {"dp_shard_size": 4, "node_size": 2}
ROWS = {
    "unquantized": {},
    "int8 gradients": {"quantized_gradients": "int8"},
    "int4 gradients + error feedback": {"quantized_gradients": "int4"},
    "int4 gradients, no error feedback": {
        "quantized_gradients": "int4",
        "gradient_error_feedback": False,
    },
    "all three (int8 w, hpZ, int4 g + EF)": {
        "quantized_weights": "int8",
        "hpz_partition_size": 2,
        "quantized_gradients": "int4",
    },
}
STEPS, GLOBAL_BATCH, SEQ, LR, WARMUP = 300, 32, 64, 3e-3, 30
TAIL = 20


def run_rank(row: str, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_zeropp import launch_layout
    from lightning_zeropp.core import ZeroPPConfig, ZeroPPEngine
    from lightning_zeropp.models import GPT, GPTConfig
    from lightning_zeropp.models.data import TokenDataset
    from lightning_zeropp.models.lr import warmup_cosine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    config = ZeroPPConfig(**BASE, **ROWS[row]).resolve(dist.get_world_size())
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=SEQ, dim=128, num_heads=4, num_layers=8))

    def loss_fn(logits: Any, y: Any) -> Any:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    engine = ZeroPPEngine(model, launch_layout(config), loss_fn=loss_fn)
    opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, WARMUP, steps))
    data = TokenDataset.markov(steps * GLOBAL_BATCH, SEQ)
    per = GLOBAL_BATCH // config.dp_size
    losses = []
    for step in range(steps):
        rows = range(
            step * GLOBAL_BATCH + engine.dims.dp_rank * per,
            step * GLOBAL_BATCH + (engine.dims.dp_rank + 1) * per,
        )
        x = torch.stack([data[i][0] for i in rows])
        y = torch.stack([data[i][1] for i in rows])
        losses.append(float(engine.train_step(x, target=y)))
        engine.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    rank = dist.get_rank()
    (out / f"rank{rank}.json.partial").write_text(json.dumps({"losses": losses}))
    (out / f"rank{rank}.json.partial").rename(out / f"rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


def final(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


def write(meta: dict[str, Any], curves: dict[str, list[float]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "zeropp_plus_convergence.json").write_text(
        json.dumps({"meta": meta, "losses": curves}, indent=1)
    )
    base = final(curves["unquantized"])
    m = meta["machine"]
    lines = [
        "# ZeRO++ convergence (`bench/bench_zeropp_plus_convergence.py`)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; {m['date']}; commit "
        f"{m['commit']}. {meta['steps']} steps, 4 ranks as 2 nodes of 2, FSDP2 over all 4, fp32.",
        f"Final loss = mean of the last {TAIL} steps' training losses.",
        "",
        "| row | final loss | vs unquantized | loss at step 50 | 150 |",
        "|---|---|---|---|---|",
    ]
    for name, losses in curves.items():
        f = final(losses)
        lines.append(
            f"| {name} | {f:.4f} | {100 * (f - base) / base:+.2f}% | {losses[49]:.4f} | "
            f"{losses[149]:.4f} |"
        )
    lines += ["", "![loss curves](zeropp_plus_convergence.png)"]
    (out / "zeropp_plus_convergence.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title="ZeRO++ on FSDP2: 4 ranks as 2 nodes")
    ax.set_ylim(top=min(max(curves["unquantized"][:5]), 6.0))
    ax.legend()
    fig.savefig(out / "zeropp_plus_convergence.png", dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker, args.steps, args.out)
        return
    script = str(Path(__file__).resolve())
    curves = {}
    for row in ROWS:
        print(row, flush=True)
        ranks = launch_ranks(script, row, 4, ["--steps", str(args.steps)], timeout_s=3600)
        curves[row] = ranks[0]["losses"]
    meta = {"machine": machine(), "steps": args.steps}
    out = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
    write(meta, curves, out)
    print((out / "zeropp_plus_convergence.md").read_text())


if __name__ == "__main__":
    main()
