"""What the agent's forkserver imports once, so that the ranks forked from it start without
importing it again (``launcher.start_method=forkserver``): torch, Lightning (with what it pulls in:
torchmetrics, and transformers when installed) and the rank's own code.

Importing must not initialize CUDA: a process forked after that cannot use it.
:data:`CUDA_INITIALIZED` records whether it happened, and a forked rank refuses to start then.
"""

import lightning.pytorch  # noqa: F401
import torch

import fsdp_cli.builders.callbacks
import fsdp_cli.builders.data
import fsdp_cli.builders.model
import fsdp_cli.builders.strategy
import fsdp_cli.builders.trainer
import fsdp_cli.worker.rank  # noqa: F401

CUDA_INITIALIZED = torch.cuda.is_initialized()
