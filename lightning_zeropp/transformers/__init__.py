"""The transformers front: `transformers.Trainer` scripts pipelined over FSDP2.

    from lightning_zeropp.transformers import ZeroPPPlugin, ZeroPPTrainer

    trainer = ZeroPPTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                            data_collator=..., zeropp_plugin=ZeroPPPlugin(pp_size=2))

`ZeroPPTrainer` is the Trainer with a `ZeroPPAccelerator` in place of its `Accelerator`, so this
front imports the Accelerate front (its natural dependency: the Trainer is an Accelerate loop) and
the core; nothing imports this front, and importing `lightning_zeropp` does not import
transformers. Launch with `torchrun` or `accelerate launch`; settings left out of the plugin come
from `ZEROPP_*` variables, as in the Accelerate front. Needs the `hf` and `accelerate` extras.
"""

from lightning_zeropp.accelerate.settings import ZeroPPPlugin
from lightning_zeropp.transformers.trainer import ZeroPPTrainer, release_weights

__all__ = ["ZeroPPPlugin", "ZeroPPTrainer", "release_weights"]
