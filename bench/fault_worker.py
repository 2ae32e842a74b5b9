"""One rank of a `bench_faults.py` run: `fault_worker.py TREE MODE NAME OUT TIMEOUT_S`.

TREE (the library and its tests, as of the commit under test) goes first on `sys.path`; the
cases themselves are read from this checkout's `tests/distributed/fault_scenarios.py` and
`error_scenarios.py`, so the same cases run on an older tree. MODE is `case` (one fault case,
`fault_scenarios._run`) or `attempts` (the bad inputs NAME lists, comma-separated, through
`error_scenarios.attempt_all`). The rank's result goes to OUT/result<rank>.pt.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _load(name: str, tree: Path) -> object:
    """This checkout's `tests/distributed/<name>.py`, importing the library from `tree`."""
    spec = importlib.util.spec_from_file_location(
        name, HERE / "tests" / "distributed" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    tree, mode, name, out, timeout_s = sys.argv[1:6]
    sys.path.insert(0, tree)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, where = int(os.environ["RANK"]), Path(out)
    if mode == "case":
        result = _load("fault_scenarios", Path(tree))._run(name, where, float(timeout_s))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))
        attempts = _load("error_scenarios", Path(tree))
        (where / "work").mkdir(exist_ok=True)
        result = attempts.attempt_all(str(where / "work"), only=name.split(","))
    torch.save(result, where / f"result{rank}.pt")
    os._exit(0)  # a failed run's groups are unusable: no teardown to wait on


if __name__ == "__main__":
    main()
