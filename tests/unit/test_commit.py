"""Atomic commit (`core.weights.commit`): a crash at any step of a save leaves a complete checkpoint
under the name, or one the next load recovers; temporaries are cleaned; nothing else is touched.

Crashes are simulated by making one filesystem step of `publish` raise, which leaves the
directory exactly as a kill at that point would."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zeropp.core.weights import commit
from lightning_zeropp.core.weights.checkpoint import load_checkpoint, save_checkpoint


def _write(path: Path, text: str) -> Path:
    """A 'checkpoint': a directory with one file saying which one it is."""
    tmp = commit.temporary(path)
    tmp.mkdir()
    (tmp / "data").write_text(text)
    return tmp


def _save(path: Path, text: str) -> None:
    commit.publish(_write(path, text), path)


def _read(path: Path) -> str:
    return (path / "data").read_text()


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


class Crash(RuntimeError):
    pass


@pytest.fixture
def links(monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that cannot exchange two directories: publish falls back to links."""
    monkeypatch.setitem(commit._EXCHANGE, "supported", False)


def test_publish_replaces_a_plain_directory_in_one_step(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _save(path, "one")
    _save(path, "two")
    assert path.is_dir() and not path.is_symlink() and _read(path) == "two"
    assert _entries(tmp_path) == ["last.ckpt"]  # no version, no old, no temporary beside it
    # Lightning's `ckpt_path="last"` globs `*last*.ckpt`: the checkpoint only.
    assert glob.glob(str(tmp_path / "*last*.ckpt")) == [str(path)]


def test_a_copy_of_a_checkpoint_is_complete(tmp_path: Path) -> None:
    # `cp -r` copies what it finds: a plain directory (a link would be copied dangling).
    path = tmp_path / "ckpt"
    _save(path, "one")
    _save(path, "two")
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(path), str(copy)], check=True)
    assert not copy.is_symlink() and _read(copy) == "two"


def test_killed_after_the_exchange_keeps_the_new_and_the_next_save_cleans(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    _save(path, "one")
    with monkeypatch.context() as m:  # killed before the replaced checkpoint was deleted
        m.setattr(commit, "_discard", _raise)
        with pytest.raises(Crash):
            _save(path, "two")
    assert _read(path) == "two" and len(_entries(tmp_path)) == 2  # "one" at a temporary name
    _save(path, "three")
    assert _read(path) == "three" and _entries(tmp_path) == ["ckpt"]


def test_crash_while_writing_keeps_the_previous_and_the_next_save_cleans(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, "one")
    _write(path, "half")  # killed before publish: a temporary stays behind
    assert _read(path) == "one"
    _save(path, "two")
    assert _read(path) == "two" and _entries(tmp_path) == ["ckpt"]


def test_a_runs_first_save_cleans_every_crashed_temporary(tmp_path: Path) -> None:
    _save(tmp_path / "a", "done")
    _write(tmp_path / "step=10.ckpt", "half")  # a name this run will never save again
    (tmp_path / ".b.link-0123abcd").symlink_to("nowhere")
    (tmp_path / ".c.tmp-notours").mkdir()  # not a token of ours: left alone
    assert len(commit.clean_temporaries(tmp_path)) == 2
    assert _entries(tmp_path) == [".c.tmp-notours", "a"]


def test_links_replace_through_a_link_and_clean_up(tmp_path: Path, links: None) -> None:
    path = tmp_path / "last.ckpt"
    _save(path, "one")
    _save(path, "two")
    assert path.is_symlink() and _read(path) == "two"
    assert len(_entries(tmp_path)) == 2  # the link and its one version, no old, no temporary
    assert glob.glob(str(tmp_path / "*last*.ckpt")) == [str(path)]


def test_links_crash_before_the_link_moves_recovers_the_new_one(tmp_path, monkeypatch, links):
    path = tmp_path / "ckpt"
    _save(path, "one")
    with monkeypatch.context() as m:
        m.setattr(commit.os, "replace", _raise)  # the new version is complete, not linked
        with pytest.raises(Crash):
            _save(path, "two")
    assert _read(path) == "one"  # the name still holds a complete checkpoint
    assert commit.recover(path)  # the newest complete one goes under the name (every load)
    assert _read(path) == "two" and len(_entries(tmp_path)) == 2
    assert not commit.recover(path)  # nothing more to do
    _save(path, "three")
    assert _read(path) == "three" and len(_entries(tmp_path)) == 2


def test_first_save_crashed_before_linking_is_recovered(tmp_path, monkeypatch, links) -> None:
    path = tmp_path / "ckpt"
    with monkeypatch.context() as m:
        m.setattr(commit.os, "replace", _raise)
        with pytest.raises(Crash):
            _save(path, "one")
    assert not path.exists()
    assert commit.recover(path)
    assert _read(path) == "one" and not path.is_symlink() and _entries(tmp_path) == ["ckpt"]


def test_a_real_directory_killed_while_replaced_is_recovered_not_deleted(
    tmp_path, monkeypatch, links
) -> None:
    # Killed after moving the real directory aside: the name is missing, two complete
    # checkpoints sit beside it. The next save of the name must delete neither of them.
    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / "data").write_text("legacy")
    with monkeypatch.context() as m:
        m.setattr(Path, "symlink_to", _raise)
        with pytest.raises(Crash):
            _save(path, "new")
    assert not path.exists() and len(_entries(tmp_path)) == 2
    with pytest.warns(UserWarning, match="complete checkpoints a crashed save left"):
        _save(path, "newer")  # as a run that started from scratch would
    kept = [p for p in tmp_path.iterdir() if p.name != "last.ckpt" and p != path.resolve()]
    assert sorted(_read(p) for p in kept) == ["legacy", "new"] and _read(path) == "newer"


