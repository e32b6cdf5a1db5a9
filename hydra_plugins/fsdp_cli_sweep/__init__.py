"""fsdp-train's sweep launcher as a Hydra plugin (``hydra/launcher=fsdp_cli``).

``hydra_plugins`` is a namespace package shared with every installed Hydra plugin: it must never
get an ``__init__.py`` (that would hide optuna's, submitit's, ...). Only this sub-package ships.
"""
