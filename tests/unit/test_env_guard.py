"""ZEROPP_* variables under a Trainer that is not ZeroPP's (TRL's SFTTrainer unchanged): the
start-up guard (`lightning_zeropp_guard.pth`, installed with the package, runs
`_lightning_zeropp_guard`) refuses it at construction, naming the variables and the ZeroPP class
to use; before, the run trained as plain DDP, ignoring them. Without ZEROPP_* variables the
guard imports nothing. Each case is a fresh interpreter that processes the .pth file as
site-packages would (`site.addsitedir`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import site, sys
site.addsitedir({site!r})
print("GUARD", "_lightning_zeropp_guard" in sys.modules)
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from tests.distributed.trainer_script import tokenizer

config = AutoConfig.for_model("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
model = AutoModelForCausalLM.from_config(config)
data = Dataset.from_dict({{"input_ids": [[1, 2, 3, 4]] * 4}})
args = SFTConfig(output_dir={out!r}, use_cpu=True, report_to=[], max_steps=1)
try:
    SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer())
    print("SFT built")
except ValueError as err:
    print("SFT refused:", err)

class Marked(Trainer):  # what ZeroPPTrainer sets: its ZEROPP_* variables are its settings
    _zeropp_trainer = True

Marked(model=model, args=TrainingArguments(output_dir={out!r}, use_cpu=True, report_to=[]))
print("MARKED built")
"""


QUIET = """
import site, sys
site.addsitedir({site!r})
print("GUARD", "_lightning_zeropp_guard" in sys.modules)
print("WRAPPED", any(type(f).__name__ == "_GuardOnImport" for f in sys.meta_path))
"""


def _run(tmp_path: Path, env: dict[str, str], template: str = SCRIPT) -> str:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(ROOT / "lightning_zeropp_guard.pth", site_dir)
    script = textwrap.dedent(template.format(site=str(site_dir), out=str(tmp_path / "out")))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZEROPP_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_an_unchanged_trl_trainer_under_zeropp_variables_is_refused(tmp_path):
    out = _run(tmp_path, {"ZEROPP_PP_SIZE": "2"})
    assert "GUARD True" in out
    refused = next(line for line in out.splitlines() if line.startswith("SFT refused:"))
    assert "ZEROPP_PP_SIZE=2 is set, but SFTTrainer (trl) is transformers' Trainer" in refused
    assert "plain data parallelism" in refused and "unset the ZEROPP_* variables" in refused
    assert "MARKED built" in out  # ZeroPP's own Trainer classes pass


def test_without_zeropp_variables_nothing_is_imported_or_refused(tmp_path):
    out = _run(tmp_path, {}, QUIET)
    assert "GUARD False" in out and "WRAPPED False" in out
