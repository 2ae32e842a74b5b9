"""The meta path's pieces on one process: materializing, initializing, and loading safetensors.

(The distributed parity of the whole path is `distributed/test_meta_build.py`.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zeropp.core.weights.init_modules import check_set, default_init, init_weights
from lightning_zeropp.core.weights.load import load_weights, weight_source_kind
from lightning_zeropp.core.weights.materialize import empty_parameters, has_meta, materialize


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.register_buffer("steps", torch.arange(3.0))  # computed at construction


class Scaled(nn.Module):
    """A module with a parameter of its own and no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))


class ParentInit(nn.Module):
    """Initializes its child's weight from its own init (GPT-2's scaled projections do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gain)
        nn.init.zeros_(self.lin.weight)


def test_empty_parameters_puts_parameters_on_meta_and_keeps_buffers() -> None:
    with empty_parameters():
        net = Net()
    assert all(p.is_meta for p in net.parameters()) and has_meta(net)
    assert torch.equal(net.steps, torch.arange(3.0))
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the block


def test_materialize_equals_init_weights_of_the_whole_model_and_keeps_real_buffers() -> None:
    torch.manual_seed(0)
    with empty_parameters():
        net = Net()
    materialize([net], torch.device("cpu"), default_init(net), seed=7)
    check_set([net])
    whole = Net()
    init_weights(whole, seed=7)
    for (name, got), want in zip(
        net.state_dict().items(), whole.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
    assert torch.equal(net.steps, torch.arange(3.0))
    other = Net()
    init_weights(other, seed=8)  # another seed draws other values
    assert not torch.equal(other.emb.weight, whole.emb.weight)


def test_a_tensor_no_init_sets_is_named() -> None:
    with torch.device("meta"):
        net = Scaled()
    materialize([net], torch.device("cpu"), default_init(net), seed=0)
    with pytest.raises(ValueError, match="'scale' was built on the meta device and nothing set"):
        check_set([net])


def test_a_custom_init_sets_it() -> None:
    with torch.device("meta"):
        net = Scaled()

    def init(module: nn.Module) -> None:
        if isinstance(module, Scaled):
            nn.init.ones_(module.scale)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    materialize([net], torch.device("cpu"), init, seed=0)
    check_set([net])
    assert torch.equal(net.scale, torch.ones(3))


def test_an_init_that_writes_a_submodule_is_refused() -> None:
    with torch.device("meta"):
        net = ParentInit()
    with pytest.raises(ValueError, match="the init wrote into 'lin.weight'"):
        materialize([net], torch.device("cpu"), default_init(net), seed=0)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def test_load_safetensors_casts_and_takes_tied_and_base_model_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = Net()
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items() if k != "steps"}
    state["emb.weight"] = src.emb.weight.detach()
    del state["body.0.weight"]  # stored once, under its tied name
    state["tied.weight"] = src.body[0].weight.detach()
    # saved from the base model: without its prefix (HF's `base_model_prefix`)
    state = {
        (k.removeprefix("body.") if k.startswith("body.1") else k): v for k, v in state.items()
    }
    _save(state, tmp_path / "model.safetensors")
    assert weight_source_kind(tmp_path) == "safetensors"
    with empty_parameters():
        net = Net()
    net.to_empty(device="cpu")
    load_weights(net, tmp_path, tied=[("body.0.weight", "tied.weight")], base_prefix="body")
    assert torch.equal(net.emb.weight, src.emb.weight)
    assert torch.equal(net.body[0].weight, src.body[0].weight)
    torch.testing.assert_close(net.body[0].bias, src.body[0].bias, atol=1e-2, rtol=1e-2)
    assert torch.equal(net.body[1].weight, src.body[1].weight)  # LayerNorm ones: exact in bf16


def test_load_safetensors_names_missing_and_mis_sized_tensors(tmp_path: Path) -> None:
    _save({"emb.weight": torch.zeros(10, 4)}, tmp_path / "a.safetensors")
    net = Net()
    with pytest.raises(
        ValueError, match=r"lack 4 of this model's tensors \(e.g. \['body.0.weight'"
    ):
        load_weights(net, tmp_path)
    full = {k: v for k, v in Net().state_dict().items() if k != "steps"}
    full["emb.weight"] = torch.zeros(12, 4)
    _save(full, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match=r"another model size: \['emb.weight: \(12, 4\) vs"):
        load_weights(net, tmp_path)


def test_a_source_of_no_known_kind_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a distributed checkpoint"):
        weight_source_kind(tmp_path)


def test_an_init_may_reset_a_kept_buffer_of_its_own_module() -> None:
    with empty_parameters():
        norm = nn.BatchNorm1d(3)  # weight and bias on meta, running stats real
    norm.running_mean.fill_(5.0)
    materialize([norm], torch.device("cpu"), default_init(norm), seed=0)
    check_set([norm])
    assert torch.equal(norm.running_mean, torch.zeros(3))  # its reset_parameters zeroed it


def test_load_safetensors_reads_a_weight_held_under_two_names_from_either(tmp_path: Path) -> None:
    """One stage holding a tied embedding and head (pp 1): the file stores it once."""
    net = Net()
    net.head = nn.Linear(4, 10, bias=False)
    net.head.weight = net.emb.weight
    state = {k: v for k, v in Net().state_dict().items() if k != "steps"}
    _save(state, tmp_path / "model.safetensors")
    load_weights(net, tmp_path)
    assert torch.equal(net.head.weight, state["emb.weight"])


def test_load_dcp_reads_this_librarys_checkpoints_and_plain_ones(group, tmp_path: Path) -> None:
    """Ours nest the model under "model."; a plain DCP directory keyed by names whose own first
    part is "model." (as an HF model's are) must not be read as nested."""
    import torch.distributed.checkpoint as dcp

    from lightning_zeropp.core.weights.checkpoint import save_checkpoint

    class HFLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(3, 3)

    src = HFLike()
    save_checkpoint(tmp_path / "ours", src, [])
    dcp.save({k: v.clone() for k, v in src.state_dict().items()}, checkpoint_id=tmp_path / "plain")
    for kind in ("ours", "plain"):
        net = HFLike()
        load_weights(net, tmp_path / kind)
        assert torch.equal(net.model.weight, src.model.weight), kind
