"""maverick.files: a write either lands whole or leaves the old file as it was."""

import os

import pytest
import torch

from maverick.files import atomic_path, atomic_write


def test_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "sub" / "a.json"
    assert atomic_write(path, '{"x": 1}\n') == path
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"step": 1}, path)
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_path(path) as tmp:
            torch.save({"step": 2}, tmp)
            raise RuntimeError("killed mid-save")
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_a_leftover_temporary_name_does_not_match_the_real_suffix(tmp_path):
    with atomic_path(tmp_path / "model.safetensors") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith("model.safetensors.tmp-")
        assert not tmp.match("*.safetensors")  # what loaders glob for (eagle3.draft, maverick.target)
        tmp.write_bytes(b"x")


def test_the_file_gets_the_usual_permissions(tmp_path):
    plain, atomic = tmp_path / "plain", tmp_path / "atomic"
    plain.write_bytes(b"x")
    atomic_write(atomic, b"x")
    assert os.stat(atomic).st_mode == os.stat(plain).st_mode  # not mkstemp's 0600
