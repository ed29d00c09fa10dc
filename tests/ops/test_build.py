"""Building the compiled operators: a failed build or KVFORGE_OPS=torch leaves the torch path, said once."""
import logging

import torch.utils.cpp_extension

from kvforge.ops import build


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(build, "PACKAGE_BUILDS", tmp_path / "package")  # nor beside the sources

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'kvforge_ops': g++: not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.delenv("KVFORGE_OPS", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvforge.ops"):
        assert build.load_compiled.__wrapped__() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "g++: not found" in warnings[0] and "torch reference path" in warnings[0]


def test_env_forces_the_torch_path(monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(AssertionError("built")))
    monkeypatch.setenv("KVFORGE_OPS", "torch")
    assert build.load_compiled.__wrapped__() is False


def test_cache_key_follows_the_sources(monkeypatch, tmp_path):
    for name in ("a.cpp", "b.h"):
        (tmp_path / name).write_text("int x;")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    before = build.build_key()
    (tmp_path / "b.h").write_text("int y;")
    assert build.build_key() != before
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert build.cache_dir() == tmp_path / "cache" / "kvforge" / "ops" / build.build_key()


def test_a_library_beside_the_sources_is_found_whatever_the_cache_home(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "PACKAGE_BUILDS", tmp_path / "package")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("KVFORGE_OPS", raising=False)
    library = build.package_dir() / f"kvforge_ops_{build.build_key()}.so"
    library.parent.mkdir(parents=True)
    library.touch()
    loaded = []
    monkeypatch.setattr(build.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: (_ for _ in ()).throw(AssertionError("built")))
    assert build.load_compiled.__wrapped__() is True
    assert loaded == [str(library)]
