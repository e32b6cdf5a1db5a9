"""OmegaConf internals: the YAML loader it parses every config file with (``get_yaml_loader``,
looked up by ``OmegaConf.load`` and ``OmegaConf.create`` at each call, and imported by name into
``omegaconf.basecontainer``)."""

from __future__ import annotations

from typing import IO, Any

import yaml
from omegaconf import _utils as _omegaconf_utils
from omegaconf import basecontainer as _basecontainer

from fsdp_cli.compat import require

for _owner in (_omegaconf_utils, _basecontainer):
    require(_owner, "get_yaml_loader", "omegaconf")


def yaml_read_by_libyaml() -> None:
    """Config files read by libyaml's parser (PyYAML's C extension, in its wheels) under
    OmegaConf's own loader: the same constructors, resolvers and duplicate-key check, the scanning
    and parsing in C (about 12 ms of every config-only command). A file libyaml refuses is read
    again by PyYAML's own parser, whose error names the problem better ("expected ',' or ']', but
    got ':'" where libyaml says "did not find expected ',' or ']'"): what the user sees, and what
    the project accepts, stay PyYAML's. OmegaConf builds its loader class anew at every call;
    this builds it once."""
    if not getattr(yaml, "__with_libyaml__", False) or getattr(
        _omegaconf_utils.get_yaml_loader, "libyaml", False
    ):
        return
    from yaml.constructor import SafeConstructor
    from yaml.cyaml import CParser
    from yaml.resolver import Resolver

    python_loader = _omegaconf_utils.get_yaml_loader()

    class LibyamlLoader(CParser, python_loader):  # type: ignore[misc, valid-type]
        def __init__(self, stream: str | bytes | IO[Any]) -> None:
            self._stream = stream
            self._start = stream.tell() if hasattr(stream, "seek") else None
            CParser.__init__(self, stream)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

        def get_single_data(self) -> Any:
            try:
                return super().get_single_data()
            except yaml.YAMLError:
                if self._start is not None:
                    self._stream.seek(self._start)  # type: ignore[union-attr]
                loader = python_loader(self._stream)
                try:
                    return loader.get_single_data()
                finally:
                    loader.dispose()

    def get_yaml_loader() -> Any:
        return LibyamlLoader

    get_yaml_loader.libyaml = True  # type: ignore[attr-defined]
    _omegaconf_utils.get_yaml_loader = get_yaml_loader
    _basecontainer.get_yaml_loader = get_yaml_loader
