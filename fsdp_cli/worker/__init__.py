"""One rank of a run (``python -m fsdp_cli.worker RUN_DIR/config.yaml``, started by the launcher).

* :mod:`~fsdp_cli.worker.rank`: the rank's life in order (read the resolved config, build, fit,
  write the summary), from the rooms below;
* :mod:`~fsdp_cli.worker.process`: the process around the training (its log, the monitor started
  early, a forked rank made a process of its own);
* :mod:`~fsdp_cli.worker.fit`: what the rank builds from the resolved run, and the fit;
* :mod:`~fsdp_cli.worker.summary`: the outcome (a failure as one line) and summary.json's content;
* :mod:`~fsdp_cli.worker.monitor`: what the rank does so that the launcher can supervise it
  (stack dumps, the heartbeat, its one-line error for the agent).
"""
