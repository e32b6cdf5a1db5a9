"""Typed configuration: schemas, Hydra registration, conversion and cross-field validation.

Nothing in this package imports torch or lightning: it runs in the parent process on the
config-only paths (``--help``, ``--cfg``, validation errors) and must stay fast.
"""
