"""The baseline for config-only paths: a bare two-file Hydra app (this file and conf/config.yaml)
that composes, checks one value (exit 2 with one line when it is wrong) and prints its config."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.trainer.max_steps < 1:
        print(f"app: error: trainer.max_steps={cfg.trainer.max_steps}: must be at least 1", file=sys.stderr)
        sys.exit(2)
    print(OmegaConf.to_yaml(cfg))


if __name__ == "__main__":
    main()
