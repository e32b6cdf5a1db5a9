"""float8 through torchao: which layers convert (on CPU); the refusal on CPU is in test_validation,
the training run on a float8-capable GPU in test_gpu."""

from __future__ import annotations

import pytest
import torch

from fsdp_cli.config.schema import LlamaConfig
from fsdp_cli.errors import ConfigError
from fsdp_cli.models.llama import Llama
from fsdp_cli.parallel.float8 import apply_float8, check_float8_device, float8_candidates

pytest.importorskip(
    "torchao", reason="torchao is in the test extra; without it the conversion cannot be checked"
)


def test_linear_layers_convert_except_the_head_and_odd_sizes() -> None:
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2))
    chosen = float8_candidates(model)
    assert "output" not in chosen and "layers.0.attention.wq" in chosen and len(chosen) == 2 * 7
    assert apply_float8(model) == 14
    kinds = {type(m).__name__ for name, m in model.named_modules() if name in chosen}
    assert kinds == {"Float8Linear"} and type(model.output) is torch.nn.Linear
    odd = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 64), torch.nn.Linear(64, 10))
    assert float8_candidates(odd) == []  # 40 is not a multiple of 16; the last layer is the head


def test_a_cpu_rank_refuses_float8_in_one_line() -> None:
    with pytest.raises(ConfigError, match="float8 tensor cores; this run is on CPU"):
        check_float8_device("cpu")
