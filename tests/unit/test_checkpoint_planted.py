"""No code from any checkpoint file a front reads: a `__reduce__` pickle planted in each file of a
`ZeroPPTrainer`, Accelerate and Lightning checkpoint folder never runs, and the refusal names the
file (and never suggests allowing a callable).

One process. Each folder is laid out as the front writes it, with good files; then one file at a
time is replaced by a pickle that would create a marker file when loaded, in three variants: the
checksums left stale (refused as changed), rewritten by the attacker (refused as code), and the
folder reached through a symbolic link.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers.training_args import ParallelMode

from lightning_zeropp.core.weights import checksum
from lightning_zeropp.core.weights.trust import read_data, weights_only_loads

MARKER = "code-ran"


class Planted:
    """Unpickling it creates the file `path`: the test sees whether a load ran code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _plant(file: Path, marker: Path, sums: str) -> None:
    torch.save({"state": Planted(marker)}, file)
    if sums in ("rewritten", "symlink"):  # the attacker fixes the checksums too
        checksum.write_folder_sums(file.parent)


def _variant(folder: Path, sums: str) -> Path:
    if sums != "symlink":
        return folder
    link = folder.parent / f"{folder.name}-link"
    link.symlink_to(folder)
    return link


SUMS = ["stale", "rewritten", "symlink"]


# ------------------------------------------------------------------------------ ZeroPPTrainer
def _trainer_folder(root: Path) -> Path:
    """A `checkpoint-<step>` folder as `ZeroPPTrainer` writes it (the sharded state's `meta.pt`
    is all `check_resumable` reads of it)."""
    folder = root / "checkpoint-3"
    (folder / "zeropp").mkdir(parents=True)
    torch.save({"world_size": 1}, folder / "zeropp" / "meta.pt")
    checksum.write_sums(folder / "zeropp")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    torch.save(torch.optim.lr_scheduler.StepLR(opt, 2).state_dict(), folder / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch.save({**rng, "cpu": torch.random.get_rng_state()}, folder / "rng_state_0.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    checksum.write_folder_sums(folder)
    return folder


def _fake_trainer(world_size: int = 2) -> Any:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    args = SimpleNamespace(
        process_index=0, world_size=world_size, parallel_mode=ParallelMode.DISTRIBUTED
    )
    engine = SimpleNamespace(load=lambda folder: None)  # the sharded state: not under test here
    return SimpleNamespace(
        args=args,
        pipeline=SimpleNamespace(engine=engine),
        lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 2),
    )


def _resume(folder: Path) -> None:
    """What a `ZeroPPTrainer` resume reads of `folder`, in its order."""
    from lightning_zeropp.transformers import checkpointing

    trainer = _fake_trainer()
    checkpointing.load(trainer, folder)  # meta.pt, the checksums, scheduler.pt
    checkpointing.load_rng_state(trainer, folder)  # rng_state_0.pth


TRAINER_FILES = ["zeropp/meta.pt", "scheduler.pt", "rng_state_0.pth"]


def test_a_good_trainer_folder_resumes(tmp_path: Path) -> None:
    folder = _trainer_folder(tmp_path)
    state = torch.random.get_rng_state()
    torch.manual_seed(123)
    _resume(folder)
    assert torch.equal(torch.random.get_rng_state(), state)  # the saved random state is back


@pytest.mark.parametrize("sums", SUMS)
@pytest.mark.parametrize("name", TRAINER_FILES)
def test_code_planted_in_a_trainer_file_never_runs(tmp_path: Path, name: str, sums: str) -> None:
    folder = _trainer_folder(tmp_path)
    marker = tmp_path / MARKER
    _plant(folder / name, marker, sums)
    if name.startswith("zeropp/") and sums != "stale":
        checksum.write_sums(folder / "zeropp")
        checksum.write_folder_sums(folder)
    with pytest.raises(ValueError, match=rf"{Path(name).name}") as raised:
        _resume(_variant(folder, sums))
    assert not marker.exists(), f"resuming ran code planted in {name}"
    assert "add_safe_globals" not in str(raised.value)  # never: it would let the file call it


def test_a_tampered_trainer_state_is_named(tmp_path: Path) -> None:
    folder = _trainer_folder(tmp_path)
    (folder / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"trainer_state.json does not match its checksum"):
        _resume(folder)


def test_an_rng_file_without_an_rng_state_is_named_with_the_fix(tmp_path: Path) -> None:
    folder = _trainer_folder(tmp_path)
    torch.save({"python": 1}, folder / "rng_state_0.pth")
    checksum.write_folder_sums(folder)
    with pytest.raises(ValueError, match=r"rng_state_0.pth holds no RNG state.*Delete it"):
        _resume(folder)


def test_a_scheduler_file_of_another_scheduler_is_named(tmp_path: Path) -> None:
    folder = _trainer_folder(tmp_path)
    torch.save({"unexpected": 1}, folder / "scheduler.pt")
    checksum.write_folder_sums(folder)
    trainer = _fake_trainer()
    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), [lambda s: 1.0]
    )
    from lightning_zeropp.transformers import checkpointing

    with pytest.raises(ValueError, match=r"scheduler.pt does not fit the scheduler LambdaLR"):
        checkpointing.load(trainer, folder)


