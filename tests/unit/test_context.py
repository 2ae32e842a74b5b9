"""Context parallelism without a process group: the cp_size setting, each rank's chunks, the
labels shifted on the whole sequence, and the batches refused."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from lightning_zeropp.core.settings.config import ZeroPPConfig
from lightning_zeropp.core.settings.env import config_from_env
from lightning_zeropp.core.settings.plus import hpz_size
from lightning_zeropp.core.step.context import ContextSplit
from lightning_zeropp.fronts.settings import merge_settings


class _Ids(nn.Module):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


class _TakesPositions(nn.Module):
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        return None


def test_cp_size_is_a_mesh_axis_of_the_world():
    layout = ZeroPPConfig(cp_size=2).resolve(8)
    assert (layout.pp_size, layout.dp_shard_size, layout.cp_size) == (2, 2, 2)
    layout = ZeroPPConfig(pp_size=1, cp_size=4).resolve(4)
    assert (layout.dp_shard_size, layout.dp_size) == (1, 1)
    assert config_from_env({"ZEROPP_CP_SIZE": "4"}).cp_size == 4


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"cp_size": 3}, 4, "cp_size=3 does not divide the world of 4 processes"),
        ({"cp_size": 0}, 4, "cp_size=0 must be a positive integer"),
        ({"cp_size": 2, "pp_size": 2, "dp_shard_size": 2}, 4, "x cp_size (2) = 8, but the world"),
        (
            {"cp_size": 2, "dp_shard_size": 2, "hpz_partition_size": 3, "node_size": 2},
            4,
            "hpz_partition_size=3 must divide dp_shard_size x cp_size = 2 x 2 and node_size=2",
        ),
        ({"cp_size": 2, "compile": True}, 4, "compile=True cannot be combined with cp_size=2"),
    ],
)
def test_bad_cp_settings_name_the_value_and_fix(settings, world, message):
    with pytest.raises(ValueError, match=None) as err:
        ZeroPPConfig(**settings).resolve(world)
    assert message in str(err.value)


def test_zeropp_plus_acts_on_the_shard_group_of_dp_shard_times_cp():
    # FSDP shards over dp_shard x cp: hpZ's partitions of 2 lie inside that group of 4 (over
    # dp_shard alone, 2 ranks, hpZ would have been switched off as having nothing to do)
    layout = ZeroPPConfig(
        pp_size=1, dp_shard_size=2, cp_size=2, hpz_partition_size=2, node_size=2
    ).resolve(4)
    assert layout.hpz_partition_size == 2
    assert hpz_size(layout) == 2
    layout = ZeroPPConfig(cp_size=2, quantized_gradients="int8", node_size=2).resolve(8)
    assert layout.quantized_gradients == "int8"


def test_the_fronts_settings_take_cp():
    assert merge_settings({"cp_size": 2}, environ={}).resolve(4).cp_size == 2


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    split = ContextSplit(2, 0, _Ids())
    assert split.local_positions(0, 8).tolist() == [0, 1, 6, 7]
    assert split.local_positions(1, 8).tolist() == [2, 3, 4, 5]
    split.set_length(8)
    gathered = torch.cat([split.local_positions(r, 8) for r in range(2)])
    assert gathered[split.order].tolist() == list(range(8))  # the gather's global order


def test_labels_are_shifted_on_the_whole_sequence_before_the_split():
    labels = torch.arange(8).unsqueeze(0) + 10
    for rank, want in ((0, [11, 12, 17, -100]), (1, [13, 14, 15, 16])):
        split = ContextSplit(2, rank, _Ids())
        _, kwargs, _ = split.split((), {"input_ids": labels - 10, "labels": labels}, None)
        # rank 0's position 1 predicts token 2, which rank 1 holds: the straddling pair stays
        assert kwargs["labels"].tolist() == [want]
        assert kwargs["shift_labels"].tolist() == [want]


def test_shift_labels_alone_are_split_and_ask_for_no_loss():
    """`shift_labels` without `labels` (a last-stage loss's call under CP: the blocks get the
    keywords the split was checked with) computes no loss in one process: no `labels` added."""
    shifted = torch.arange(8).unsqueeze(0) + 10
    split = ContextSplit(2, 1, _Ids())
    _, kwargs, _ = split.split((), {"input_ids": shifted - 10, "shift_labels": shifted}, None)
    assert "labels" not in kwargs
    assert kwargs["shift_labels"].tolist() == [[12, 13, 14, 15]]


def test_the_loss_keywords_reach_the_model_in_one_order():
    """The blocks get the model's extra keywords in the order given (HF hands them down), and
    split='call' checks that order: with labels or shift_labels alone, num_items_in_batch
    comes after shift_labels (as TRL's SFT forward re-adds them in the split's check)."""
    ids = torch.zeros(1, 8, dtype=torch.long)
    for labelled in ("labels", "shift_labels"):
        split = ContextSplit(2, 0, _Ids())
        batch = {"input_ids": ids, "num_items_in_batch": 3.0, labelled: ids}
        _, kwargs, _ = split.split((), batch, None)
        assert list(kwargs)[-2:] == ["shift_labels", "num_items_in_batch"]


def test_positions_are_given_global_to_a_forward_that_takes_them():
    split = ContextSplit(2, 1, _TakesPositions())
    args, kwargs, target = split.split((torch.zeros(3, 8, dtype=torch.long),), {}, None)
    assert args[0].shape == (3, 4)
    assert kwargs["position_ids"].tolist() == [[2, 3, 4, 5]] * 3


def test_a_right_padded_mask_is_taken_out_and_others_refused():
    split = ContextSplit(2, 0, _Ids())
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    _, kwargs, _ = split.split(
        (torch.zeros(2, 8, dtype=torch.long),), {"attention_mask": mask}, None
    )
    assert kwargs["attention_mask"].tolist() == [[1] * 4] * 2  # ones: the pads are right
    # left padding needs a mask over all keys, which a forward without attention_mask cannot take
    with pytest.raises(ValueError, match="takes no attention_mask; pad on the right"):
        split.split((torch.zeros(1, 8),), {"attention_mask": torch.tensor([[0] + [1] * 7])}, None)


class _HFLike(nn.Module):
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> None:
        return None


def _allowed(rows: list[list[int]]) -> list[list[list[list[bool]]]]:
    """(1, 1, queries, 8) from each query's allowed keys."""
    return [[[[k in keys for k in range(8)] for keys in rows]]]


