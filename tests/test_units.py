"""Builders and small pieces, in-process without a process group."""

from __future__ import annotations

import pytest
import torch
from conftest import composed, run_of
from torch import nn

from fsdp_cli.config.schema import WrapConfig, WrapPolicy
from fsdp_cli.data.sampler import StepBatchSampler
from fsdp_cli.data.synthetic import SyntheticTokens
from fsdp_cli.data.text import ByteWindows, read_corpus
from fsdp_cli.errors import ConfigError
from fsdp_cli.models.llama import Llama, TransformerBlock
from fsdp_cli.parallel.wrap import find_classes, repeated_block_class, wrap_units


def _take(sampler: StepBatchSampler, n: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize(("dp", "micro"), [(1, 8), (2, 4), (4, 2), (2, 2), (8, 1)])
def test_every_layout_sees_the_same_global_batches(dp: int, micro: int) -> None:
    global_batch, steps = 8, 3
    accumulation = global_batch // dp // micro
    seen: list[set[int]] = [set() for _ in range(steps)]
    for rank in range(dp):
        sampler = StepBatchSampler(
            global_batch_size=global_batch, micro_batch_size=micro, dp_rank=rank, dp_size=dp
        )
        for i, batch in enumerate(_take(sampler, steps * accumulation)):
            assert len(batch) == micro
            seen[i // accumulation].update(batch)
    assert seen == [set(range(s * global_batch, (s + 1) * global_batch)) for s in range(steps)]


def test_sampler_resumes_at_a_step() -> None:
    fresh = _take(StepBatchSampler(global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2), 6)
    resumed = _take(
        StepBatchSampler(global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2, start_step=3), 3
    )
    assert resumed == fresh[3:]


def test_synthetic_tokens_are_deterministic_and_learnable() -> None:
    data = SyntheticTokens(vocab_size=256, seq_len=16, seed=3)
    a, b = data[5], SyntheticTokens(vocab_size=256, seq_len=16, seed=3)[5]
    assert torch.equal(a, b) and a.shape == (17,) and not torch.equal(a, data[6])
    steps = (a[1:] - a[:-1]) % 256
    assert steps.min() >= 1 and steps.max() <= 4


def test_text_corpus_defaults_to_python_sources() -> None:
    corpus = read_corpus(None, max_bytes=100_000)
    assert len(corpus) == 100_000 and corpus.dtype == torch.uint8
    window = ByteWindows(corpus, seq_len=64, seed=0)[3]
    assert window.shape == (65,) and int(window.max()) < 256


def test_wrap_policy_finds_blocks_and_rejects_unknown_names() -> None:
    model = Llama(composed().model, seed=0)
    assert repeated_block_class(model) is TransformerBlock
    assert len(wrap_units(model, WrapConfig())) == model.cfg.n_layers
    assert find_classes(model, ["fsdp_cli.models.llama.TransformerBlock"]) == (TransformerBlock,)
    with pytest.raises(ConfigError) as info:
        wrap_units(model, WrapConfig(policy=WrapPolicy.classes, classes=["LlamaDecoderLayer"]))
    message = info.value.one_line()
    assert "wrap.classes=LlamaDecoderLayer" in message and "TransformerBlock" in message


def test_size_policy_claims_parameters_bottom_up() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)))
    units = wrap_units(model, WrapConfig(policy=WrapPolicy.size, min_num_params=100))
    assert units == [model[0], model[1][0], model[1][1]]


def test_llama_shapes_and_gqa() -> None:
    cfg = composed("model.n_layers=2").model
    model = Llama(cfg, seed=0)
    logits = model(torch.randint(0, cfg.vocab_size, (2, 10)))
    assert logits.shape == (2, 10, cfg.vocab_size)
    assert model.layers["0"].attention.wk.weight.shape[0] == cfg.n_kv_heads * (cfg.dim // cfg.n_heads)


def test_llama_init_depends_only_on_the_seed() -> None:
    cfg = composed().model
    a, b, c = Llama(cfg, seed=1), Llama(cfg, seed=1), Llama(cfg, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name


def test_llama_init_is_the_same_weights_in_every_precision() -> None:
    """64-true and bf16-true build the model under their default dtype: the draws stay fp32, so
    each precision starts from the fp32 weights rounded to its dtype."""
    cfg = composed("model.n_layers=1").model
    reference = Llama(cfg, seed=3)
    for dtype in (torch.float64, torch.bfloat16):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            other = Llama(cfg, seed=3)
        finally:
            torch.set_default_dtype(previous)
        for (name, p), q in zip(reference.named_parameters(), other.parameters()):
            assert q.dtype == dtype and torch.equal(p.to(dtype), q), (dtype, name)


def test_meta_then_init_equals_direct_init() -> None:
    cfg = composed().model
    direct = Llama(cfg, seed=4)
    with torch.device("meta"):
        lazy = Llama(cfg, seed=4)
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    for (name, p), q in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(p, q), name
    assert torch.equal(direct.rope, lazy.rope)


def test_init_draws_on_the_host_whatever_the_default_device() -> None:
    """Lightning builds a DDP rank's model under its device (``cuda:N``), where a host generator
    cannot draw (first seen on a GPU: "Expected a 'cuda' device type for generator"); here the
    default device is meta, which breaks the same way when the draw follows the default device."""
    cfg = composed().model
    direct = Llama(cfg, seed=4)
    materialised = Llama(cfg, seed=4)
    with torch.device("meta"):
        materialised.init_weights(buffer_device=torch.device("cpu"))
    for (name, p), q in zip(direct.state_dict().items(), materialised.state_dict().values()):
        assert torch.equal(p, q), name


def test_custom_factory_returning_logits_object_is_wrapped() -> None:
    from fsdp_cli.builders.model import build_module
    from fsdp_cli.models.causal_lm import CausalLMModule

    cfg = composed(
        "model=custom", "model._target_=tests.assets.custom_models.make_tiny_lm", "+model.hidden=16"
    )
    module = build_module(run_of(cfg))
    assert isinstance(module, CausalLMModule)
    module.configure_model()
    batch = torch.randint(0, 256, (2, 9))
    loss = module._loss(batch)
    assert loss.ndim == 0 and 4.0 < float(loss.detach()) < 7.0  # ~ln(256) at init


def test_custom_target_that_is_not_a_model() -> None:
    from fsdp_cli.builders.model import build_module

    cfg = composed("model=custom", "model._target_=collections.OrderedDict")
    with pytest.raises(ConfigError, match="not an nn.Module"):
        build_module(run_of(cfg))


def test_a_logger_gets_the_numbers_of_a_row_and_not_the_unmeasured_fields(tmp_path) -> None:
    """MFU is null on a CPU run (no known peak); metrics.jsonl keeps the null, while a logger that
    refuses None (TensorBoard) gets every number of the row and no MFU."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    from fsdp_cli.callbacks.metrics import MetricsCallback

    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callback = MetricsCallback(tmp_path, log_every_n_steps=1, tokens_per_step=8, max_steps=1)
    callback._write(
        SimpleNamespace(logger=logger), {"step": 1, "loss": 2.5, "tflops_per_s": None, "mfu": None}
    )
    logger.finalize("success")
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert b"loss" in events and b"mfu" not in events
    assert callback.rows == [{"step": 1, "loss": 2.5, "tflops_per_s": None, "mfu": None}]
