"""Token datasets from local text: a plain text file, or a HuggingFace dataset saved to disk.

Both return the bundled `TokenDataset` (fixed-length windows, targets shifted by one), so any
recipe trains on them as on the bundled Markov data. Text is tokenized as UTF-8 bytes (ids 0-255,
no download, fits the bundled GPT's 256-token vocabulary) unless `tokenizer` names a local
HuggingFace tokenizer directory. The held-out split is the *end* of the token stream (or of the
rows), so train and validation never share a window.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_zeropp.models.data import TokenDataset

__all__ = ["hf_disk_dataset", "text_file_dataset", "tokenize"]

_SPLITS = ("train", "val")


def text_file_dataset(
    path: str | Path,
    seq_len: int,
    *,
    split: str = "train",
    val_fraction: float = 0.05,
    tokenizer: str | None = None,
) -> TokenDataset:
    """Windows of `seq_len` tokens from a UTF-8 text file: the first `1 - val_fraction` of its
    tokens for split="train", the rest for split="val"."""
    _check_split_args(seq_len, split, val_fraction)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} is not a file; give a local text file.")
    tokens = tokenize([file.read_text(encoding="utf-8")], tokenizer)
    return _window(_split_stream(tokens, split, val_fraction), seq_len, split, str(path))


def hf_disk_dataset(
    path: str | Path,
    seq_len: int,
    *,
    split: str = "train",
    val_fraction: float = 0.05,
    tokenizer: str | None = None,
) -> TokenDataset:
    """Windows of `seq_len` tokens from a dataset written by `datasets.save_to_disk`.

    A `DatasetDict` gives its "train" split for split="train" and its "validation" (or "test")
    split for split="val"; a single `Dataset` is split by rows, the last `val_fraction` held out.
    Rows are read from the `input_ids` column (already tokenized) or else the `text` column.
    """
    _check_split_args(seq_len, split, val_fraction)
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "data=hf_disk reads datasets saved with `save_to_disk` through the `datasets` package, "
            "which is not installed: `pip install datasets`, or use data=text_file."
        ) from None
    if not Path(path).exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist.")
    loaded = datasets.load_from_disk(str(path))
    rows = _pick_split(loaded, split, val_fraction, str(path))
    if "input_ids" in rows.column_names:
        ids = [torch.as_tensor(r, dtype=torch.long) for r in rows["input_ids"]]
        tokens = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
    elif "text" in rows.column_names:
        tokens = tokenize(rows["text"], tokenizer)
    else:
        raise ValueError(
            f"the dataset at {path} has columns {rows.column_names}; it needs an 'input_ids' "
            "(token ids) or a 'text' column."
        )
    return _window(tokens, seq_len, split, str(path))


def tokenize(texts: Iterable[str], tokenizer: str | None = None) -> torch.Tensor:
    """One token stream from `texts`: UTF-8 bytes, or ids of a local HF tokenizer directory."""
    texts = list(texts)
    if tokenizer is None:
        return torch.tensor(list("\n".join(texts).encode("utf-8")), dtype=torch.long)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    ids: list[int] = []
    for text in texts:  # per document: one huge string would hit the tokenizer's length limits
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)  # documents stay apart in the stream
    return torch.tensor(ids, dtype=torch.long)


def _check_split_args(seq_len: int, split: str, val_fraction: float) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"data.seq_len={seq_len!r} must be a positive integer.")
    if split not in _SPLITS:
        raise ValueError(f"split={split!r} is unknown; use one of {list(_SPLITS)}.")
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction!r} must be between 0 and 1 (exclusive).")


def _split_stream(tokens: torch.Tensor, split: str, val_fraction: float) -> torch.Tensor:
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut] if split == "train" else tokens[cut:]


def _pick_split(loaded: Any, split: str, val_fraction: float, path: str) -> Any:
    if hasattr(loaded, "keys"):  # a DatasetDict
        names = ("train",) if split == "train" else ("validation", "test")
        for name in names:
            if name in loaded:
                return loaded[name]
        raise ValueError(
            f"the DatasetDict at {path} has splits {sorted(loaded.keys())}; split={split!r} needs "
            f"one of {list(names)}."
        )
    cut = int(len(loaded) * (1 - val_fraction))
    indices = range(cut) if split == "train" else range(cut, len(loaded))
    return loaded.select(indices)


def _window(tokens: torch.Tensor, seq_len: int, split: str, source: str) -> TokenDataset:
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the {split} split of {source} has {len(tokens)} tokens, fewer than one window of "
            f"data.seq_len + 1 = {seq_len + 1}; use more text, a shorter seq_len or another "
            "val_fraction."
        )
    return TokenDataset(tokens, seq_len)
