"""fsdp_cli.compat: every private name it relies on exists in the installed libraries, each fenced
function does what its caller needs, and pyproject's version bounds are the tested ones."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from fsdp_cli.compat import (
    SUPPORTED,
    IncompatibleVersionError,
    hydra_internals,
    installed_version,
    lightning_internals,
    multiprocessing_internals,
    require,
    torch_internals,
    transformers_internals,
)

ENTRIES = [
    (module.__name__.rsplit(".", 1)[-1], owner, name)
    for module in (
        hydra_internals,
        lightning_internals,
        multiprocessing_internals,
        torch_internals,
        transformers_internals,
    )
    for owner, name in module.ENTRIES
]


@pytest.mark.parametrize(
    ("library", "owner", "name"), ENTRIES, ids=[f"{lib}:{name}" for lib, _, name in ENTRIES]
)
def test_every_private_name_exists(library: str, owner: object, name: str) -> None:
    if name in ("_signal_connector", "_logger_connector"):  # a Trainer's instance attributes
        import lightning as L

        owner = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert hasattr(owner, name), f"{library}: {owner!r} has no {name}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank server is forked on Linux only")
def test_this_python_s_forkserver_is_one_the_agent_can_fork() -> None:
    """The agent forks its rank server from itself where the stdlib's forkserver has the shape
    it knows (else it spawns one, importing torch a second time): a Python before 3.14 that
    changes it fails here, to be adapted on purpose (3.14 authenticates the server's clients)."""
    if sys.version_info >= (3, 14):
        pytest.skip("Python 3.14's forkserver authenticates its clients: the agent spawns its server")
    assert multiprocessing_internals.can_fork_server()


def test_a_missing_name_is_one_line_naming_the_version() -> None:
    with pytest.raises(IncompatibleVersionError) as info:
        require(types.SimpleNamespace(), "_gone", "torch")
    message = str(info.value)
    assert "\n" not in message
    assert (
        f"torch {installed_version('torch')}" in message
        and f"supported: torch{SUPPORTED['torch']}" in message
    )


def test_pyproject_bounds_are_the_supported_ones_and_hold_for_what_is_installed() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    project = pyproject["project"]
    listed = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    requirements = {Requirement(r).name: Requirement(r) for r in listed}
    for package, bounds in SUPPORTED.items():
        req = requirements[package]
        assert str(req.specifier) == ",".join(sorted(bounds.split(","))), (package, str(req.specifier))
        assert any(s.operator == "<" for s in req.specifier), f"{package} needs an upper bound"
        assert req.specifier.contains(installed_version(package), prereleases=True), package


MALICIOUS = {"lightning": ["2.6.2", "2.6.3"]}
"""Releases that must never be installed: lightning 2.6.2 and 2.6.3 ran credential-stealing code on
import (GHSA-w37p-236h-pfx3); pulled from PyPI, but mirrors and caches keep them."""


def test_malicious_releases_are_excluded_everywhere_a_version_is_chosen() -> None:
    import re

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    listed = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    dockerfile = (root / "Dockerfile").read_text()
    for package, versions in MALICIOUS.items():
        specifiers = [Requirement(r).specifier for r in listed if Requirement(r).name == package]
        assert specifiers, f"{package} is not a dependency any more: drop it from MALICIOUS"
        for version in versions:
            assert all(f"!={version}" in map(str, spec) for spec in specifiers), (
                package,
                version,
                specifiers,
            )
            assert Version(version) not in SpecifierSet(SUPPORTED[package]), (package, version)
        # The image's pin (an ARG default) is none of them, and the install line pins it.
        (pin,) = re.findall(rf"^ARG {package.upper()}_VERSION=(\S+)$", dockerfile, re.M)
        assert pin not in versions and Version(pin) in SpecifierSet(SUPPORTED[package]), pin
        assert f'"{package}==${{{package.upper()}_VERSION}}"' in dockerfile


def test_hydra_reporter_is_wrapped() -> None:
    from hydra._internal import utils as hydra_utils

    original = hydra_utils.run_and_report
    seen = []
    try:
        hydra_internals.wrap_run_and_report(lambda inner: lambda func: seen.append(inner) or func())
        assert hydra_utils.run_and_report(lambda: 7) == 7 and seen == [original]
    finally:
        hydra_utils.run_and_report = original


def test_lightning_sigterm_handling_is_disabled_on_the_trainer() -> None:
    import lightning as L

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    lightning_internals.disable_lightning_sigterm_handling(trainer)
    assert trainer._signal_connector.register_signal_handlers() is None
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    assert "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop), "set on the instance, not added"


def test_fsdp1_zero2_hybrid_has_a_public_name() -> None:
    from torch.distributed.fsdp import ShardingStrategy

    assert (
        torch_internals.fsdp1_sharding_strategy("HYBRID_SHARD_ZERO2") is ShardingStrategy._HYBRID_SHARD_ZERO2
    )
    assert torch_internals.fsdp1_sharding_strategy("FULL_SHARD") is ShardingStrategy.FULL_SHARD


def test_checkpoint_wrapper_keeps_the_module_and_its_names() -> None:
    from torch import nn

    wrapped = torch_internals.checkpoint_wrapper(nn.Linear(2, 2), preserve_rng_state=False)
    assert isinstance(wrapped, torch_internals.CheckpointWrapper)
    # The wrapper reports the wrapped module's own parameter names, so checkpoints do not change.
    assert [n for n, _ in wrapped.named_parameters()] == ["weight", "bias"]


def test_transformers_init_keeps_marked_tensors_and_reinitialises_cleared_modules() -> None:
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
    )
    head = model.lm_head
    with torch.no_grad():
        head.weight.fill_(7.0)
    transformers_internals.mark_initialized(head.weight)
    transformers_internals.initialize_module(model, head, custom_code=False)
    assert torch.all(head.weight == 7.0), "a marked tensor is left alone"
    transformers_internals.clear_initialized(head)
    transformers_internals.initialize_module(model, head, custom_code=False)
    assert not torch.all(head.weight == 7.0) and isinstance(head, nn.Linear)
    unexpected, missing = transformers_internals.ignored_checkpoint_keys(model)
    assert isinstance(unexpected, list) and isinstance(missing, list)
    assert transformers_internals.checkpoint_key_renamer(model)("model.norm.weight") == (
        "model.norm.weight",
        None,
    )