def test_a_real_directory_killed_while_replaced_loads_the_newest(tmp_path, monkeypatch, links):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "data").write_text("legacy")
    with monkeypatch.context() as m:  # killed after moving the directory aside
        m.setattr(Path, "symlink_to", _raise)
        with pytest.raises(Crash):
            _save(path, "new")
    assert commit.recover(path)
    assert _read(path) == "new"  # the newest complete version, not the legacy one


def test_non_link_publish_keeps_a_plain_directory(tmp_path: Path, links: None) -> None:
    path = tmp_path / "export"
    commit.publish(_write(path, "one"), path, link=False)
    commit.publish(_write(path, "two"), path, link=False)
    assert not path.is_symlink() and _read(path) == "two"
    assert _entries(tmp_path) == ["export"]


def test_files_are_replaced_in_one_step(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    for text in ("one", "two"):
        tmp = commit.temporary(path)
        tmp.write_text(text)
        commit.publish(tmp, path)
    assert path.read_text() == "two" and _entries(tmp_path) == ["last.ckpt"]


@pytest.mark.parametrize("exchange", [True, False])
def test_remove_deletes_the_checkpoint_only(tmp_path: Path, monkeypatch, exchange: bool) -> None:
    monkeypatch.setitem(commit._EXCHANGE, "supported", exchange)
    path = tmp_path / "epoch=0.ckpt"
    _save(path, "one")
    _save(path, "two")
    mine = [tmp_path / ".epoch=0.ckpt.mine", tmp_path / "epoch=0.ckpt.bak", tmp_path / "other"]
    for p in mine:
        p.write_text("not the library's")
    other = tmp_path / "epoch=0.ckpt.v2"
    _save(other, "a neighbour whose name extends this one's")
    commit.remove(path)
    assert not path.exists() and not path.is_symlink()
    assert all(p.read_text() == "not the library's" for p in mine)
    assert _read(other) == "a neighbour whose name extends this one's"
    assert len(_entries(tmp_path)) == 4 + (not exchange)  # the files, the neighbour (+ version)


def _raise(*args: object, **kwargs: object) -> None:
    raise Crash("killed here")


# ------------------------------------------------------------------ checkpoints of another model
def test_checkpoint_errors_name_their_cause_in_one_line(tmp_path: Path, group: None) -> None:
    path = tmp_path / "ckpt"
    save_checkpoint(path, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), [])
    other_size = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 2))
    with pytest.raises(ValueError, match=r"has `0.weight` \[8, 4\], the model \[16, 4\] \(and 2"):
        load_checkpoint(path, other_size, [])
    other_model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"lacks 2.weight, 2.bias: it was saved from another"):
        load_checkpoint(path, other_model, [])
    shard = next(p for p in path.resolve().iterdir() if p.suffix == ".distcp")
    os.remove(shard)
    with pytest.raises(ValueError, match=r"__0_0.distcp is missing \(listed in SHA256SUMS\)"):
        load_checkpoint(path, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), [])


def test_a_whole_state_of_another_width_is_named_in_one_line(group: None) -> None:
    from lightning_zeropp.core.weights.checkpoint import load_full

    saved = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict()
    wider = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 2))
    with pytest.raises(
        ValueError,
        match=r"^the checkpoint has `0.weight` \[8, 4\], the model \[16, 4\] \(and 2 more\): it "
        r"was saved from another model$",
    ):
        load_full(wider, [], saved, [])


def test_a_checkpoint_left_aside_by_a_kill_loads(tmp_path: Path, group: None, monkeypatch, links):
    model = nn.Linear(3, 3)
    path = tmp_path / "ckpt"
    with monkeypatch.context() as m:
        m.setattr(commit.os, "replace", _raise)
        with pytest.raises(Crash):
            save_checkpoint(path, model, [])
    fresh = nn.Linear(3, 3)
    load_checkpoint(path, fresh, [])  # recovered first
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)


