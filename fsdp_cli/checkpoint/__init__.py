"""Checkpoints: the on-disk formats, strategy save/load, manifests, and the ``fsdp-ckpt`` tool."""
