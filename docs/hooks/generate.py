"""MkDocs hook (mkdocs.yml `hooks:`): adds the generated Reference pages and pictures to the site.

They exist only in the built site, never in docs/, so they cannot be edited by hand and fall behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_pictures  # noqa: E402
import docs_reference  # noqa: E402
from mkdocs.structure.files import File  # noqa: E402


def on_files(files, config):
    for path, write in docs_reference.PAGES.items():
        files.append(File.generated(config, path, content=write()))
    for path, draw in docs_pictures.PICTURES.items():
        files.append(File.generated(config, path, content=draw()))
    return files
