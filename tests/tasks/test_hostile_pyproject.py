"""A repository's pyproject.toml is untrusted input wherever synthesis reads it: the directory's project
(`sources.directory_project`), its requirements (`environment.project_requirements`) and an sdist's build
requirements (`downloads.sdist_metadata`). TOML nested past the recursion limit is a bad file like any other, never
a RecursionError traceback."""

from __future__ import annotations

import io
import tarfile

import pytest
from packaging.version import Version

from shipyard.tasks.downloads import sdist_metadata
from shipyard.tasks.environment import EnvSetupError, project_requirements
from shipyard.tasks.sources import directory_project
from shipyard.tasks.taskset import Project

DEEP = "a = " + "[" * 100_000 + "]" * 100_000 + "\n"


def test_the_project_of_a_directory_with_a_too_deep_pyproject_comes_from_its_other_metadata(tmp_path):
    repo = tmp_path / "deep-repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text(DEEP)
    (repo / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: Deep\nVersion: 1.2\n")
    assert directory_project(repo) == Project("deep", "1.2")


def test_a_too_deep_pyproject_is_a_setup_error(tmp_path):
    (tmp_path / "pyproject.toml").write_text(DEEP)
    with pytest.raises(EnvSetupError, match="not valid TOML"):
        project_requirements(tmp_path)


@pytest.mark.parametrize("text", ["project = 5\n", "[project]\noptional-dependencies = [1]\n",
                                  "[project]\ndependencies = [1]\n", "[project]\nname = 3\n",
                                  'build-system = "x"\n', "[build-system]\nrequires = 7\n"])
def test_a_pyproject_whose_tables_are_not_tables_is_a_setup_error(tmp_path, text):
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(EnvSetupError, match="PEP 621"):
        project_requirements(tmp_path)


def test_a_plain_pyproject_still_reads(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "p"\ndependencies = ["attrs"]\n'
                                            '[project.optional-dependencies]\ntest = ["pytest"]\n')
    assert project_requirements(tmp_path) == ("p", ["attrs", "pytest"], ["setuptools>=40.8"])


def test_an_sdist_with_a_too_deep_pyproject_gets_the_default_build_requirements():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in (("PKG-INFO", "Metadata-Version: 2.1\nName: deep\nVersion: 1.0\n"),
                           ("pyproject.toml", DEEP)):
            data = text.encode()
            member = tarfile.TarInfo(f"deep-1.0/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    sdist = sdist_metadata("deep", Version("1.0"), "deep-1.0.tar.gz", buffer.getvalue())
    assert sdist.build_requires == ["setuptools>=40.8.0"]