def test_left_padding_and_packed_rows_keep_their_meaning_as_a_mask_over_all_keys():
    ids = torch.zeros(1, 8, dtype=torch.long)
    split = ContextSplit(2, 1, _HFLike())  # CP rank 1 of 2: global positions 2, 3, 4, 5
    left = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    _, kw, _ = split.split((), {"input_ids": ids, "attention_mask": left}, None)
    assert kw["attention_mask"].shape == (1, 1, 4, 8)  # HF takes a 4-D mask as given
    # causal over the global positions, the pads never a key
    assert kw["attention_mask"].tolist() == _allowed([[], [3], [3, 4], [3, 4, 5]])
    assert kw["position_ids"].tolist() == [[2, 3, 4, 5]]
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # two documents, no attention_mask
    _, kw, _ = split.split((), {"input_ids": ids, "position_ids": packed}, None)
    assert kw["attention_mask"].tolist() == _allowed([[0, 1, 2], [3], [3, 4], [3, 4, 5]])
    assert kw["position_ids"].tolist() == [[2, 0, 1, 2]]  # each document's own positions
    # with a 2-D mask, restarting positions are RoPE's only (HF's rule): causal and padding
    _, kw, _ = split.split(
        (), {"input_ids": ids, "position_ids": packed, "attention_mask": left}, None
    )
    assert kw["attention_mask"].tolist() == _allowed([[], [3], [3, 4], [3, 4, 5]])
    split.traced = True  # a traced pipeline's graph was made with the example's mask form
    with pytest.raises(ValueError, match="is traced into pipeline stages"):
        split.split((), {"input_ids": ids, "position_ids": packed}, None)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.zeros(2, 6),), {}, "sequence length 6 does not split into 2 x cp_size = 4"),
        ((torch.zeros(6),), {}, "cannot find the batch's sequence dimension"),
        (
            (torch.zeros(1, 8),),
            {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])},
            "packed documents",
        ),
    ],
)
def test_batches_it_cannot_split_are_refused(args, kwargs, message):
    with pytest.raises(ValueError) as err:
        ContextSplit(2, 0, _Ids()).split(args, kwargs, None)
    assert message in str(err.value)