def test_torch_dispatch_mode_and_non_persistent_buffers() -> None:
    import torch
    from torch import nn

    seen = []

    class Spy(torch_internals.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.empty(2).normal_()
    assert torch.ops.aten.normal_.default in seen
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("recomputed", torch.zeros(1), persistent=False)
    assert torch_internals.non_persistent_buffer_names(module) == {"recomputed"}


def test_is_compiled_in_place_sees_module_compile() -> None:
    from torch import nn

    block = nn.Linear(2, 2)
    assert not torch_internals.is_compiled_in_place(block)
    block.compile()  # replaces the forward lazily: nothing is compiled until the first call
    assert torch_internals.is_compiled_in_place(block)


def test_fake_tensors_and_the_memory_trackers_a_rehearsal_uses() -> None:
    import torch

    fsdp2_tracker, tracker = torch_internals.memory_trackers()
    assert fsdp2_tracker.__name__ == "FSDPMemTracker" and tracker.__name__ == "MemTracker"
    with torch_internals.FakeTensorMode():
        x = torch.randint(0, 5, (4,))
        assert x.untyped_storage().nbytes() == 32  # shapes and sizes, no memory
        with pytest.raises(torch_internals.NOT_FAKEABLE):
            x.max().item()  # a value a fake tensor does not have


def test_wait_if_async_collective_returns_a_plain_tensor_gradients_flow_through() -> None:
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    class InFlight(torch.autograd.Function):
        """Returns its input as an AsyncCollectiveTensor, as a tensor-parallel style's output hook does."""

        @staticmethod
        def forward(ctx, t):  # type: ignore[no-untyped-def]
            return AsyncCollectiveTensor(t.detach().clone())

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return grad

    x = torch.arange(3.0, requires_grad=True)
    waited = torch_internals.wait_if_async_collective(InFlight.apply(x * 2))
    assert type(waited) is torch.Tensor and torch.equal(waited, torch.tensor([0.0, 2.0, 4.0]))
    (waited * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0, 6.0]))
    plain = torch.ones(2)
    assert torch_internals.wait_if_async_collective(plain) is plain


