"""The base of every section of the run config: unknown keys are errors, and assignments are validated;
and the field types more than one section uses."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, StringConstraints


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def default(section: type[Section], field: str):
    """The config's default of `section.field`: what a signature or dataclass outside the config uses for
    its own default of that setting, so each default is written once (tests/unit/services/test_one_default.py)."""
    return section.model_fields[field].default


def _int_as_text(value: object) -> object:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# A CPU core setting: a single core given on the command line (`rollout.cpu_cores=0`) parses as a YAML
# int, taken as its text. CoreList: '1', '0-3' or '1-3,6', or 'auto' (not pinned).
CoreText = Annotated[str, BeforeValidator(_int_as_text)]
_CORES = r"\d+(-\d+)?(,\d+(-\d+)?)*"
CoreList = Annotated[CoreText, StringConstraints(pattern=rf"^(auto|{_CORES})$")]
# The rollout server's cores: a CoreList, or 'nobind' (vLLM's threads bound to no core).
RolloutCores = Annotated[CoreText, StringConstraints(pattern=rf"^(auto|nobind|{_CORES})$")]
