"""maverick.files: a write either lands whole or leaves the old file as it was."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from eval.compare_runs import main as compare_runs
from maverick.cli import run_cli
from maverick.files import atomic_dir, atomic_path, atomic_write, remove_leftovers


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


def test_files_and_folders_get_the_usual_permissions(tmp_path):
    plain, atomic = tmp_path / "plain", tmp_path / "atomic"
    plain.write_bytes(b"x")
    atomic_write(atomic, b"x")
    assert os.stat(atomic).st_mode == os.stat(plain).st_mode  # not mkstemp's 0600
    plain_dir, draft = tmp_path / "plain-dir", tmp_path / "draft"
    plain_dir.mkdir()
    with atomic_dir(draft) as d:
        (d / "config.json").write_text("{}")
    assert os.stat(draft).st_mode == os.stat(plain_dir).st_mode  # not mkdtemp's 0700
    # a writer that makes its own files private (safetensors 0.8's save_file: 0600) does not make ours so
    from safetensors.torch import save_file

    with atomic_path(tmp_path / "shard.safetensors") as t:
        save_file({"x": torch.ones(2)}, str(t))
    with atomic_dir(tmp_path / "draft2") as d:
        save_file({"x": torch.ones(2)}, str(d / "model.safetensors"))
    for f in (tmp_path / "shard.safetensors", tmp_path / "draft2" / "model.safetensors"):
        assert os.stat(f).st_mode == os.stat(plain).st_mode, oct(os.stat(f).st_mode)


def test_leftovers_of_killed_writes_are_found_and_removed(tmp_path):
    """What a write killed mid-way leaves (a file of atomic_path, a folder of atomic_dir) is removed; the
    finished files beside it, and anything below, stay."""
    keep = [tmp_path / "stage.json", tmp_path / "draft" / "model.safetensors", tmp_path / "sub" / "x.tmp-1"]
    for p in keep:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x")
    with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "train_state.pt") as tmp:
        tmp.write_bytes(b"half")
        killed = tmp.with_name(tmp.name + "x")
        os.link(tmp, killed)  # what a SIGKILL would leave: the finally below never runs then
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt), atomic_dir(tmp_path / "draft") as d:
        (d / "model.safetensors").write_bytes(b"half")
        shutil.copytree(d, tmp_path / (d.name + "x"))
        raise KeyboardInterrupt
    left = sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name)
    assert len(left) == 2 and left[0].startswith("draft.tmp-") and left[1].startswith("train_state.pt.tmp-")
    assert sorted(p.name for p in remove_leftovers(tmp_path)) == left
    assert all(p.read_bytes() == b"x" for p in keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "stage.json", "sub"]


def test_a_directory_is_on_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """atomic_dir flushes every file and folder before the rename (before: nothing, so a power loss could
    leave a renamed checkpoint of empty files), and the old folder is moved aside, not deleted first."""
    import maverick.files as files

    draft = tmp_path / "draft"
    with atomic_dir(draft) as d:
        (d / "config.json").write_text("old")
    synced = []
    real = os.fsync
    monkeypatch.setattr(
        files.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1]
    )
    with atomic_dir(draft) as d:
        (d / "config.json").write_text("new")
        (d / "model.safetensors").write_bytes(b"w")
    names = [os.path.basename(p) for p in synced]
    assert {"config.json", "model.safetensors", tmp_path.name} <= set(names)  # the files, the rename
    assert any(n.startswith("draft.tmp-") for n in names) and (draft / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_leftovers_are_only_this_modules_and_a_folder_moved_aside_comes_back(tmp_path):
    """A user's `notes.tmp-2024.txt` is not a leftover; a folder atomic_dir moved aside whose new one never
    took its place (killed between the two renames) is put back, not deleted."""
    (tmp_path / "notes.tmp-2024.txt").write_text("mine")
    aside = tmp_path / "draft.tmp-123-0a1b2c3d-old"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    (tmp_path / "draft.tmp-123-0a1b2c3d").mkdir()  # the new one, never renamed in: not trusted
    gone = remove_leftovers(tmp_path)
    assert [p.name for p in gone] == ["draft.tmp-123-0a1b2c3d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "notes.tmp-2024.txt"]
    assert (tmp_path / "draft" / "config.json").read_text() == "{}"


UNWRITABLE = Path("/sys")  # sysfs refuses new files, root or not


@pytest.mark.skipif(not UNWRITABLE.is_dir(), reason="needs Linux sysfs")
def test_an_unwritable_place_is_named_by_the_path_asked_for(tmp_path, capsys):
    for write in (lambda p: atomic_write(p, "{}"), lambda p: atomic_dir(p).__enter__()):
        with pytest.raises(PermissionError) as exc:
            write(UNWRITABLE / "maverick-test.json")
        assert exc.value.filename == str(UNWRITABLE / "maverick-test.json")
    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 1, "loss": 1.0, "acc_i": [0.5]}\n')
    with pytest.raises(SystemExit) as exc:
        run_cli(compare_runs, [str(log), "--out", str(UNWRITABLE / "curve.png")])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: {UNWRITABLE / 'curve.png'}: Permission denied\n"