def test_one_attention_mask_serves_every_layer_of_a_micro_batch():
    # The (local queries x all keys) mask is saved for backward by each SDPA call: one tensor
    # per micro-batch, not one per layer. Additive in the query's dtype, as torch's kernels
    # would convert a boolean one anew on every call.
    from lightning_zeropp.core.step.context_attention import ContextAttention

    split = ContextSplit(2, 1, _Ids())
    split.set_length(8)  # rank 1 of 2: global positions 2, 3, 4, 5
    attention = ContextAttention(split, None)  # type: ignore[arg-type]
    query = torch.zeros(1, 2, 4, 3)
    causal = attention._mask(None, True, query)
    assert causal is not None and causal.dtype == query.dtype
    allowed = split.positions[:, None] >= torch.arange(8)[None, :]
    assert torch.equal(causal, torch.zeros(4, 8).masked_fill(~allowed, float("-inf")))
    assert attention._mask(None, True, query) is causal  # the next layer's call
    own = torch.ones(1, 1, 4, 8, dtype=torch.bool)  # the model's own: the same object per layer
    own[..., 0] = False
    both = attention._mask(own, True, query)
    assert both is not causal and attention._mask(own, True, query) is both
    assert torch.equal(both, causal.masked_fill(~own, float("-inf")))
    assert attention._mask(own.clone(), True, query) is not both  # the next micro-batch's
    split.set_length(16)  # a new length: new positions, a new mask
    assert attention._mask(None, True, torch.zeros(1, 2, 8, 3)).shape == (8, 16)


def test_whole_sequences_refuses_a_2d_output_as_wide_as_the_local_part_and_pooled_rows():
    # (batch, tokens) and (batch, classes) look alike when classes == this rank's tokens:
    # refused, never gathered by a guess; per-token outputs have a feature dimension
    from lightning_zeropp.core.step.context_attention import whole_sequences

    split = ContextSplit(2, 0, _Ids())
    split.set_length(8)  # 4 tokens on each rank
    with pytest.raises(ValueError, match=r"shape \(3, 4\) whose dim 1 equals this rank's 4"):
        whole_sequences({"scores": torch.zeros(3, 4)}, split, None)  # type: ignore[arg-type]
    # a value per row computed inside the forward (a pooled head: a reward model's score, BERT's
    # pooler) saw this rank's part of each sequence only: refused, never passed on
    for pooled in (torch.zeros(3, 10), torch.zeros(3), torch.zeros(3, 2, 5)):
        with pytest.raises(ValueError, match="no sequence dimension of this rank's 4"):
            whole_sequences({"pooled": pooled}, split, None)  # type: ignore[arg-type]
    scalar = torch.zeros(())  # a loss over this rank's tokens (an MoE auxiliary loss)
    assert whole_sequences(scalar, split, None) is scalar  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("family", "refused"),
    [("llama", False), ("qwen2", False), ("mistral", True), ("gemma2", True)],
)
def test_a_sliding_window_model_is_refused_under_cp(family: str, refused: bool) -> None:
    """CP attention masks whole sequences causally: a sliding window (Mistral's, Gemma-2's
    alternate layers) would silently widen, so such a model is refused at setup; Qwen2's window,
    switched off by default, is not one."""
    from transformers import AutoConfig

    from lightning_zeropp.core.step.context import attention_refusal

    model = nn.Linear(2, 2)
    model.config = AutoConfig.for_model(family)  # what the refusal reads of an HF model
    model.config._attn_implementation = "sdpa"
    refusal = attention_refusal(model)
    if not refused:
        assert refusal is None
        return
    assert refusal is not None and "sliding window of 4096 tokens" in refusal
    assert "cp_size=1" in refusal and "sliding_window=None" in refusal
    model.config.sliding_window = None  # the fix it names
    assert attention_refusal(model) is None


