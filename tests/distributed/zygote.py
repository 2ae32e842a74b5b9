"""A fork server for test ranks: imports torch, Lightning, Accelerate and transformers once, then
forks one child per rank, so a launch does not pay every rank's import time again.

Started once per pytest process by `launch` (`python -m tests.distributed.zygote`). Each request
is one JSON line on stdin: `{"env", "argv", "log", "exit_file"}`; the server forks a child that
takes that environment and those arguments, writes its output to `log` and runs
`tests.distributed.worker` as `python -m` would; the server answers with the child's pid. A
child that ends on its own writes its exit status to `exit_file`; for one ended by a signal the
server writes it (negative: the signal, as `subprocess.Popen.returncode`). EOF on stdin stops
the server.

Forking is safe here because the server itself starts no thread and initializes no device: the
children create their own process groups after the fork, as fresh processes would.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys
import traceback
from typing import Any

# Before torch loads OpenMP: the children must see one thread per rank, as `launch` sets.
os.environ["OMP_NUM_THREADS"] = "1"

import accelerate  # noqa: E402, F401
import lightning.pytorch  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed.checkpoint  # noqa: E402, F401
import torch.distributed.pipelining  # noqa: E402, F401
import torchmetrics  # noqa: E402, F401
import transformers  # noqa: E402, F401
from transformers import (  # noqa: E402, F401
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

import lightning_zeropp.accelerate  # noqa: E402, F401
import lightning_zeropp.lightning  # noqa: E402, F401
import lightning_zeropp.models.hf  # noqa: E402, F401
import lightning_zeropp.transformers  # noqa: E402, F401

_exit_files: dict[int, str] = {}


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        path = _exit_files.pop(pid, None)
        if path is not None and not os.path.exists(path):  # a child that exits writes its own
            try:
                _write_code(path, code)
            except OSError as err:  # its directory is gone: never let the server die of it
                print(f"zygote: cannot write {path}: {err}", file=sys.stderr, flush=True)


def _write_code(path: str, code: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.replace(tmp, path)  # whole or absent: the launcher never reads half a code


def _child(request: dict[str, Any]) -> None:
    os.setpgid(0, 0)  # its own group, as a fresh process: a kill reaches what it starts
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's requests (its stdin) are not the child's to read
    os.close(null)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the child
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["argv"]]
    code = 0
    try:
        runpy.run_module("tests.distributed.worker", run_name="__main__", alter_sys=True)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the rank's log, as a fresh process would
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Its own code, written before it exits: the launcher reads it even if the server is gone.
    _write_code(request["exit_file"], code)
    os._exit(code)


def main() -> None:
    # No SIGCHLD handler: a Python handler can be left pending while the server blocks in read()
    # (a child that exits while the handler for another runs is then reaped, and its code
    # written, only at the next request), so the loop polls instead: it reaps every 50 ms and
    # reads requests from the raw descriptor when there are some.
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        _reap()
        if not ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return  # EOF: the launcher's process ended
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            _exit_files[pid] = request["exit_file"]
            os.write(1, (json.dumps({"pid": pid}) + "\n").encode())


if __name__ == "__main__":
    main()
