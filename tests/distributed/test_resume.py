"""A run stopped anywhere in an epoch and resumed continues with the next unseen batch, in both
fronts: per rank and step, the resumed run trains on the uninterrupted run's rows, with its loss
(within 1e-6), and ends with its parameters. Each resumed run starts from other initial weights, so
only the checkpoint makes these equal. Scenarios: tests/distributed/resume_scenarios.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_zeropp.lightning.data import ResumingLoader, resuming_loader, skip_batches
from tests.distributed.conftest import merged_params
from tests.distributed.launch import ROOT, launch


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_lightning")
    params = {"out": str(root / "out"), "init_process_group": False}
    return launch(4, "resume_scenarios.lightning", params, root / "logs", timeout=420)


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_accelerate")
    params = {"out": str(root / "out"), "init_process_group": False}
    return launch(4, "resume_scenarios.accelerate", params, root / "logs", timeout=420)


def _assert_continues(straight: dict, resumed: dict, first_step: int) -> None:
    done = first_step - 1
    assert resumed["steps"] == straight["steps"][done:] == list(range(first_step, 9))
    assert resumed["rows"] == straight["rows"][done:], "the resumed run trained on other rows"
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]),
        torch.tensor(straight["losses"][done:]),
        rtol=0,
        atol=1e-6,
    )


def _assert_same_params(want: dict, got: dict) -> None:
    assert got.keys() == want.keys() and want
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("run_id", "first_step"),
    [
        ("step4", 5),  # every_n_train_steps at the epoch's last batch
        ("step6", 7),  # mid-epoch 1 (the sampler's epoch 1 order), under max_steps
    ],
)
def test_lightning_resume_continues_with_the_next_batch(lightning_runs, run_id, first_step):
    for rank_result in lightning_runs:
        _assert_continues(rank_result["straight"], rank_result[run_id], first_step)
    _assert_same_params(
        merged_params(lightning_runs, "straight"), merged_params(lightning_runs, run_id)
    )


@pytest.mark.distributed
@pytest.mark.parametrize(("run_id", "first_step"), [("step6", 7)])
def test_run_clm_resume_continues_with_the_next_batch(accelerate_runs, run_id, first_step):
    """run_clm's `resume_step` counts batches of the prepared loader (each data-parallel rank
    reads pp_size per-process batches per step), which is what `skip_first_batches` skips. Its
    batches are padded to their longest row: some micro-batches have no padding at all."""
    for rank_result in accelerate_runs:
        _assert_continues(rank_result["straight"], rank_result[run_id], first_step)
    main = accelerate_runs[0]  # the whole model lands on the main process
    _assert_same_params(main["straight"]["params"], main[run_id]["params"])
    # The training batches the model ran (what a SIGTERM message's step is counted from) go
    # on from the checkpoint's: before, they restarted at 0 (2 here, against 8).
    assert [r[run_id]["batches"] for r in accelerate_runs] == [8] * 4


@pytest.mark.distributed
def test_run_clm_resume_with_another_global_batch_is_refused(accelerate_runs):
    """Saved 2 batches into epoch 1 at 8 rows a batch (4 processes x 2), loaded into a loop of
    16 rows a batch. Before: load_state took it, and run_clm's resume arithmetic (starting epoch
    6 // 2 = 3 of 2) ended the loop without training a step, exit 0."""
    for rank_result in accelerate_runs:
        assert re.fullmatch(
            r"load_state\('.*step_6'\) resumes 2 batches into an epoch, saved with a global "
            r"batch of 8 rows \(16 rows trained\); this run's global batch is 16 rows, so "
            r"skipping 2 batches would skip 32 rows, 16 of them never trained\. Prepare the "
            r"training loader with the batch size the state was saved with .*",
            rank_result["other_batch"] or "",
        ), rank_result["other_batch"]


# ------------------------------------------------------------------ the loader, in one process
class Counted(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded += 1
        return i


def test_skip_batches_skips_indices_without_loading():
    data = Counted(10)
    loader = DataLoader(data, batch_size=2)
    assert [b.tolist() for b in skip_batches(loader, 3)] == [[6, 7], [8, 9]]
    assert data.loaded == 4  # the 3 skipped batches were never read
    assert [b.tolist() for b in skip_batches(loader, 0)][0] == [0, 1]


def test_skip_batches_of_any_iterable():
    assert list(skip_batches([[0], [1], [2]], 2)) == [[2]]


def test_resuming_loader_reads_the_count_at_the_first_batch():
    done = [0]
    loader = resuming_loader(DataLoader(Counted(6), batch_size=2), _Trainer(done))
    assert isinstance(loader, ResumingLoader) and len(loader) == 3
    epoch = iter(loader)  # Lightning creates the iterator before restoring its progress
    done[0] = 2
    assert [b.tolist() for b in epoch] == [[4, 5]]
    assert loader.batch_size == 2  # the loader's own attributes


def test_stateful_loaders_are_left_to_lightning():
    class Stateful(list):
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    loader = Stateful([[0], [1]])
    assert resuming_loader(loader, _Trainer([1])) is loader


class _Trainer:
    """What `resuming_loader` reads of a Trainer: the training epoch loop's batch progress, the
    strategy's sampler arguments and the epoch."""

    def __init__(self, done: list[int]) -> None:
        current = type("Current", (), {"ready": property(lambda _: done[0])})()
        progress = type("Progress", (), {"current": current})()
        epoch_loop = type("EpochLoop", (), {"batch_progress": progress})()
        self.fit_loop = type("FitLoop", (), {"epoch_loop": epoch_loop})()
        # read by the resume's global-batch check (`lightning.data.check_resumed_rows`)
        self.strategy = type("Strategy", (), {"distributed_sampler_kwargs": {}})()
        self.current_epoch = 0


@pytest.mark.distributed
@pytest.mark.slow  # two torchrun attempts of a 4-rank fit: bench/slow_tests.py runs it
def test_rank_killed_under_torchrun_restarts_and_finishes_as_unkilled(lightning_runs, tmp_path):
    """`torchrun --max-restarts 1`: rank 1 dies before step 6 on the first attempt; the restarted
    attempt resumes from the last checkpoint and ends with the unkilled run's loss and weights."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["--max-restarts=1", "-m", "tests.distributed.worker", "resume_scenarios.elastic"]
    cmd += [json.dumps({"out": str(tmp_path / "ckpt"), "init_process_group": False}), str(tmp_path)]
    # torchrun shares its rendezvous store with the workers by default, and a restarted attempt
    # can then read the previous attempt's gloo addresses and fail or hang in
    # init_process_group (pytorch/pytorch#135712); launchers that restart set this.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with open(tmp_path / "torchrun.log", "w") as log:
        # A session of its own: on a timeout, torchrun and its workers are killed together.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    tail = "\n".join((tmp_path / "torchrun.log").read_text().splitlines()[-40:])
    assert code == 0, f"torchrun: {code}\n{tail}"
    results = [torch.load(tmp_path / f"result{r}.pt", weights_only=False) for r in range(4)]
    for rank_result, straight in zip(results, lightning_runs, strict=True):
        assert rank_result["attempt"] == "1", "the first attempt was not killed"
        first_step = rank_result["steps"][0]
        assert first_step in (5, 6), rank_result["steps"]  # from the last complete checkpoint
        _assert_continues(straight["straight"], rank_result, first_step)
    got = merged_params([{"elastic": r} for r in results], "elastic")
    _assert_same_params(merged_params(lightning_runs, "straight"), got)