def test_a_head_pooling_each_row_in_its_forward_is_refused_under_cp() -> None:
    """A sequence-classification head (TRL's reward model) pools each row at its last non-pad
    token inside its forward, which under CP sees one rank's part of the sequence: refused at
    setup, also inside a module that wraps it (a LightningModule's child, a PEFT model); the
    causal LM of the same config is not."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from lightning_zeropp.core.step.context import attention_refusal

    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=32, num_labels=1,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        head = AutoModelForSequenceClassification.from_config(config)
        causal = AutoModelForCausalLM.from_config(config)
    wrapper = nn.Module()
    wrapper.model = head
    for model in (head, wrapper):
        refusal = attention_refusal(model)
        assert refusal is not None
        assert refusal.startswith("LlamaForSequenceClassification pools each row at its last")
        assert "(cp_size > 1)" in refusal and "Set cp_size=1" in refusal
    assert attention_refusal(causal) is None


def test_a_peft_model_is_given_the_global_positions_its_base_model_takes() -> None:
    """PEFT's `PeftModelForCausalLM.forward` names no `position_ids` but hands its keywords to
    the base model: each CP rank must give it the global positions of its chunks (without them
    the base model's RoPE read 0 .. T/cp - 1: DPO with LoRA at pp 2 x cp 2 had a first-step
    grad norm of 0.70165 against TRL's 0.70190 in one process)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=32, attn_implementation="sdpa",
    )  # fmt: skip
    base = AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])
    model = peft.get_peft_model(base, lora)
    assert "position_ids" not in inspect.signature(model.forward).parameters
    split = ContextSplit(2, 1, model)
    assert split.takes_positions
    ids = torch.arange(16).reshape(2, 8)
    _, kwargs, _ = split.split((), {"input_ids": ids}, None)
    # CP rank 1 of 2 holds chunks 1 and 2 of 4: global positions 2, 3, 4, 5
    assert kwargs["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    # a forward with neither position_ids nor a base model to hand them to gets none
    assert not ContextSplit(2, 1, nn.Linear(2, 2)).takes_positions


def test_a_wrapper_hiding_the_positions_from_a_rotary_model_is_refused_under_cp() -> None:
    """A module of the user's around an HF model (a LightningModule's net, an Accelerate user's
    wrapper) whose forward takes no position_ids: the model inside would make positions
    0 .. T/cp - 1 for each CP rank's tokens and rotate them so (RoPE is a matmul of the positions,
    which CP attention cannot correct), so it is refused at setup; one naming position_ids, the
    model itself, PEFT's wrapper and a compiled model are not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_zeropp.core.step.context import attention_refusal, takes_positions

    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=32, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    class Hides(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=input_ids).logits

    class Passes(Hides):
        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):  # type: ignore[override]
            return self.lm(input_ids=input_ids, position_ids=position_ids).logits

    refusal = attention_refusal(Hides())
    assert refusal is not None and refusal.startswith(
        "Hides.forward takes no position_ids, but LlamaRotaryEmbedding inside it"
    )
    assert "Name position_ids in your module's forward" in refusal and "cp_size=1" in refusal
    for fine in (Passes(), model, torch.compile(model)):
        assert takes_positions(fine) and attention_refusal(fine) is None
