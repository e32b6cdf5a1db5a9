"""The run directory: what a run leaves behind (file names, statuses and exit codes,
``summary.json`` and the table printed from it).

Torch-free: the parent process reads and prints these after the ranks exit.
"""
