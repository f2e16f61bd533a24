"""The GitHub Actions workflow docs/ci.md gives users to copy: read from the page, its matrix and
selection checked against the plugin, and each job's test command run here as written, against a
package named as the sample names it (``mypackage``: Lightning's BoringModel and BoringDataModule).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from pytest_ltconform import releases

MYPACKAGE = {
    "mypackage/__init__.py": "from lightning.pytorch.demos.boring_classes import BoringDataModule as DataModule\n"
                             "from lightning.pytorch.demos.boring_classes import BoringModel as Model\n",
    "mypackage/config.py": "def trainer_kwargs():\n    return {'max_epochs': 2}\n",
}


def _workflow() -> dict:
    page = (REPO / "docs" / "ci.md").read_text()
    block = page.split("## GitHub Actions", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def _step(job: dict, name: str) -> dict:
    return next(s for s in job["steps"] if s.get("name", "").startswith(name))


def _expand(text: str, matrix: dict) -> str:
    return re.sub(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", lambda m: str(matrix[m.group(1)]), text)


def test_the_workflow_has_a_matrix_of_lightning_releases_and_a_gpu_job_selected_by_marker():
    jobs = _workflow()["jobs"]
    versions = jobs["cpu"]["strategy"]["matrix"]["lightning"]
    assert releases.text(releases.FLOOR) in versions and releases.RULES_RELEASE in versions, versions
    assert all(not releases.before(v, releases.FLOOR) for v in versions), versions
    install = _step(jobs["cpu"], "Install")["run"]
    assert '"lightning==${{ matrix.lightning }}"' in install and "pytest-ltconform" in install
    cpu = _step(jobs["cpu"], "Conformance")["run"]
    assert "-m ltconform_cpu" in cpu and "${{ matrix.lightning }}" in cpu  # one report per release
    gpu = _step(jobs["gpu"], "Conformance")["run"]
    assert "-m ltconform_gpu --ltconform-require gpu" in gpu and "gpu" in jobs["gpu"]["runs-on"]
    matrix = {"lightning": versions[0]}
    for job in jobs.values():  # the artifact uploaded is the report the job wrote
        report = re.search(r"--ltconform-report (\S+)", _expand(_step(job, "Conformance")["run"], matrix)).group(1)
        upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
        assert _expand(upload["with"]["path"], matrix) == report and upload["if"] == "always()"


@pytest.mark.parametrize("job", ["cpu", "gpu"])
def test_each_jobs_command_runs_here_as_written(tmp_path, job):
    """The CPU job passes on this machine's Lightning; the GPU job, on a machine without CUDA
    devices, fails (``--ltconform-require gpu``) instead of passing with skips, and still writes
    its report for the artifact step."""
    import lightning

    for path, text in MYPACKAGE.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    step = _step(_workflow()["jobs"][job], "Conformance")["run"]
    argv = shlex.split(_expand(step, {"lightning": lightning.__version__}))
    assert argv[:3] == ["python", "-m", "pytest"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    out = proc.stdout
    report = tmp_path / re.search(r"--ltconform-report (\S+)", " ".join(argv)).group(1)
    assert report.exists(), out[-3000:]
    results = json.loads(report.read_text())["results"]
    assert "INTERNALERROR" not in out
    if job == "cpu":
        assert proc.returncode == 0, out[-3000:]
        assert results and {r["outcome"] for r in results} <= {"passed", "advisory"}, out[-3000:]
        assert {"ddp", "fsdp"} <= {r["strategy"] for r in results}
    else:
        assert proc.returncode == 1, out[-3000:]
        assert "--ltconform-require gpu: the gpu tier cannot run here" in out, out[-3000:]
        assert results and all(r["strategy"].endswith("-gpu") for r in results), results
