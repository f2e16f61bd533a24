"""User frames: what counts as the user's code, wherever it is installed (docs/internals.md, "Layers": Sites)."""

from __future__ import annotations

import json
import os
import sys
import sysconfig

import pytest

from pytest_ltconform import sites


def _fresh(monkeypatch):
    monkeypatch.setattr(sites, "_ROOTS", None)
    monkeypatch.setattr(sites, "_USER_CACHE", {})


def test_libraries_the_stdlib_and_the_plugin_are_not_user_code(monkeypatch):
    _fresh(monkeypatch)
    assert not sites.is_user_file(json.__file__)
    assert not sites.is_user_file(pytest.__file__)
    assert not sites.is_user_file(sites.__file__)
    assert not sites.is_user_file("<string>")
    torch = pytest.importorskip("torch")
    assert not sites.is_user_file(torch.__file__)
    import functorch
    import torchgen  # both ship in the torch wheel

    assert not sites.is_user_file(functorch.__file__) and not sites.is_user_file(torchgen.__file__)


def test_a_package_installed_in_site_packages_is_user_code(monkeypatch, tmp_path):
    _fresh(monkeypatch)
    # A system or conda Python keeps site-packages inside its stdlib folder.
    stdlib = tmp_path / "lib" / "python3.x"
    installed = stdlib / "site-packages" / "forecastlib" / "models.py"
    # A name that starts with "torch" is not torch: torch_geometric's GraphGym logger is the user's.
    named_like_torch = [stdlib / "site-packages" / pkg / "logger.py"
                        for pkg in ("torch_geometric", "torch_ema", "torchdyn", "torchvision", "lightning_extras")]
    for path in (installed, *named_like_torch):
        path.parent.mkdir(parents=True)
        path.write_text("x = 1\n")
    real_paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**real_paths, "stdlib": str(stdlib),
                                                         "platstdlib": str(stdlib)})
    assert sites.is_user_file(str(installed))
    assert [p.parent.name for p in named_like_torch if not sites.is_user_file(str(p))] == []
    assert not sites.is_user_file(str(stdlib / "json.py"))
    assert sites.is_user_file(os.path.abspath(__file__))


def test_fmt_site_and_plural():
    assert sites.fmt_site(None) == "<no user frame>"
    assert sites.fmt_site({"file": "/x/y.py", "line": 3, "func": "f"}) == "/x/y.py:3 (f)"
    assert (sites.plural(1, "call"), sites.plural(2, "call")) == ("1 call", "2 calls")


def log():  # a library's base class redefining self.log and forwarding the call
    return sites.user_site(depth=1, wrappers=("log",))


def validation_step():
    return log()  # the line the evidence must name


def test_an_override_of_the_traced_api_names_its_caller():
    site, direct = validation_step()
    assert site["func"] == "validation_step" and direct
    assert site["line"] == validation_step.__code__.co_firstlineno + 1


MODEL_FILE = '''
import functools


class Base:
    def __init__(self):
        self.teacher = object()


class Model(Base):
    @functools.lru_cache
    def val_dataloader(self):
        return []


class ShuffledShard:
    pass
'''


def test_evidence_sites_come_from_the_classes_validation_found_not_from_an_import(tmp_path, monkeypatch):
    # The judging process never imports the user's module (it is validated in another): the
    # sites are read from (class name, path) pairs and the source file alone.
    import importlib.util

    from pytest_ltconform.contracts.base import attribute_site, class_site, method_site
    from pytest_ltconform.target.validation import user_classes_of

    path = tmp_path / "mymodel.py"
    path.write_text(MODEL_FILE)
    spec = importlib.util.spec_from_file_location("mymodel_for_sites", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mymodel_for_sites", module)  # where inspect finds a class's file
    spec.loader.exec_module(module)
    classes = user_classes_of(module.Model)
    assert classes == (("Model", str(path)), ("Base", str(path)))
    assert attribute_site(classes, "teacher") == {"file": str(path), "line": 7, "func": "Base.__init__"}
    assert method_site(classes, "val_dataloader") == {"file": str(path), "line": 11, "func": "Model.val_dataloader"}
    assert class_site(classes, "ShuffledShard") == {"file": str(path), "line": 16, "func": "ShuffledShard"}
    assert attribute_site((), "teacher") is None and method_site(classes, "train_dataloader") is None


def test_a_rank_writes_the_users_paths_relative_to_where_pytest_runs(tmp_path, monkeypatch):
    # A rank's working directory is its job folder: relative to it, every user path began with "..".
    site = {"file": str(tmp_path / "pkg" / "model.py"), "line": 9, "func": "__init__"}
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv(sites.USER_CWD_ENV, str(tmp_path))
    assert sites.fmt_site(site) == f"{os.path.join('pkg', 'model.py')}:9 (__init__)"
    monkeypatch.delenv(sites.USER_CWD_ENV)
    assert sites.fmt_site(site) == f"{os.path.join(tmp_path.name, 'pkg', 'model.py')}:9 (__init__)"


def test_an_inherited_training_step_is_named_after_the_base_class_that_defines_it(tmp_path, monkeypatch):
    """A subclass whose training_step is its base class's: the site is the base's file, line and
    name (``Base.training_step``), said to be called for the subclass."""
    from pytest_ltconform.harness import _step_site

    (tmp_path / "base_model.py").write_text(
        "class Base:\n    def training_step(self, batch, batch_idx):\n        loss = batch * 2\n        return loss\n")
    (tmp_path / "sub_model.py").write_text("from base_model import Base\n\n\nclass Sub(Base):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    sub = importlib.import_module("sub_model").Sub
    site = _step_site(sub)
    assert site == {"file": str(tmp_path / "base_model.py"), "line": 4, "func": "Base.training_step", "for": "Sub"}
    assert sites.fmt_site(site).endswith("base_model.py:4 (Base.training_step, called for Sub)")
    assert _step_site(sub.__mro__[1]) == {"file": str(tmp_path / "base_model.py"), "line": 4,
                                          "func": "Base.training_step"}
