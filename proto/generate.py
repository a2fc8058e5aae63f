"""Regenerate the Python stubs of proto/pdspec/v1/*.proto (committed; a test checks they are current).

    python -m proto.generate [--out DIR]
"""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto" / "pdspec" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    """Runs protoc in a subprocess: loading it into a process that also loads NIXL crashes it."""
    out.mkdir(parents=True, exist_ok=True)
    include = Path(importlib.util.find_spec("grpc_tools").submodule_search_locations[0]) / "_proto"
    args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}"]
    result = subprocess.run(args + [str(p.relative_to(ROOT)) for p in PROTOS], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed:\n{result.stderr}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    generate(ap.parse_args().out)
