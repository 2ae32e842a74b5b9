"""TRL's trainers pipelined: `from lightning_zeropp.trl import ZeroPPSFTTrainer`.

    trainer = ZeroPPSFTTrainer(model=model, args=SFTConfig(...), train_dataset=...,
                               zeropp_plugin=ZeroPPPlugin(pp_size=2))

takes TRL's own arguments plus `zeropp_plugin` (`ZeroPPTrainer`'s). The TRL methods overridden
live in `sft.py`, checked on the TRL versions `CHECKED` names; another version is refused at
import with that range (the extra `lightning-zeropp[trl]` pins it). Importing
`lightning_zeropp` never imports TRL; this module needs it.
"""

from __future__ import annotations

import trl
from packaging.version import Version

CHECKED = (Version("1.16"), Version("1.17"))  # [low, high): the TRL releases the overrides follow

if not CHECKED[0] <= Version(trl.__version__) < CHECKED[1]:
    raise ImportError(
        f"lightning_zeropp.trl overrides methods of TRL's trainers checked on TRL "
        f">={CHECKED[0]},<{CHECKED[1]}; TRL {trl.__version__} is installed. Install "
        "lightning-zeropp[trl] (or that TRL range)."
    )

from lightning_zeropp.trl.dpo import ZeroPPDPOTrainer  # noqa: E402 - after the version check
from lightning_zeropp.trl.reward import ZeroPPRewardTrainer  # noqa: E402 - after the version check
from lightning_zeropp.trl.sft import ZeroPPSFTTrainer  # noqa: E402 - after the version check

__all__ = ["CHECKED", "ZeroPPDPOTrainer", "ZeroPPRewardTrainer", "ZeroPPSFTTrainer"]
