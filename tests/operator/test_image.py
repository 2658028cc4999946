"""What can be checked of the Dockerfile and the kind script without a container engine.

Neither can be built or run here (no container engine, no Kubernetes cluster); these tests hold
them to the rest of the repository: every Python package is copied into the image, the image's
user is the one the pods run as, and the entry point keeps the working directory off sys.path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest
import yaml
from crd_schema import ROOT, schema_errors

from kvring.operator.render_nodes import ENTRY, RUN_AS
from kvring.operator.spec import DEFAULT_IMAGE, ClusterSpec

DOCKERFILE = (ROOT / "Dockerfile").read_text()
KIND_UP = ROOT / "scripts" / "kind-up.sh"


def test_every_package_folder_is_copied_into_the_image():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (\w+) \1$", DOCKERFILE, re.M))
    assert set(package_dir.values()) <= copied


def test_image_runs_as_the_pods_user_with_the_pods_entry_point():
    final = DOCKERFILE[DOCKERFILE.rindex("\nFROM "):]
    assert f"--uid {RUN_AS}" in final
    assert f"USER {RUN_AS}:{RUN_AS}" in final
    assert f"ENTRYPOINT {str(ENTRY).replace(chr(39), chr(34))}" in final
    assert "pip install --no-cache-dir --no-index --find-links /wheels kvring" in final  # not editable


def test_kind_script_uses_the_default_image_and_is_valid_bash():
    text = KIND_UP.read_text()
    assert f"IMAGE=${{IMAGE:-{DEFAULT_IMAGE}}}" in text
    assert "jsonpath='{.status.connector}'" in text
    subprocess.run(["bash", "-n", str(KIND_UP)], check=True)


def test_kind_script_cachecluster_is_valid():
    text = KIND_UP.read_text()
    manifest = text[text.index("<<YAML\n") + len("<<YAML\n"):text.index("\nYAML\n")]
    cr = yaml.safe_load(manifest.replace("$IMAGE", DEFAULT_IMAGE))
    assert schema_errors(cr) == []
    assert ClusterSpec.from_dict(cr["spec"]).image_pull_policy == "Never"  # loaded by kind, never pulled


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck():
    subprocess.run(["shellcheck", str(KIND_UP), str(ROOT / "scripts" / "setup.sh")], check=True)
