"""atomic_directory: a directory appears whole or not at all, and nothing is replaced without overwrite."""

import pytest

from modeling_diff.atomic import atomic_directory


def test_written_whole_and_staging_removed_on_failure(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(dst) as staging:
            (staging / "half.txt").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(dst) as staging:
        (staging / "whole.txt").write_text("x")
    assert [p.name for p in dst.iterdir()] == ["whole.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_existing_content_needs_overwrite(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    with atomic_directory(dst) as staging:  # an empty directory may be filled
        (staging / "a").write_text("1")
    with pytest.raises(ValueError, match="destination .* not empty; pass overwrite=True"):
        with atomic_directory(dst):
            pass
    with atomic_directory(dst, overwrite=True) as staging:
        (staging / "b").write_text("2")
    assert [p.name for p in dst.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_the_source_and_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "file").write_text("x")
    for dst in (tmp_path / "src", tmp_path / "src" / "inner", tmp_path):
        with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
            with atomic_directory(dst, overwrite=True, protect=(tmp_path / "src",)):
                pass
    with pytest.raises(ValueError, match="save_directory .* is not a directory"):
        with atomic_directory(tmp_path / "file", name="save_directory"):
            pass
