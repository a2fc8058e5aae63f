"""Where pdspec keeps files it derives once and reuses: converted models, compiled kernels."""

import os
from pathlib import Path


def pdspec_home() -> Path:
    """`$PDSPEC_HOME`, else `~/.cache/pdspec`; created on first use."""
    path = Path(os.environ.get("PDSPEC_HOME") or Path.home() / ".cache" / "pdspec")
    path.mkdir(parents=True, exist_ok=True)
    return path
