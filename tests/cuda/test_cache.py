"""kvflow's one build cache: where it lives, and builds that run once and never leave a
partial file behind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvflow.cuda.cache import build_file, cache_dir


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$KVFLOW_CACHE_DIR wins over $XDG_CACHE_HOME/kvflow, which wins over ~/.cache/kvflow."""
    monkeypatch.delenv("KVFLOW_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("kernels") == tmp_path / "home" / ".cache" / "kvflow" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("native") == tmp_path / "xdg" / "kvflow" / "native"
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "kv"))
    assert cache_dir("native") == tmp_path / "kv" / "native"
    assert cache_dir("kernels") == tmp_path / "kv" / "kernels"


def test_concurrent_first_uses_build_once(tmp_path: Path) -> None:
    """Threads asking for the same missing file build it once; all get the same path."""
    target = tmp_path / "deep" / "thing.so"
    builds: list[Path] = []
    gate = threading.Barrier(4)

    def build(partial: Path) -> None:
        builds.append(partial)
        partial.write_text("built")

    got: list[Path] = []

    def use() -> None:
        gate.wait()
        got.append(build_file(target, build))

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [target] * 4 and len(builds) == 1
    assert target.read_text() == "built"
    assert build_file(target, build) == target and len(builds) == 1


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    """A build that raises leaves neither the target nor its temporary file."""
    target = tmp_path / "thing.so"

    def build(partial: Path) -> None:
        partial.write_text("half")
        raise RuntimeError("compiler said no")

    with pytest.raises(RuntimeError, match="compiler said no"):
        build_file(target, build)
    assert [p.name for p in tmp_path.iterdir()] == ["thing.so.lock"]
