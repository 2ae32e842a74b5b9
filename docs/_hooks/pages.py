"""MkDocs hooks: pages whose text comes from the repository rather than from `docs/`.

- `docs/index.md` is README.md (one text for both; its `docs/...` links made site-relative).
- `docs/settings.md`'s table is rendered from `ZeroPPConfig`'s fields at build time: their order,
  and nothing else (a field has a row or the build fails), with their words from
  `core/settings/reference.py`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = "<!-- settings-table -->"
README = "<!-- readme -->"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if README in markdown:
        readme = (ROOT / "README.md").read_text()
        markdown = markdown.replace(README, readme.replace("](docs/", "]("))
    if SETTINGS in markdown:
        sys.path.insert(0, str(ROOT))
        from lightning_zeropp.core.settings.config import ZeroPPConfig
        from lightning_zeropp.core.settings.reference import settings_table

        names = [f.name for f in dataclasses.fields(ZeroPPConfig)]
        markdown = markdown.replace(SETTINGS, settings_table(names))
    return markdown
