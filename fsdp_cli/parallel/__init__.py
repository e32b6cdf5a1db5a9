"""How a model is parallelised: tensor parallel, activation checkpointing, compile, fully_shard.

:func:`fsdp_cli.parallel.parallelize.parallelize` applies them in one place and in one order.
"""
