"""A file written aside: it replaces the file whole when the writing ends, and a failed writing leaves the old file
and nothing beside it."""

import pytest

from metasd.files import written_aside


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("old")
    with pytest.raises(OSError), written_aside(path) as aside:
        aside.write_text("half")
        raise OSError("disk full")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["table.json"]
    with written_aside(path) as aside:
        aside.write_text("new")
        assert path.read_text() == "old"  # a reader meanwhile sees the old file
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["table.json"]
