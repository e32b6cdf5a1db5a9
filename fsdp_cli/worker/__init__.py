"""One rank of a run (``python -m fsdp_cli.worker RUN_DIR/config.yaml``, started by the launcher).

* :mod:`~fsdp_cli.worker.rank`: read the resolved config, build, fit, write the summary;
* :mod:`~fsdp_cli.worker.monitor`: what the rank does so that the launcher can supervise it
  (stack dumps, the heartbeat, its one-line error for the agent).
"""