# ------------------------------------------------------------------------------ Accelerate
def _accelerate_folder(root: Path) -> Path:
    """A `save_state` folder: the registered scheduler, a user's object, the RNG states."""
    folder = root / "state"
    folder.mkdir()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    for i, size in enumerate((2, 3)):  # as Accelerate's save_custom_state writes them
        state = torch.optim.lr_scheduler.StepLR(opt, size).state_dict()
        torch.save(state, folder / f"custom_checkpoint_{i}.pkl")
    states = {
        "step": 3,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(states, folder / "random_states_0.pkl")
    checksum.write_folder_sums(folder)
    return folder


ACCELERATE_FILES = ["custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl"]


def test_a_good_accelerate_folder_passes(tmp_path: Path) -> None:
    from lightning_zeropp.accelerate.checkpointing import check_state_files

    check_state_files(_accelerate_folder(tmp_path), 0)


@pytest.mark.parametrize("sums", SUMS)
@pytest.mark.parametrize("name", ACCELERATE_FILES)
def test_code_planted_in_an_accelerate_file_never_runs(
    tmp_path: Path, name: str, sums: str
) -> None:
    from lightning_zeropp.accelerate.checkpointing import check_state_files

    folder = _accelerate_folder(tmp_path)
    marker = tmp_path / MARKER
    _plant(folder / name, marker, sums)
    with pytest.raises(ValueError, match=rf"{name}") as raised:
        check_state_files(_variant(folder, sums), 0)
    assert not marker.exists(), f"load_state's check ran code planted in {name}"
    assert "add_safe_globals" not in str(raised.value)


def test_accelerates_own_load_of_a_registered_object_runs_no_code(tmp_path: Path) -> None:
    # Accelerate reads registered objects with weights_only=False; the front's load_state runs
    # it with weights_only forced (here, were the file swapped after the front's check).
    from accelerate import PartialState
    from accelerate.checkpointing import load_custom_state

    PartialState(cpu=True)  # Accelerate's logging needs its state
    folder = _accelerate_folder(tmp_path)
    marker = tmp_path / MARKER
    _plant(folder / "custom_checkpoint_0.pkl", marker, "rewritten")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with weights_only_loads(), pytest.raises(Exception, match=r"Weights only load failed"):
        load_custom_state(torch.optim.lr_scheduler.StepLR(opt, 2), str(folder), 0)
    assert not marker.exists()
    with pytest.raises(ValueError), weights_only_loads():  # and after it, nothing is forced
        raise ValueError
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_zeropp_accelerator_load_state_forces_weights_only(tmp_path: Path) -> None:
    from lightning_zeropp.accelerate import ZeroPPAccelerator

    folder = _accelerate_folder(tmp_path)
    marker = tmp_path / MARKER
    _plant(folder / "custom_checkpoint_0.pkl", marker, "rewritten")
    accelerator = ZeroPPAccelerator(cpu=True)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    accelerator.register_for_checkpointing(
        torch.optim.lr_scheduler.StepLR(opt, 2), torch.optim.lr_scheduler.StepLR(opt, 3)
    )
    with pytest.raises(Exception, match=r"Weights only load failed"):
        accelerator.load_state(str(folder))
    assert not marker.exists(), "Accelerate's load_state ran code from custom_checkpoint_0.pkl"


def test_an_unreadable_rng_state_is_an_error_naming_the_file(tmp_path: Path) -> None:
    from lightning_zeropp.accelerate.checkpointing import check_state_files

    folder = _accelerate_folder(tmp_path)
    torch.save({"random_state": "not a state"}, folder / "random_states_0.pkl")
    checksum.write_folder_sums(folder)
    with pytest.raises(ValueError, match=r"random_states_0.pkl does not restore.*Delete it"):
        check_state_files(folder, 0)
    (folder / "random_states_0.pkl").unlink()
    checksum.write_folder_sums(folder)
    with pytest.warns(UserWarning, match=r"random_states_0.pkl is missing"):
        check_state_files(folder, 0)


# ------------------------------------------------------------------------------ Lightning
@pytest.mark.parametrize("sums", ["plain", "symlink"])
def test_code_planted_in_a_lightning_file_never_runs(tmp_path: Path, sums: str) -> None:
    from lightning_zeropp.lightning.checkpointing import load_full_file

    folder = tmp_path / "ckpts"
    folder.mkdir()
    marker = tmp_path / MARKER
    torch.save({"state_dict": {}, "epoch": Planted(marker)}, folder / "last.ckpt")
    path = _variant(folder, sums) / "last.ckpt"
    with pytest.raises(ValueError, match=r"last.ckpt names io.open.*Do not load it"):
        load_full_file(path, torch.nn.Linear(1, 1), [])
    assert not marker.exists()


def test_a_callable_is_never_suggested_and_a_data_class_is(tmp_path: Path) -> None:
    import dataclasses

    torch.save({"f": Planted(tmp_path / MARKER)}, tmp_path / "a.pt")
    with pytest.raises(ValueError) as raised:
        read_data(tmp_path / "a.pt")
    assert "add_safe_globals" not in str(raised.value)
    shutil.rmtree(tmp_path / MARKER, ignore_errors=True)
    torch.save({"c": _Hyper()}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match=r"add_safe_globals\(\[_Hyper\]\)"):
        read_data(tmp_path / "b.pt")
    assert dataclasses.is_dataclass(_Hyper)


@__import__("dataclasses").dataclass
class _Hyper:
    width: int = 4
