"""Bundled training data: a synthetic language with a known entropy floor, made on the fly.

Text comes from a seeded sparse Markov chain over `vocab_size` tokens: each token has a few likely
successors. A model that learns the transitions drives its loss from ln(vocab_size) down toward
the chain's entropy, so a falling loss means real learning, and no download is needed.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["MarkovLanguage", "TokenDataset"]


class MarkovLanguage:
    """A first-order Markov chain with `branching` successors per token."""

    def __init__(self, vocab_size: int = 256, branching: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        weights = torch.rand(vocab_size, branching, generator=g) + 0.1
        self.probs = weights / weights.sum(-1, keepdim=True)

    def entropy(self) -> float:
        """Average next-token entropy in nats: the loss floor a perfect model reaches."""
        return float(-(self.probs * self.probs.log()).sum(-1).mean())

    def sample(self, num_tokens: int, seed: int) -> torch.Tensor:
        """A token stream of length `num_tokens`, the same for the same seed."""
        g = torch.Generator().manual_seed(seed)
        cum = self.probs.cumsum(-1).tolist()
        succ = self.successors.tolist()
        uniforms = torch.rand(num_tokens, generator=g).tolist()
        tok = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        out = []
        for u in uniforms:
            out.append(tok)
            row = cum[tok]
            k = next((j for j, c in enumerate(row) if u < c), len(row) - 1)
            tok = succ[tok][k]
        return torch.tensor(out, dtype=torch.long)


class TokenDataset(Dataset):
    """Fixed-length (input, target) windows of a token stream, target shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    @classmethod
    def markov(
        cls, num_samples: int, seq_len: int, vocab_size: int = 256, stream: int = 0
    ) -> TokenDataset:
        """`num_samples` windows of the bundled language; another `stream` gives other text of
        the same language (use one for training and another for validation)."""
        lang = MarkovLanguage(vocab_size=vocab_size)
        return cls(lang.sample(num_samples * seq_len + 1, seed=1000 + stream), seq_len)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]
