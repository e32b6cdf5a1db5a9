"""``python -m fsdp_cli.worker RUN_DIR/config.yaml``: what torch.distributed.run starts per rank (or,
``launcher.start_method=fork`` or ``forkserver``, runs in each rank it forks: ``--run-path`` this
file).

Guarded by ``__name__``: a process that a rank starts with ``spawn`` or ``forkserver`` (a
DataLoader's workers, a user's ``multiprocessing_context``) imports the rank's main file again, as
``__mp_main__``, and must not start a second rank (as a script run with ``python train.py`` keeps
its training under the same guard)."""

import multiprocessing

from fsdp_cli.worker.rank import main

if __name__ == "__main__":
    main(forked=multiprocessing.parent_process() is not None)
