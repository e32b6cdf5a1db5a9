"""fsdp_cli: YAML-configured sharded PyTorch Lightning training (``fsdp-train``, ``fsdp-ckpt``)."""

__version__ = "0.1.0"
