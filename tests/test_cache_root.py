"""One cache root: relative cache folders live under it, whatever the current folder."""

from __future__ import annotations

from pathlib import Path

from pipeline.io import cache_root, resolve_cache_dir


def test_winnow_cache_wins_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("WINNOW_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("WINNOW_CACHE")
    assert cache_root() == tmp_path / "xdg" / "winnow"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec says to ignore it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "winnow"


def test_relative_folders_do_not_depend_on_the_current_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("WINNOW_CACHE", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    here = resolve_cache_dir("bootstrap")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resolve_cache_dir("bootstrap") == here == tmp_path / "root" / "bootstrap"
    assert resolve_cache_dir(tmp_path / "abs") == tmp_path / "abs"  # an absolute folder is used as given
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir("~/mine") == tmp_path / "home" / "mine"


def test_the_suite_never_writes_into_the_user_cache():
    assert not cache_root().is_relative_to(Path.home() / ".cache")
