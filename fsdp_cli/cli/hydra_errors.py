"""Hydra's composition errors as one actionable line and exit status 2.

Hydra reports an unknown group option or a misspelled key over several lines (plus a hint about
HYDRA_FULL_ERROR) and exits 1. Every config mistake of ``fsdp-train`` exits 2 with one line
instead. Hydra has no hook for this, so its error reporter is wrapped (through
:mod:`fsdp_cli.compat.hydra_internals`); anything that is not a config error still goes
to Hydra's own reporter, traceback and all. ``HYDRA_FULL_ERROR=1`` shows Hydra's full output.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from fsdp_cli.compat.hydra_internals import wrap_run_and_report
from fsdp_cli.config.convert import GROUP_SCHEMAS
from fsdp_cli.config.unknown_keys import unknown_key_hint
from fsdp_cli.rundir.status import EXIT_CONFIG_ERROR

CONFIG_ERRORS = (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    OmegaConfBaseException,
    yaml.YAMLError,  # a config file of the user's (--config-dir) that is not YAML
)
HINT = "fsdp-train --help lists the groups and options; --cfg job prints the composed config"


def one_line(err: BaseException) -> str:
    """Condense a Hydra/OmegaConf composition error into ``key=value: problem; allowed: ...; hint: ...``."""
    if isinstance(err, yaml.YAMLError):
        return yaml_error_line(err)
    text = str(err)
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if missing:
        group, option = missing.group(1), missing.group(2)
        options = re.findall(r"^\t(\S+)$", text, flags=re.MULTILINE)
        allowed = ", ".join(o for o in options if not o.startswith("schema"))
        return f"{group}={option}: unknown option of group '{group}'; allowed: {allowed}; hint: {HINT}"
    override = re.search(r"Could not override '([^']+)'", text)
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    detail = _first_line(str(cause)) if cause is not None else _lines(text)[-1] if _lines(text) else ""
    if override:
        key = override.group(1)
        schema = getattr(cause, "object_type", None)
        if cause is not None and isinstance(schema, type) and dataclasses.is_dataclass(schema):
            # A typed section: + cannot add to it. (full_key: the override's part that failed.)
            full_key = str(getattr(cause, "full_key", None) or key)
            hint = unknown_key_hint(schema, str(cause.key), full_key, GROUP_SCHEMAS)
        else:
            hint = f"to add a key use +{key}=VALUE; {HINT}"
        return f"{key}: not a key of this config ({detail}); hint: {hint}"
    merging = re.search(r"Error merging override (\S+)", text)
    if merging:
        return f"{merging.group(1)}: {detail}; hint: {HINT}"
    return f"{'; '.join(_lines(text)[:2])}{'; ' + detail if cause is not None else ''}; hint: {HINT}"


def yaml_error_line(err: yaml.YAMLError) -> str:
    """``FILE:LINE:COLUMN: not valid YAML: <the parser's problem> (<what it was reading>, from line N)``:
    where the parser stopped, in place of the parser's traceback."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or _first_line(str(err))
    if mark is None:
        return f"a config file is not valid YAML: {problem}; hint: {HINT}"
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    opened = f" ({context}, from line {start.line + 1})" if context and start is not None else ""
    return f"{where}: not valid YAML: {problem}{opened}; hint: fix that file (a YAML linter shows more)"


def report_hydra_errors_in_one_line(prog: str) -> None:
    wrap_run_and_report(lambda original: _one_line_reporter(prog, original))


def _one_line_reporter(
    prog: str, original: Callable[[Callable[[], Any]], Any]
) -> Callable[[Callable[[], Any]], Any]:
    def run_and_report(func: Callable[[], Any]) -> Any:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            return original(func)
        try:
            return func()
        except CONFIG_ERRORS as err:
            print(f"{prog}: error: {one_line(err)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_CONFIG_ERROR)
        except OSError as err:
            if _output_folder_error(err):  # before any job: Hydra creating or writing the run dir
                print(f"{prog}: error: {output_folder_line(err)}", file=sys.stderr, flush=True)
                sys.exit(EXIT_CONFIG_ERROR)
            return original(func_raising(err))
        except ValueError as err:
            if _raised_by_hydra(err):  # e.g. "Config group override must be a string"
                print(f"{prog}: error: {err}; hint: {HINT}", file=sys.stderr, flush=True)
                sys.exit(EXIT_CONFIG_ERROR)
            return original(func_raising(err))
        except Exception:  # noqa: BLE001 - handed on to Hydra's own reporter
            return original(func_raising(sys.exc_info()[1]))

    return run_and_report


def _output_folder_error(err: OSError) -> bool:
    """Raised while Hydra's ``run_job`` creates the job's output folder or writes ``.hydra/`` in it."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "hydra.core.utils" and tb.tb_frame.f_code.co_name in (
            "run_job",
            "_save_config",
        ):
            return True
        tb = tb.tb_next
    return False


def output_folder_line(err: OSError) -> str:
    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in sys.argv[1:]) else "hydra.run.dir"
    return (
        f"{key}={err.filename}: nothing can be written there: {err.strerror or err}; "
        f"hint: {key}=DIR (a folder this user can create and write)"
    )


def _raised_by_hydra(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("hydra.")


def quote_numeric_group_options(argv: list[str], groups: tuple[str, ...] = ("precision",)) -> list[str]:
    """``precision=16`` -> ``precision='16'``: Hydra parses a bare 16 as an int, which cannot name a
    group option; Lightning's legacy names (16, 32, 64) should still work as typed."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"{key}='{value}'" if sep and key in groups and value.isdigit() else arg)
    return out


def func_raising(err: BaseException | None) -> Callable[[], Any]:
    def again() -> Any:
        assert err is not None
        raise err

    return again


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _first_line(text: str) -> str:
    lines = _lines(text)
    return lines[0] if lines else text
