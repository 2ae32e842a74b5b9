"""A model larger than each rank may hold trains, exactly, in ranks capped below its size.

The ~1.4B Llama of `capped_scenarios` (5.2 GiB in fp32): 4 ranks, each in a memory cgroup capped
at 0.95 x the whole model, build it on meta, load their shards from safetensors and train 2 SGD
steps under the ZeroPP schedule. Checked against one process training the whole model: the loss
of each step, and the sum and absolute sum of every gradient over each rank's own shard rows.
Each rank is a fresh process that joins its cgroup before importing anything, so the cap covers
Python and torch too; its peak of anonymous memory (and the cgroup's, page cache included) is
printed against its shards. Last seen: 4.34-4.35 GiB under the 4.93 GiB cap.

Slow (about 5 minutes on 2 cores, 5.2 GB of weights written once under /tmp): run by
`bench/slow_tests.py`. Needs root and cgroup v1's memory controller; skips without them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed.capped_scenarios import SHAPE_1_4B, llama_config, write_weights
from tests.distributed.cgroup import MEMORY_CGROUPS
from tests.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WEIGHTS = Path("/tmp/lzpp_capped/llama-1.4b")
STEPS = 2


@pytest.mark.skipif(
    not (MEMORY_CGROUPS.is_dir() and os.access(MEMORY_CGROUPS, os.W_OK)),
    reason="needs cgroup v1 memory, root",
)
def test_capped_ranks_train_a_model_larger_than_each_exactly(tmp_path: Path) -> None:
    weights = write_weights(llama_config(SHAPE_1_4B), WEIGHTS)
    model_bytes = sum(f.stat().st_size for f in weights.glob("*.safetensors"))
    cap = int(0.95 * model_bytes)
    params = {"weights": str(weights), "cap": cap, "steps": STEPS, "init_process_group": False}
    ranks = launch(
        4, "capped_scenarios.capped_train", params, tmp_path / "ranks", 1500, memory_cap=cap
    )
    where: dict[str, list] = {}
    for r in ranks:
        for name, (chunk, _, _) in r["grad_sums"][0].items():
            where.setdefault(name, []).append(chunk)
    ref_params = {"weights": str(weights), "where": where, "steps": STEPS}
    (ref,) = launch(1, "capped_scenarios.reference", ref_params, tmp_path / "ref", timeout=900)

    for r in ranks:
        print(
            f"rank: anonymous memory peak {r['anon_peak'] / 2**30:.2f} GiB, cgroup peak (page "
            f"cache included) {r['cgroup_peak'] / 2**30:.2f}, cap {cap / 2**30:.2f}; its "
            f"shards {r['shard_bytes'] / 2**30:.2f} GiB of a {model_bytes / 2**30:.2f} GiB model"
        )
        # Finishing under the cap is the proof (the cgroup kills a rank that needs more).
        assert r["capped"] and r["anon_peak"] < cap < model_bytes
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    seen = {name: 0 for name in where}
    for step in range(STEPS):
        for r in ranks:
            for name, (chunk, total, absolute) in r["grad_sums"][step].items():
                want_total, want_abs = ref["grad_sums"][step][name][where[name].index(chunk)]
                assert absolute == pytest.approx(want_abs, rel=1e-5), (step, name, chunk)
                assert abs(total - want_total) <= 1e-5 * want_abs, (step, name, chunk)
                seen[name] += 1
    # every parameter of the model, on every rank holding a part of it, at every step
    assert len(where) == 3 + 9 * SHAPE_1_4B["num_hidden_layers"]  # embeddings, norm, head
    assert all(n == STEPS * len(where[name]) for name, n in seen.items())
