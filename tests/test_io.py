"""pipeline.io: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from pipeline.io import (
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    package_versions,
    publish_directory,
    staged_directory,
)


def test_atomic_write_replaces_and_a_failed_writer_keeps_the_old_file(tmp_path):
    target = tmp_path / "sub" / "result.json"
    atomic_write_json(target, {"a": 1})
    assert target.read_text() == '{\n "a": 1\n}\n'

    def broken(tmp):
        tmp.write_text("half of a fi")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == '{\n "a": 1\n}\n'
    assert sorted(p.name for p in target.parent.iterdir()) == ["result.json"]  # no temporary left behind


def test_published_files_get_the_mode_open_would_give(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    path = atomic_write_text(tmp_path / "a.txt", "x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_concurrent_writers_of_one_file_never_collide(tmp_path):
    """Every rank may write the same resolved config at once: each uses its own temporary name."""
    target = tmp_path / "config.yaml"
    errors = []

    def write(index):
        try:
            for _ in range(50):
                atomic_write_text(target, f"writer {index}\n")
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and target.read_text() in {f"writer {i}\n" for i in range(4)}


def test_staged_directory_publishes_whole_or_not_at_all(tmp_path):
    target = tmp_path / "export"
    with staged_directory(target) as staging:
        (staging / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with pytest.raises(RuntimeError), staged_directory(target) as staging:
        (staging / "a").write_text("2")
        raise RuntimeError("gate failed")
    assert (target / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    with staged_directory(target) as staging:  # overwrite: the new folder replaces the old one
        (staging / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"]


def test_publish_without_overwrite_refuses_an_existing_folder(tmp_path):
    target = tmp_path / "cache"
    target.mkdir()
    (target / "done").write_text("theirs")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "done").write_text("ours")
    with pytest.raises(FileExistsError):
        publish_directory(staging, target, overwrite=False)
    assert (target / "done").read_text() == "theirs"


def test_package_versions_name_every_package_asked_for():
    versions = package_versions(["torch", "no-such-package-here"])
    assert versions["no-such-package-here"] == "not installed" and versions["torch"][0].isdigit()
    assert "python" in versions
