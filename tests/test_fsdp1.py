"""strategy=fsdp (Lightning's FSDPStrategy, FSDP1) and the lightning_fairscale migration path, on CPU ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import (
    PARITY,
    SINGLE_PROCESS,
    assert_ok,
    assert_same_losses,
    cli_in_process,
    composed,
    read_metrics,
    read_summary,
    run_cli,
)
from test_plan import assert_plan_matches_the_run

from fsdp_cli.config.migrate import migrate
from fsdp_cli.config.schema import DType, FSDPConfig, ShardingStrategy, WrapPolicy
from tests.assets.traces import REDUCE_SCATTER, collectives_per_backward

FSDP1 = ["strategy=fsdp", "devices=2"]
# Each run costs ~10 s of start-up on 2 cores (the 4-rank one twice that): options that do not
# interact share a run, and each is read from the live modules (setup report) or the trace.
SHARDING = {
    "full_shard": None,  # the shared `fsdp` layout run
    # lightning_fairscale's strategy and keywords (see test_ddp_fully_sharded_runs_as_native_fsdp):
    # reshard_after_forward=false is SHARD_GRAD_OP. Also accumulates 2 micro-batches and profiles:
    # FSDP1's no_sync on all but the last.
    "shard_grad_op": [
        "strategy=ddp_fully_sharded",
        "devices=2",
        "strategy.reshard_after_forward=false",
        "strategy.cpu_offload=true",
        "strategy.activation_checkpointing=[TransformerBlock]",
        "data.micro_batch_size=2",
        "trainer.profiler=torch",
    ],
    "no_shard": [*FSDP1, "strategy.sharding_strategy=NO_SHARD"],
    "hybrid_shard_2x2": [
        "strategy=fsdp",
        "devices=4",
        "strategy.sharding_strategy=HYBRID_SHARD",
        "strategy.hybrid_shard_size=2",
    ],
    # The default size (shard within the node, replicate across nodes): one node is one shard group,
    # still a 2-D mesh (FSDP1's hybrid strategies refuse a 1-D one). Two nodes: tests/test_clusters.py.
    # Also wraps by size and checkpoints every block.
    "hybrid_shard_zero2_one_node": [
        *FSDP1,
        "strategy.sharding_strategy=HYBRID_SHARD_ZERO2",
        "wrap=size",
        "wrap.min_num_params=20000",
        "strategy.activation_checkpointing_policy=[TransformerBlock]",
    ],
}
BLOCK_UNITS = ["<root>", *(f"model.layers.{i}" for i in range(4))]
# torch's size policy wraps bottom-up each module whose parameters not yet in a unit number at least
# wrap.min_num_params=20000: each feed-forward projection (45,056), each attention (49,152: its own
# projections hold 16,384 and 8,192), the embedding and the head (32,768 each); the root takes the rest.
SIZE_WRAP_UNITS = [
    "<root>",
    "model.tok_embeddings",
    *(
        f"model.layers.{i}.{m}"
        for i in range(4)
        for m in ("attention", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    ),
    "model.output",
]
MANUAL = ["model=custom", "model._target_=tests.assets.manual_wrap.ManuallyWrappedLM", "data.vocab_size=256"]


@pytest.fixture(scope="module")
def sharding_run(tmp_path_factory: pytest.TempPathFactory, layout_run: Any) -> Any:
    """``sharding_run(name)`` -> (run dir, stderr) of ``SHARDING[name]`` with ``PARITY`` settings,
    run once on first use."""
    root = tmp_path_factory.mktemp("sharding")
    done: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if SHARDING[name] is None:
            return layout_run("fsdp"), ""
        if name not in done:
            run_dir = root / name
            result = run_cli([*SHARDING[name], *PARITY], run_dir)
            assert_ok(result, run_dir)
            done[name] = (run_dir, result.stderr)
        return done[name]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SHARDING))
def test_sharding_option_keeps_single_process_losses(
    reference_losses: list[float], sharding_run: Any, name: str
) -> None:
    run_dir, _ = sharding_run(name)
    summary = read_summary(run_dir)
    assert_same_losses(reference_losses, run_dir)
    assert summary["strategy"] == "fsdp"
    setup = summary["setup"]
    if name == "hybrid_shard_2x2":
        assert setup["mesh"] == {"replicate": 2, "shard": 2}
    if name.endswith("one_node"):
        assert setup["mesh"] == {"replicate": 1, "shard": 2}
    assert setup["activation_checkpointing"] == (
        4 if name in ("shard_grad_op", "hybrid_shard_zero2_one_node") else 0
    )
    if name in ("full_shard", "shard_grad_op", "no_shard"):
        assert_plan_matches_the_run(run_dir)
    if name == "shard_grad_op":
        scatters = collectives_per_backward(run_dir, REDUCE_SCATTER)
        assert sorted(scatters) == [0, 0, 5, 5] and scatters[0] != scatters[1], scatters
    expected = SIZE_WRAP_UNITS if name == "hybrid_shard_zero2_one_node" else BLOCK_UNITS
    assert setup["fsdp_units"] == expected
    # Clipping by norm ran through the FSDP root (Lightning's FSDP plugin would refuse it).
    assert all(row["grad_norm"] > 0 for row in read_metrics(run_dir))


@pytest.mark.distributed
def test_manual_wrap_matches_the_same_module_on_one_process(tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    assert_ok(run_cli([*MANUAL, *SINGLE_PROCESS, *PARITY], single), single)
    summary = assert_ok(run_cli([*MANUAL, "strategy=fsdp", "devices=2", *PARITY], sharded), sharded)
    reference = [row["loss"] for row in read_metrics(single)]
    assert_same_losses(reference, sharded)
    # Each wrap() call made a unit; the embedding and head (outside any unit) got the root unit.
    assert sorted(summary["setup"]["fsdp_units"]) == ["<root>", "blocks.0", "blocks.1"]


@pytest.mark.distributed
def test_optimizer_from_parameters_captured_before_wrapping_is_refused(tmp_path: Path) -> None:
    """With use_orig_params=false FSDP replaces parameters by flat ones; an optimizer over the old
    ones would silently train nothing."""
    run_dir = tmp_path / "captured"
    args = [
        *MANUAL,
        "+model.optimizer_params=captured",
        "strategy=fsdp",
        "strategy.use_orig_params=false",
        "devices=2",
        *PARITY,
    ]
    result = run_cli(args, run_dir)
    assert result.returncode == 2, result.stderr[-2000:]
    error = read_summary(run_dir)["error"]
    assert "FSDP replaced" in error and "self.parameters()" in error and "configure_optimizers()" in error


@pytest.mark.distributed
def test_unknown_wrap_class_lists_the_model_block_classes(tmp_path: Path) -> None:
    run_dir = tmp_path / "badwrap"
    result = run_cli(
        ["strategy=fsdp", "devices=2", "wrap=classes", "wrap.classes=[LlamaDecoderLayer]", *PARITY], run_dir
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("fsdp-train: error:")]
    assert lines and "wrap.classes=LlamaDecoderLayer" in lines[0] and "TransformerBlock" in lines[0], (
        result.stderr[-2000:]
    )
    assert read_summary(run_dir)["status"] == "failed"
    assert not (run_dir / "metrics.jsonl").exists(), "nothing trained"


@pytest.mark.distributed
def test_ddp_fully_sharded_runs_as_native_fsdp(reference_losses: list[float], sharding_run: Any) -> None:
    """lightning_fairscale's strategy with its keywords (the shard_grad_op run above)."""
    run_dir, stderr = sharding_run("shard_grad_op")
    assert "strategy=ddp_fully_sharded (lightning_fairscale) now runs PyTorch's native FSDP" in stderr
    assert "strategy.activation_checkpointing is deprecated" in stderr
    summary = read_summary(run_dir)
    assert summary["strategy"] == "fsdp" and summary["setup"]["activation_checkpointing"] == 4
    config = (run_dir / "config.yaml").read_text()
    assert "name: fsdp\n" in config and "sharding_strategy: SHARD_GRAD_OP\n" in config, config
    assert "cpu_offload: true\n" in config, config
    assert_same_losses(reference_losses, run_dir)


