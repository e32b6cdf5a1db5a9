"""What the agent imports once before it forks ranks (``launcher.start_method=fork``), or its
forkserver does (``forkserver``), so that the ranks start without importing it again: torch,
Lightning (with what it pulls in: torchmetrics, and transformers when installed) and the rank's
own code.

Importing must not initialize CUDA: a process forked after that cannot use it.
:data:`CUDA_INITIALIZED` records whether it happened, and a forked rank refuses to start then.
"""

import atexit
import gc
import os

from fsdp_cli.launch.environment import AGENT_PID_ENV, exit_now
from fsdp_cli.library_noise import quiet_library_noise

_SERVER_PID = os.getpid()


def _end_without_teardown() -> None:
    """The server ends once the agent and its ranks have (its pipe reads EOF). Registered before
    the imports below, this runs after their exit handlers and ends the server there: tearing down
    an interpreter that imported torch and Lightning takes 1-4 s of CPU, after fsdp-train has
    exited and with its stdout held open (``fsdp-train | tee log`` waited for it). A rank forked
    from the server never runs it: it ends by os._exit."""
    if os.getpid() == _SERVER_PID:
        exit_now(0, exit_handlers=False)


if os.environ.get(AGENT_PID_ENV) == str(os.getppid()):  # imported by the agent's forkserver
    atexit.register(_end_without_teardown)

# The imports below make some 700,000 objects the collector tracks, nearly all alive as long as the
# process. The collector is off while they are made (its passes over them cost 1.4 of the import's
# 8.5 CPU-seconds), and they are frozen afterwards (gc.freeze: moved out of every generation),
# which Python documents for processes that fork without exec: each rank forked from here runs its
# collections over its own objects only, and does not write into (and so copy) the pages of those
# it shares. The import's own garbage cycles stay (about 12,000 objects; no measurable memory).
quiet_library_noise()  # what torchao and torch log as they are imported below
_COLLECTING = gc.isenabled()
gc.disable()

import lightning.pytorch  # noqa: E402, F401
import torch  # noqa: E402

import fsdp_cli.builders.callbacks  # noqa: E402
import fsdp_cli.builders.data  # noqa: E402
import fsdp_cli.builders.model  # noqa: E402
import fsdp_cli.builders.strategy  # noqa: E402
import fsdp_cli.builders.trainer  # noqa: E402
import fsdp_cli.worker.rank  # noqa: E402, F401

CUDA_INITIALIZED = torch.cuda.is_initialized()

gc.freeze()
if _COLLECTING:
    gc.enable()
