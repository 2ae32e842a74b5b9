"""Models and data bundled with the library: the embedded default needs no download."""

from lightning_zeropp.models.data import MarkovLanguage, TokenDataset
from lightning_zeropp.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "MarkovLanguage", "TokenDataset"]
