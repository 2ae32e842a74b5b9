"""Lightning checkpoints under `ZeroPPStrategy`, as Lightning users expect them from FSDP.

- `state_dict_type="full"`: `ModelCheckpoint` and `trainer.save_checkpoint` write one ordinary
  file; `LitGPT.load_from_checkpoint` reads it in this process (no strategy) and gets the trained
  weights; its optimizer state is what one-process AdamW would hold.
- the default sharded directory: Lightning's own `consolidate_checkpoint` command turns it into a
  file that `load_from_checkpoint` reads.
- `ckpt_path=` a full file (or a consolidated one) resumes exactly like an uninterrupted run.
"""

from __future__ import annotations

import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lightning_zeropp import ZeroPPStrategy
from lightning_zeropp.models.lit_gpt import LitGPT
from tests.distributed.common import MODEL, lm_loss, make_model, make_optimizer, sampler_batches
from tests.distributed.launch import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    params = {"out": str(root / "out"), "init_process_group": False}
    results = launch(4, "checkpoint_scenarios.run_all", params, root / "logs", timeout=420)
    return root / "out", results


def _trained(results, run_id: str) -> dict[str, torch.Tensor]:
    """The network's parameters after the run, merged from every rank's stages."""
    params: dict[str, torch.Tensor] = {}
    for rank_result in results:
        params |= rank_result[run_id]["params"]
    return params


def _assert_loads_trained_weights(path: Path, trained: dict[str, torch.Tensor]) -> None:
    module = LitGPT.load_from_checkpoint(path, model=MODEL)  # one process, no strategy
    got = dict(module.model.named_parameters())
    assert got.keys() == trained.keys()
    for name, want in trained.items():
        torch.testing.assert_close(got[name].detach(), want, rtol=0, atol=1e-6, msg=name)


def test_state_dict_type_is_validated():
    with pytest.raises(ValueError, match=r"state_dict_type='fulll'.*'sharded'.*'full'"):
        ZeroPPStrategy(state_dict_type="fulll")
    with pytest.raises(ValueError, match=r"async_save=True writes sharded checkpoints"):
        ZeroPPStrategy(state_dict_type="full", async_save=True)


# ModelCheckpoint saves at the end of epoch 0; trainer.save_checkpoint after fit, in epoch 1.
@pytest.mark.parametrize(("name", "epoch"), [("full/epoch=0.ckpt", 0), ("explicit.ckpt", 1)])
def test_full_checkpoint_is_one_file_load_from_checkpoint_reads(run, name, epoch):
    out, results = run
    path = out / name
    assert path.is_file()
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # written atomically
    checkpoint = torch.load(path, weights_only=True)  # plain tensors and Python values only
    assert list(checkpoint["state_dict"]) == list(LitGPT(MODEL).state_dict())  # same keys, order
    assert checkpoint["epoch"] == epoch and checkpoint["global_step"] == 3
    for key in ("loops", "callbacks", "lr_schedulers", "optimizer_states"):
        assert key in checkpoint, key
    _assert_loads_trained_weights(path, _trained(results, "full"))


def test_strategy_full_state_dict_is_the_network_part_of_the_file(run):
    out, results = run
    saved = torch.load(out / "explicit.ckpt", weights_only=True)["state_dict"]
    got = results[0]["full"]["network_state"]
    assert list(got) == list(make_model().state_dict())  # the unsplit network's names and order
    for name, value in got.items():
        torch.testing.assert_close(value, saved[f"model.{name}"], rtol=0, atol=0)
    assert all(r["full"]["network_state"] == {} for r in results[1:])


def test_full_checkpoint_optimizer_state_is_one_process_format(run):
    """AdamW's state after the same 3 steps in one process, numbered as one process numbers
    `LitGPT.parameters()`; a one-process optimizer loads it."""
    out, _ = run
    saved = torch.load(out / "full" / "epoch=0.ckpt", weights_only=True)["optimizer_states"]
    model = make_model(0)
    opt = make_optimizer("adamw", model.parameters())  # LitGPT's AdamW settings
    for x, y in sampler_batches(3):
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()
    assert len(saved) == 1
    (got,) = saved
    assert len(got["param_groups"]) == len(want["param_groups"]) == 1
    got_group, want_group = got["param_groups"][0], want["param_groups"][0]
    assert got_group.pop("param_names") == [f"model.{n}" for n, _ in model.named_parameters()]
    assert got_group == want_group  # hyperparameters, and the parameter numbers 0..n-1
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=0, atol=1e-6)
    one_process = LitGPT(MODEL, optimizer="adamw", lr=1e-3).configure_optimizers()
    one_process.load_state_dict(saved[0])


