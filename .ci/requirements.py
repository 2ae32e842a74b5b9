"""Print the requirements of `lightning-zeropp[dev]` from pyproject.toml, one a line, with the
project's own extras expanded and torch left out (CI installs torch first, at the release it tests):
`pip install -r <(python .ci/requirements.py)` gives a venv that runs the tests from the checkout.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]


def expand(requirements: list[str]) -> list[str]:
    out: list[str] = []
    for req in requirements:
        own = re.fullmatch(r"lightning-zeropp\[(.+)\]", req)
        for name in own.group(1).split(",") if own else ():
            out += expand(extras[name.strip()])
        if not own:
            out.append(req)
    return out


for req in expand(project["dependencies"] + extras["dev"]):
    if not re.match(r"torch\b", req):  # not torchmetrics
        print(req)