def test_plain_tensors_opens_wrapper_subclasses() -> None:
    """torchao's float8 weight is a wrapper subclass without storage of its own: its bytes are
    those of the tensor it wraps."""
    import torch

    pytest.importorskip("torchao")
    from fsdp_cli.compat.torch_internals import storage_bytes
    from fsdp_cli.parallel.float8 import apply_float8

    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 8, bias=False))
    apply_float8(model, emulate=True)
    weight = model[0].weight
    assert torch.utils._python_dispatch.is_traceable_wrapper_subclass(weight)
    inner = torch_internals.plain_tensors(weight)
    # The wrapped tensor is the original parameter: a plain tensor with storage of its own.
    assert len(inner) == 1 and not torch.utils._python_dispatch.is_traceable_wrapper_subclass(inner[0])
    assert inner[0].untyped_storage().nbytes() == 32 * 32 * 4 and torch.equal(inner[0], weight)
    assert storage_bytes([weight]) == 32 * 32 * 4
    plain = torch.zeros(2)
    assert torch_internals.plain_tensors(plain) == [plain]


def test_install_hints_work_where_only_the_package_index_is_reached() -> None:
    """fsdp-cli is not on the package index: no hint may say ``pip install "fsdp-cli[...]"``. A
    runtime hint names the extra's own requirements, exactly as pyproject.toml lists them (any
    index serves those), and the checkout's ``pip install ".[extra]"``."""
    from fsdp_cli.extras import install_hint

    repo = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        if extra in ("test", "dev"):
            continue
        quoted = " ".join(f'"{Requirement(r)}"' for r in requirements)
        assert (
            install_hint(extra)
            == f'pip install {quoted} (or pip install ".[{extra}]" in a checkout of fsdp_cli)'
        )
    shipped = [*repo.glob("*.md"), *repo.glob("docs/*.md"), *repo.glob("configs/**/*.yaml")]
    shipped += [p for p in repo.glob("fsdp_cli/**/*.py") if p.name != "extras.py"]
    offenders = [str(p.relative_to(repo)) for p in shipped if "fsdp-cli[" in p.read_text()]
    assert offenders == []


def test_config_files_read_by_libyaml_are_what_pyyaml_reads() -> None:
    """Every shipped config file and recipe: the same config through libyaml's parser as through
    PyYAML's own (OmegaConf's loader either way); a broken file still gets PyYAML's wording."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf import _utils as omegaconf_utils

    from fsdp_cli.compat.omegaconf_internals import yaml_read_by_libyaml

    if not yaml.__with_libyaml__:
        pytest.skip("this PyYAML has no libyaml")
    yaml_read_by_libyaml()
    fast = omegaconf_utils.get_yaml_loader()
    python = fast.__mro__[2]  # OmegaConf's own loader class, past libyaml's parser
    assert fast.__name__ == "LibyamlLoader" and python.__name__ == "OmegaConfLoader"
    root = Path(__file__).resolve().parents[1]
    files = sorted([*(root / "configs").rglob("*.yaml"), *(root / "recipes").rglob("*.yaml")])
    assert len(files) > 40
    for file in files:
        text = file.read_text()
        assert yaml.load(text, Loader=fast) == yaml.load(text, Loader=python), file
    assert OmegaConf.load(files[0]) == OmegaConf.create(yaml.load(files[0].read_text(), Loader=python))
    with pytest.raises(yaml.YAMLError, match=r"expected ',' or '\]', but got ':'"):
        yaml.load("a: [1, 2\nb: 3\n", Loader=fast)