def test_an_async_save_after_fit_is_complete_when_it_returns(run):
    out, results = run
    assert all(r["sharded"]["saved_meta"] for r in results)  # read right after the call
    assert not (out / "after-fit.ckpt").is_symlink()  # a plain directory: cp -r copies it
    assert (out / "after-fit.ckpt" / ".metadata").is_file()


def test_async_saves_every_other_step_with_last_all_complete(run):
    # ModelCheckpoint(every_n_train_steps=2, save_last=True) beside the per-epoch one, all in the
    # background: each save waits for the last; last.ckpt holds step 6 once fit returns.
    out, _ = run
    folder = out / "every2"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    for name in ("epoch=1-step=6.ckpt", "last.ckpt"):
        path = folder / name
        assert path.is_dir() and not path.is_symlink() and (path / "SHA256SUMS").is_file()
        assert torch.load(path / "meta.pt", weights_only=True)["global_step"] == 6


@pytest.mark.slow  # 200 steps, 200 background saves: bench/slow_tests.py
def test_two_hundred_steps_of_async_saves_every_other_step_finish(tmp_path):
    params = {"out": str(tmp_path / "out"), "steps": 200, "init_process_group": False}
    results = launch(4, "checkpoint_scenarios.async_every_two", params, tmp_path, timeout=1500)
    for rank_result in results:
        assert rank_result["logged"] == 200
        assert rank_result["files"] == ["epoch=66-step=200.ckpt", "last.ckpt"]


def test_consolidated_sharded_checkpoint_loads(run, tmp_path, monkeypatch):
    out, results = run
    directory = out / "sharded" / "epoch=1.ckpt"  # saved in the background, done when fit returns
    assert (directory / "meta.pt").is_file() and not directory.is_symlink()
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    target = tmp_path / "consolidated.ckpt"
    # `python -m lightning.pytorch.utilities.consolidate_checkpoint DIR --output_file FILE`, run in
    # this process (saves starting another interpreter).
    monkeypatch.setattr(sys, "argv", ["consolidate", str(directory), "--output_file", str(target)])
    runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")
    _assert_loads_trained_weights(target, _trained(results, "sharded"))


def test_load_from_checkpoint_reads_a_sharded_folder(run):
    """Before: Lightning's loader opened the folder as a file, IsADirectoryError."""
    out, results = run
    directory = out / "sharded" / "epoch=1.ckpt"
    _assert_loads_trained_weights(directory, _trained(results, "sharded"))


def test_load_from_checkpoint_refuses_a_changed_shard_naming_it(run, tmp_path):
    out, _ = run
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(out / "sharded" / "epoch=1.ckpt", copy)
    shard = sorted(copy.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match=re.escape(shard.name)):
        LitGPT.load_from_checkpoint(copy, model=MODEL)


@pytest.mark.parametrize("run_id", ["resumed", "resumed_consolidated"])
def test_resume_from_a_file_continues_exactly(run, run_id):
    _, results = run
    for rank_result in results:
        straight, resumed = rank_result["sharded"], rank_result[run_id]
        assert len(straight["logged"]) == 6 and len(resumed["logged"]) == 3
        # the resumed module started from other weights (seed 7): only the file makes these equal
        torch.testing.assert_close(
            torch.tensor(resumed["logged"]),
            torch.tensor(straight["logged"][3:]),
            rtol=0,
            atol=1e-6,
        )
    trained, resumed = _trained(results, "sharded"), _trained(results, run_id)
    for name, want in trained.items():
        torch.testing.assert_close(resumed[name], want, rtol=0, atol=1e-6, msg=name)


def test_a_resume_mid_epoch_with_another_global_batch_is_refused_naming_the_rows(run):
    # Saved at step 2 of 3 with 16 rows a batch (32 trained); resumed with 32: skipping 2
    # batches would skip 64 rows, 32 never trained. Every rank says so.
    _, results = run
    for rank_result in results:
        assert re.search(
            r"saved with a global batch of 16 rows \(32 rows trained.*global batch is 32 rows.*"
            r"skip 64 rows, 32 of them never trained",
            rank_result["other_batch"],
        ), rank_result["other_batch"]
