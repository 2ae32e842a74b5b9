"""compile=True on gloo ranks: `core_scenarios`' training, with the compile counters per case."""

from __future__ import annotations

from typing import Any

from lightning_zeropp.core._torch_private import set_compile_threads
from lightning_zeropp.core.shard.compile import compile_stats
from tests.distributed.core_scenarios import _train


def parity(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Train every case (compile is one of its layout settings); each result also says how many
    graphs this rank compiled and how often compiled code ran during that case."""
    set_compile_threads(1)  # ranks share two cores: no pool of compile workers per rank
    out = {}
    for case in cases:
        before = compile_stats()
        result = _train(**case)
        result["compile"] = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
        out[case["id"]] = result
    return out


def fit_hf_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """`hf_scenarios.fit_hf` (an HF model under `Trainer(strategy=ZeroPPStrategy(...))`) per case,
    with the compile counters of each."""
    from tests.distributed.hf_scenarios import fit_hf

    set_compile_threads(1)
    out = {}
    for case in cases:
        before = compile_stats()
        result = fit_hf(**{k: v for k, v in case.items() if k != "id"})
        result["compile"] = {k: v - before.get(k, 0) for k, v in compile_stats().items()}
        out[case["id"]] = result
    return out
