"""A sweep (``fsdp-train -m ...``) from its first check to its comparison table.

* :mod:`~fsdp_cli.sweep.launcher`: Hydra's basic launcher plus a pre-pass that checks every job
  before the first starts (``hydra/launcher=fsdp_cli``; ``hydra_plugins/fsdp_cli_sweep`` is the
  thin plugin shim Hydra finds);
* :mod:`~fsdp_cli.sweep.job`: one job, which never stops the sweep (skipped or failed, it
  returns the worst objective);
* :mod:`~fsdp_cli.sweep.report`: the Hydra callback that ends the sweep, deciding its exit status;
* :mod:`~fsdp_cli.sweep.jobs`, :mod:`~fsdp_cli.sweep.summary`, :mod:`~fsdp_cli.sweep.plot`: the
  job folders read back, ``sweep_summary.csv/.json`` and the table, ``sweep_summary.png``.

Imported by every Hydra application's plugin scan (through the launcher): nothing here imports
more than Hydra and OmegaConf at import time.
"""
