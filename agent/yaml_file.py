"""Reading the YAML files a run names (tools.yaml, interaction.yaml): one place that turns a missing
file, bad YAML or the wrong top level into an error naming the file and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml_map(path: str | Path, what: str, error: type[Exception], expect: str = "a mapping") -> dict[str, Any]:
    """The mapping at the top of the YAML file `path` (a `what` config), or `error` saying why not
    (`expect`: what the top of the file should be, in the words of the error)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{what} config {str(path)!r} does not exist; fix the path") from None
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected {expect}, got {type(data).__name__}")
    return data
