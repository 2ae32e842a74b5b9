"""Fronts' shared room: what every front needs and no front owns.

Framework-free code that any front (`lightning/`, `accelerate/`, `transformers/`, `trl/`, or a
new one) may import, so that no front imports another to reuse it and a new front copies
nothing: HF models' loss conventions (`hf_loss`: the token rule, `num_items_in_batch`, the KV
cache; `loss_rule`: a forward's own loss checked against that rule; `hf_chunked`: the head and
loss in chunks), `packing` (packed rows and sequence-length buckets), `call_adapter` (how a
user's call of the pipelined model becomes stage inputs), `loader` (a `DataLoader` rebuilt with
one field changed), `optim` (a user's optimizer rebuilt over a rank's stages, its scheduler
retargeted) and `microbatches` (how many micro-batches a call runs in, and whether a loader's rows
split into them).

It sits between the core and the fronts: it imports the core and torch, never a front, and no
framework (Lightning, Accelerate, transformers, TRL, Hydra) at import time
(`tests/unit/test_front_rooms.py` checks both). The core imports nothing from here.
"""
