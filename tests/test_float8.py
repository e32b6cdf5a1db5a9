"""float8 through torchao: which layers convert, the emulated float8 matmuls a CPU runs, and which
devices are refused; the training run on CPU ranks is in test_precision, on a float8-capable GPU
in test_gpu."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_cli.config.schema import LlamaConfig
from fsdp_cli.errors import ConfigError
from fsdp_cli.models.llama import Llama
from fsdp_cli.parallel.float8 import apply_float8, check_float8_device, device_problem, float8_candidates

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


def test_a_cpu_emulates_float8_and_a_gpu_needs_float8_tensor_cores() -> None:
    check_float8_device("cpu")  # no error: emulated
    assert device_problem(on_gpu=False, capability=None) is None
    assert device_problem(on_gpu=True, capability=(9, 0)) is None
    assert device_problem(on_gpu=True, capability=None) is None  # unknown: the rank checks its own
    problem = device_problem(on_gpu=True, capability=(8, 0), gpu="A100")
    assert isinstance(problem, ConfigError)
    assert problem.one_line().startswith(
        "strategy.float8=true: no float8 tensor cores on A100 (compute capability 8.0)"
    )


def test_emulated_float8_computes_on_float8_values() -> None:
    """The emulated layers round their inputs and weights to float8 (e4m3: 3 mantissa bits, a
    relative rounding up to 2^-4): outputs differ from the plain layer's, by a few percent at most."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    converted = copy.deepcopy(plain).append(torch.nn.Linear(64, 8))  # a head, which stays plain
    assert apply_float8(converted, emulate=True) == 2
    x = torch.randn(32, 64)
    want, got = plain(x), converted[:2](x)
    error = (got - want).norm() / want.norm()
    assert 0 < error < 0.1, error
    got.sum().backward()
    assert converted[0].weight.grad is not None and converted[0].weight.grad.dtype == torch.float32
