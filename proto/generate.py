"""Regenerate the Python stubs of proto/pdspec/v1/*.proto (committed; a test checks they are current).

    python -m proto.generate [--out DIR]
"""

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto" / "pdspec" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main(args + [str(p.relative_to(ROOT)) for p in PROTOS]) != 0:
        raise RuntimeError("protoc failed")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    generate(ap.parse_args().out)
    sys.exit(0)
