"""The supported torch range: a release outside it is refused when `lightning_zeropp` is imported,
with the range and the fix named; releases inside it import; pyproject.toml declares the same range.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from torch.distributed.pipelining import PipelineStage

from lightning_zeropp.core._torch_private import pipelining, version

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "release"),
    [("2.14.1+cu130", (2, 14)), ("2.11.0", (2, 11)), ("2.15.0.dev20260101+cpu", (2, 15))],
)
def test_release_is_read_from_the_version_string(text, release):
    assert version.installed_release(text) == release


@pytest.mark.parametrize("release", [(2, 11), (2, 12), (2, 13), (2, 14)])
def test_releases_in_the_range_are_accepted(monkeypatch, release):
    monkeypatch.setattr(version, "installed_release", lambda *_: release)
    version.require_supported_torch()


@pytest.mark.parametrize("release", [(2, 10), (2, 15), (1, 13), (3, 0)])
def test_releases_outside_the_range_are_refused(monkeypatch, release):
    monkeypatch.setattr(version, "installed_release", lambda *_: release)
    with pytest.raises(ImportError, match=r"supports torch >=2\.11,<2\.15 .*pip install"):
        version.require_supported_torch()


@pytest.mark.parametrize("torch_version", ["2.10.0", "2.15.0"])
def test_import_refuses_an_unsupported_torch(torch_version):
    """The whole import path, in a fresh interpreter whose torch claims another release."""
    code = (
        f"import torch; torch.__version__ = {torch_version!r}\n"
        "try:\n"
        "    import lightning_zeropp\n"
        "except ImportError as error:\n"
        "    print('REFUSED', error)\n"
        "else:\n"
        "    print('IMPORTED')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr
    assert f"torch {torch_version} is installed" in out.stdout
    assert ">=2.11,<2.15" in out.stdout


def test_pyproject_declares_the_supported_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch{version.SUPPORTED_RANGE}" in project["dependencies"]


# Each difference between releases, decided in `_torch_private/` (run on every torch: the switch
# is set to the older release's side; the parity subset checks the real thing on 2.11 and 2.14).


def test_two_argument_loss_call_before_2_13(monkeypatch):
    """torch 2.11 and 2.12's runtimes call `_compute_loss(output, target)`, without loss_kwargs."""
    monkeypatch.setattr(pipelining, "LOSS_KWARGS", False)

    class Schedule:
        def _compute_loss(self, output, target):  # torch 2.11's signature
            return output - target

    schedule = Schedule()
    seen = []

    def wrapper(compute, output, target, loss_kwargs):
        seen.append(loss_kwargs)
        return compute(output, target, loss_kwargs)

    pipelining.on_scheduled_loss(schedule, wrapper)
    assert schedule._compute_loss(5, 2) == 3
    assert seen == [None]


def test_warmup_drops_sends_to_its_own_rank_on_2_11(monkeypatch):
    """V placements put neighbour stages on one rank: torch warmed the links up by sending
    to itself (2.11), which gloo refuses."""

    class Op:
        def __init__(self, peer: int) -> None:
            self.group_peer = peer

    monkeypatch.setattr(
        PipelineStage, "_get_init_p2p_neighbors_ops", lambda self: [Op(1), Op(0), Op(1)]
    )
    stage = object.__new__(pipelining.ShapeInferenceStage)
    stage.group_rank = 1
    monkeypatch.setattr(pipelining, "WARMUP_SENDS_TO_ITSELF", True)
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [0]
    monkeypatch.setattr(pipelining, "WARMUP_SENDS_TO_ITSELF", False)
    assert len(stage._get_init_p2p_neighbors_ops()) == 3
