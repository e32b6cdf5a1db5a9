"""``python -m fsdp_cli.worker RUN_DIR/config.yaml``: what torch.distributed.run starts per rank."""

from fsdp_cli.worker.rank import main

main()
