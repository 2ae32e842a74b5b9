"""Checkpoints as data (`core.weights.trust`, `core.weights.checksum`): a checkpoint that would run
code, a changed byte in a shard, or a deeper model's checkpoint is refused, naming the file.

One process, a one-rank gloo group; each crafted checkpoint starts as a real one and is changed
the way an attacker or a bad disk would change it.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zeropp.core.weights.checkpoint import load_checkpoint, save_checkpoint
from lightning_zeropp.core.weights.load import load_weights
from lightning_zeropp.core.weights.trust import load_meta, trusted_types

RAN = "LZPP_TEST_CODE_RAN"


def mark_code_ran() -> None:
    os.environ[RAN] = "yes"


class RunsCode:
    """Unpickling it calls `mark_code_ran`: the test sees whether a load ran code."""

    def __reduce__(self) -> tuple:
        return (mark_code_ran, ())


def _model(layers: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))


def _saved(tmp_path: Path, layers: int = 2, meta: dict | None = None) -> Path:
    model = _model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return save_checkpoint(tmp_path / "ckpt", model, [opt], meta or {"epoch": 3})


def _load(path: Path, layers: int = 2) -> dict:
    model = _model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return load_checkpoint(path, model, [opt])


@pytest.fixture(autouse=True)
def _no_code_ran(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(RAN, raising=False)
    yield
    assert RAN not in os.environ, "loading the checkpoint ran code"


def test_a_meta_pt_that_would_run_code_is_refused(tmp_path: Path, group: None) -> None:
    path = _saved(tmp_path)
    torch.save({"epoch": RunsCode()}, path / "meta.pt")
    (path / "SHA256SUMS").unlink()  # an attacker rewrites the sums too; the code is still refused
    with pytest.raises(ValueError, match=r"meta.pt names .*mark_code_ran.*Do not load it"):
        _load(path)


def test_metadata_that_would_run_code_is_refused(tmp_path: Path, group: None) -> None:
    path = _saved(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    (path / "SHA256SUMS").unlink()
    with pytest.raises(ValueError, match=r"\.metadata names .*mark_code_ran.*do not load it"):
        _load(path)
    with pytest.raises(ValueError, match=r"\.metadata names .*mark_code_ran"):
        load_weights(_model(), path)  # load_from= a distributed checkpoint, too


def test_a_changed_float_in_a_shard_is_named(tmp_path: Path, group: None) -> None:
    path = _saved(tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one value
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"__0_0.distcp does not match its checksum in .*SHA256SUMS"
    ):
        _load(path)


def test_a_deeper_models_checkpoint_is_refused_in_one_line(tmp_path: Path, group: None) -> None:
    path = _saved(tmp_path, layers=3)
    with pytest.raises(ValueError, match=r"holds 2 tensors this model lacks \(2.bias, 2.weight\)"):
        _load(path, layers=2)
    with pytest.raises(ValueError, match=r"holds 2 tensors this model lacks"):
        load_weights(_model(2), path)


def test_a_good_checkpoint_loads_with_its_metadata(tmp_path: Path, group: None) -> None:
    assert _load(_saved(tmp_path)) == {"epoch": 3}
    assert (tmp_path / "ckpt" / "SHA256SUMS").read_text().count("\n") == 3  # shard, .metadata, meta


@dataclass
class Config:
    width: int = 4


def test_hyperparameter_classes_load_only_when_trusted(tmp_path: Path) -> None:
    torch.save({"hyper_parameters": {"config": Config()}}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match=r"names .*Config.*add_safe_globals"):
        load_meta(tmp_path / "meta.pt")
    trusted = trusted_types({"config": Config(), "lr": 0.1})
    assert trusted == {Config}
    assert load_meta(tmp_path / "meta.pt", trusted)["hyper_parameters"]["config"] == Config()


def test_a_checkpoint_item_that_would_run_code_is_refused(tmp_path: Path, group: None) -> None:
    # DCP stores non-tensor items (optimizer hyperparameters) as pickles and reads them with
    # weights_only=False; the library's planner reads them with weights_only=True first.
    import torch.distributed.checkpoint as dcp

    from lightning_zeropp.core.weights.trust import SafeLoadPlanner

    dcp.save({"w": torch.ones(2), "lr": RunsCode()}, checkpoint_id=str(tmp_path / "d"))
    # DCP wraps each rank's error (the library's loads name its cause in one line).
    with pytest.raises(CheckpointException, match=r"ValueError: the checkpoint item lr would run"):
        dcp.load({"w": torch.zeros(2), "lr": 0.1}, checkpoint_id=str(tmp_path / "d"),
                 planner=SafeLoadPlanner())  # fmt: skip


def test_a_damaged_sums_file_is_named(tmp_path: Path, group: None) -> None:
    path = _saved(tmp_path)
    (path / "SHA256SUMS").write_text("not a checksum line\n")
    with pytest.raises(ValueError, match=r"SHA256SUMS is damaged .*cannot be trusted"):
        _load(path)


class _Lit(nn.Module):
    """A LightningModule's layout: the network as an attribute (`self.net`)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()


def test_a_lightning_checkpoint_loads_into_the_bare_network(tmp_path: Path, group: None) -> None:
    # Saved under the module's prefix (model.net.0.weight): the bare network's weights, not
    # "saved from another model".
    lit = _Lit()
    path = save_checkpoint(tmp_path / "lit", lit, [], {})
    bare = nn.Sequential(*(nn.Linear(4, 4) for _ in range(2)))
    load_weights(bare, path)
    torch.testing.assert_close(bare[1].weight, lit.net[1].weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"holds 2 tensors this model lacks"):
        load_weights(nn.Sequential(nn.Linear(4, 4)), path)  # a shallower network is still named