def test_fairscale_keywords_translate() -> None:
    cfg, notices = migrate(
        composed(
            "strategy=ddp_fully_sharded",
            "strategy.reshard_after_forward=false",
            "strategy.compute_dtype=bfloat16",
            "strategy.fp32_reduce_scatter=true",
            "strategy.min_num_params=1000",
            "strategy.flatten_parameters=true",
            "precision='16'",  # as fsdp-train passes `precision=16` on to Hydra
        )
    )
    strategy = cfg.strategy
    assert type(strategy) is FSDPConfig and strategy.name == "fsdp"
    assert strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert (strategy.mixed_precision.param_dtype, strategy.mixed_precision.reduce_dtype) == (
        DType.bfloat16,
        DType.float32,
    )
    assert (cfg.wrap.policy, cfg.wrap.min_num_params) == (WrapPolicy.size, 1000)
    assert cfg.precision.name == "16-mixed"
    assert any("precision=16 is the old name of precision=16-mixed" in n for n in notices)
    assert any("flatten_parameters" in n and "ignored" in n for n in notices)


def test_fsdp_native_and_legacy_precisions() -> None:
    cfg, notices = migrate(composed("strategy=fsdp_native", "precision=bf16"))
    assert type(cfg.strategy) is FSDPConfig and cfg.precision.name == "bf16-mixed"
    assert any("fsdp_native" in n for n in notices)
    cfg, notices = migrate(composed("strategy=fsdp", "strategy.activation_checkpointing=[TransformerBlock]"))
    assert (
        cfg.strategy.activation_checkpointing_policy == ["TransformerBlock"]
        and cfg.strategy.activation_checkpointing is None
    )
    assert any("deprecated" in n for n in notices)


def test_precision_16_on_cpu_is_refused_under_its_new_name(tmp_path: Path) -> None:
    result = cli_in_process(
        ["strategy=ddp_fully_sharded", "precision=16", "accelerator=cpu"], tmp_path / "p16"
    )
    assert result.returncode == 2
    assert "precision=16 is the old name of precision=16-mixed" in result.stderr
    assert "fsdp-train: error: precision=16-mixed: float16 needs a GPU" in result.stderr
