"""Settings: the one vocabulary of a run, checked without torch.distributed. `config` is
`ZeroPPConfig` (layout, schedule, precision, ZeRO++ switches) and its resolution against a world;
`placement` says which stages a pipeline rank holds under each schedule style; `plus` holds ZeRO++'s
settings and their checks; `env` reads the `ZEROPP_*` environment variables the launchers carry;
`launch` checks the launcher's environment (a busy port, a restart sharing torchrun's store).
The ground floor: nothing here imports another room.
"""
