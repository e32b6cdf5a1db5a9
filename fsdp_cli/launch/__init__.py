"""Starting the ranks of a run: the environment this process runs in (a torchrun/SLURM job,
visible GPUs), the launcher the parent uses, and the elastic agent it starts.

Torch-free except :mod:`fsdp_cli.launch.agent`, which runs in its own process.
"""
