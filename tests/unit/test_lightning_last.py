"""`ckpt_path="last"` after a save killed while publishing `last.ckpt` (a filesystem without an
atomic directory exchange): the name is put back and the run stops saying so, instead of Lightning
finding no `last*.ckpt` and training from step 0 with two complete checkpoints beside it."""

from __future__ import annotations

import glob
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zeropp.core.weights import commit
from lightning_zeropp.lightning.checkpointing import recover_last


class Crash(RuntimeError):
    pass


def _raise(*args: object, **kwargs: object) -> None:
    raise Crash("killed here")


def test_a_last_checkpoint_left_aside_by_a_kill_is_put_back_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(commit._EXCHANGE, "supported", False)
    last = tmp_path / "last.ckpt"
    last.mkdir()  # a real directory (published where the exchange worked)
    (last / "data").write_text("step 2")
    tmp = commit.temporary(last)
    tmp.mkdir()
    (tmp / "data").write_text("step 4")
    with monkeypatch.context() as m:
        m.setattr(Path, "symlink_to", _raise)  # killed after moving the directory aside
        with pytest.raises(Crash):
            commit.publish(tmp, last)
    assert glob.glob(str(tmp_path / "last*.ckpt")) == []  # what Lightning's "last" lists
    trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    with pytest.raises(ValueError, match=r"last.ckpt was missing.*step 0.*ckpt_path='last'"):
        recover_last(trainer)
    assert (last / "data").read_text() == "step 4"  # the newest complete one
    recover_last(trainer)  # the next run: nothing to say