# ------------------------------------------------------------------ asynchronous saves
def test_async_save_writes_the_state_at_the_call_and_commits_it(tmp_path: Path, group: None):
    """The step goes on at once (here: the weights and the optimizer state change right after
    the call); the checkpoint holds the state at the call, under its name only once complete."""
    from lightning_zeropp.core.weights.async_checkpoint import AsyncCheckpointer

    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_avg = opt.state[model.weight]["exp_avg"].clone()
    path, saver = tmp_path / "last.ckpt", AsyncCheckpointer()
    saver.save(path, model, [opt], {"step": 1})
    with torch.no_grad():  # what the next steps do while the thread writes
        model.weight.add_(1.0)
    opt.state[model.weight]["exp_avg"].add_(1.0)
    assert saver.wait() == path and path.is_dir() and not path.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    fresh = nn.Linear(256, 256)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh(torch.randn(1, 256)).sum().backward()
    fresh_opt.step()  # optimizer state to load into
    assert load_checkpoint(path, fresh, [fresh_opt]) == {"step": 1}
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(fresh_opt.state[fresh.weight]["exp_avg"], saved_avg, rtol=0, atol=0)
    # A second save of the name replaces the first, and cleans its version.
    saver.save(path, model, [opt], {"step": 2})
    assert saver.wait() == path and load_checkpoint(path, fresh, [fresh_opt]) == {"step": 2}
    assert len(list(tmp_path.iterdir())) == 1


def test_a_failed_async_save_raises_at_the_next_wait(tmp_path: Path, group: None, monkeypatch):
    from lightning_zeropp.core.weights.async_checkpoint import AsyncCheckpointer

    saver, model = AsyncCheckpointer(), nn.Linear(3, 3)
    monkeypatch.setattr(commit, "publish", _raise)
    saver.save(tmp_path / "ckpt", model, [])
    with pytest.raises(RuntimeError, match=r"the asynchronous checkpoint save failed: killed here"):
        saver.wait()
    assert not (tmp_path / "ckpt").exists() and saver.wait() is None


def test_a_missing_checkpoint_is_named_missing(tmp_path: Path, group: None) -> None:
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nowhere\.ckpt does not exist"):
        load_checkpoint(tmp_path / "nowhere.ckpt", nn.Linear(3, 3), [])


def test_a_checkpoint_replaced_by_a_pending_save_goes_only_once_that_is_complete(
    tmp_path: Path, group: None, monkeypatch
):
    # ModelCheckpoint(save_top_k=1) deletes the previous checkpoint right after starting the
    # next save: until that is written, the previous one is the last complete one.
    import threading

    from lightning_zeropp.core.weights import checkpoint
    from lightning_zeropp.core.weights.async_checkpoint import AsyncCheckpointer

    saver, model = AsyncCheckpointer(), nn.Linear(3, 3)
    saver.save(tmp_path / "step=2.ckpt", model, [])
    saver.wait()
    release = threading.Event()
    finish = checkpoint.finish_save
    monkeypatch.setattr(
        "lightning_zeropp.core.weights.async_checkpoint.finish_save",
        lambda tmp, path: (release.wait(30), finish(tmp, path)),
    )
    saver.save(tmp_path / "step=4.ckpt", model, [])
    saver.remove(tmp_path / "step=2.ckpt")
    assert (tmp_path / "step=2.ckpt" / "meta.pt").is_file()  # the new one is not written yet
    release.set()
    saver.wait()
    assert _entries(tmp_path) == ["step=4.ckpt"]


# ------------------------------------------------------------------ every crash point
_STEPS = ("rename", "symlink_to", "replace", "rmtree")  # every filesystem step publish takes


def _crash_at(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """Make the `k`-th filesystem step of a publish raise (as a kill there would leave it)."""
    done: list[str] = []

    def step(name: str, real):
        def run(*args, **kwargs):
            if len(done) == k:
                raise Crash(f"killed at step {k} ({name})")
            done.append(name)
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(Path, "rename", step("rename", Path.rename))
    monkeypatch.setattr(Path, "symlink_to", step("symlink_to", Path.symlink_to))
    monkeypatch.setattr(commit.os, "replace", step("replace", os.replace))
    monkeypatch.setattr(commit.shutil, "rmtree", step("rmtree", commit.shutil.rmtree))
    return done


@pytest.mark.parametrize("before", ["link", "real", "none"])
@pytest.mark.parametrize("link", [True, False])
def test_the_newest_complete_checkpoint_is_recovered_whatever_the_crash_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: None, before: str, link: bool
) -> None:
    # `ckpt_path="last"` after a kill at any step of a publish without a directory exchange: the
    # name must hold the newest complete checkpoint after `recover` (every load calls it).
    for k in range(12):
        folder = tmp_path / f"{k}"
        folder.mkdir()
        path = folder / "last.ckpt"
        if before == "link":
            _save(path, "old")
        elif before == "real":
            path.mkdir()
            (path / "data").write_text("old")
        with monkeypatch.context() as m:
            done = _crash_at(m, k)
            try:
                commit.publish(_write(path, "new"), path, link=link)
                finished = True
            except Crash:
                finished = False
        commit.recover(path)
        # Until the new one is complete (its temporary renamed: the first step), the old one.
        newest = "new" if done or finished else ("old" if before != "none" else None)
        assert (_read(path) if path.exists() else None) == newest, (k, done)
        if finished:
            break
    assert finished, "publish took more steps than the test tries"
