"""Weights: where parameter values come from and go to. `materialize` allocates a meta-device
model's shards and fills them (the model's own init, run module by module by `init_modules`: the one its constructor applied, recorded
by `init_record` while it was built on the meta device and replayed by `init_tape`); `load` reads this rank's shards from
safetensors or a distributed checkpoint; `checkpoint` saves and loads sharded model and optimizer
state, `async_checkpoint` in the background, `commit` publishes a directory atomically,
`checksum` writes and checks its files' hashes, `trust` reads its pickles without running code;
`full_state` loads a whole state into shards; `export` gathers the whole state dict on one rank
(its names in the unsplit model's order: `name_order`).
"""
