"""The launcher process: PyTorch's elastic agent (``torch.distributed.run``), reporting failures our way.

``python -m fsdp_cli.launch.agent <torchrun arguments>`` runs exactly what ``torchrun`` would. The
difference is at the end: when a rank fails, torchrun prints its own traceback and failure
table; for a config error (a rank exited with status 2 after printing one line) that is noise,
so the agent exits 2 quietly. For any other failure it prints the failure table, which names
the rank that failed first, and exits 1. The table also goes to ``<log dir>/launcher.log``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from fsdp_cli.launch.launcher import LOG_DIR_ENV
from fsdp_cli.rundir.files import LAUNCHER_LOG
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_PREEMPTED


def main(argv: list[str]) -> int:
    args = get_args_parser().parse_args(argv)
    # The agent's own per-event chatter ("Sending process ... closing signal") adds nothing the
    # failure report below does not say.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        run(args)
    except SignalException as err:
        # Preemption (SIGTERM): the ranks were sent the signal, saved, and exited. Ctrl-C and
        # the others keep the shell's 128 + signal convention.
        print(f"fsdp-train: stopped by signal {err.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        report = err.format_msg()
        log_dir = os.environ.get(LOG_DIR_ENV)
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / LAUNCHER_LOG).write_text(report + "\n")
        if first.exitcode in (EXIT_CONFIG_ERROR, EXIT_PREEMPTED):
            return first.exitcode
        print(report, file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
