"""ZEROPP_* variables under TRL's DPOTrainer unchanged: the start-up guard names
`ZeroPPDPOTrainer` as the fix (`_lightning_zeropp_guard.message`)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


def test_an_unchanged_dpo_trainer_is_told_its_zeropp_class():
    from trl import DPOTrainer

    from _lightning_zeropp_guard import message

    text = message(DPOTrainer, {"ZEROPP_PP_SIZE": "2"})
    assert "DPOTrainer (trl) is transformers' Trainer without ZeroPP" in text
    assert "import ZeroPPDPOTrainer from lightning_zeropp.trl" in text
