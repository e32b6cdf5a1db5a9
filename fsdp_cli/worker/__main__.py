"""``python -m fsdp_cli.worker RUN_DIR/config.yaml``: what torch.distributed.run starts per rank (or,
``launcher.start_method=fork`` or ``forkserver``, runs in each rank it forks: ``--run-path`` this
file)."""

import multiprocessing

from fsdp_cli.worker.rank import main

main(forked=multiprocessing.parent_process() is not None)
