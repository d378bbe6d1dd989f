"""A partition's index kept on disk for a warm restart, from Python: Engine.create_partition
(state_dir=...) restores a partition fed and dropped, in a new engine, with the same
overlaps (an empty directory, the negative control, restores nothing); its errors; and
SelectionService(state_dir=...) passes kvr serve's --state-dir through, keeps the workers'
registrations, and writes the final snapshots at shutdown()."""

import gc
import os
import re
import time

import pytest

import kvr

BS = 16


def prompt(start, blocks=4):
    return list(range(start, start + blocks * BS))


def snapshot_numbers(root):
    """The numbers of the snapshot files under root's partition directories."""
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            m = re.fullmatch(r"snapshot-(\d+)\.kvr", f)
            if m:
                out.append(int(m.group(1)))
    return sorted(out)


@pytest.mark.parametrize("io", ["plain", "auto"])
def test_engine_partition_restores_after_a_restart(tmp_path, io):
    tokens = prompt(1000, 6)
    p = kvr.Engine(seed=1).create_partition("m", "g", block_size=BS, state_dir=str(tmp_path),
                                           state_io=io)
    r = p.state_restored()
    assert r["snapshot_found"] is False and r["snapshot_blocks"] == 0
    p.upsert_worker(1)
    p.upsert_worker(2)
    assert p.store(1, 0, tokens) == 6
    assert p.store(2, 0, tokens[: 3 * BS]) == 3
    p.close_state()
    p.close_state()  # idempotent
    st = p.state_stats()
    assert st["closed"] is True
    assert st["snapshots"] >= 2 and st["snapshot_blocks"] == 9
    assert st["events_dropped"] == 0 and st["write_failures"] == 0
    if io == "plain":
        assert st["uring"] is False
    del p
    gc.collect()

    e = kvr.Engine(seed=1)
    p = e.create_partition("m", "g", block_size=BS, state_dir=str(tmp_path), state_io=io)
    r = p.state_restored()
    assert r["snapshot_found"] is True and r["snapshot_blocks"] == 9, r
    assert r["records"] == 0 and r["refused_files"] == [] and r["stopped"] is None
    p.upsert_worker(1)
    p.upsert_worker(2)
    d = p.select(tokens, allowed_workers=[2])
    assert d.device_blocks == 3
    d = p.select(tokens, allowed_workers=[1])
    assert d.device_blocks == 6

    # Dropping the partition object (no close_state) closes it too: what it stored since
    # comes back.
    p.store(2, 0, prompt(5000, 2))
    del p
    gc.collect()
    p = kvr.Engine().create_partition("m", "g", block_size=BS, state_dir=str(tmp_path),
                                      state_io=io)
    assert p.state_restored()["snapshot_blocks"] == 11
    p.upsert_worker(2)
    assert p.select(prompt(5000, 2)).device_blocks == 2

    # The partition object as the last holder of its engine (created from a temporary
    # Engine): dropping it still writes the final snapshot with everything in it.
    p.store(2, 0, prompt(9000, 1))
    del p
    gc.collect()
    p = kvr.Engine().create_partition("m", "g", block_size=BS, state_dir=str(tmp_path),
                                      state_io=io)
    r = p.state_restored()
    assert r["snapshot_blocks"] == 12 and r["records"] == 0, r


def test_an_empty_state_dir_restores_nothing(tmp_path):
    p = kvr.Engine().create_partition("m", block_size=BS, state_dir=str(tmp_path / "new"))
    assert p.state_restored()["snapshot_found"] is False
    p.upsert_worker(1)
    assert p.select(prompt(1000, 6)).device_blocks == 0


def test_state_errors(tmp_path, monkeypatch):
    e = kvr.Engine()
    p = e.create_partition("plain-partition", block_size=BS)
    assert p.state_stats() is None and p.state_restored() is None
    with pytest.raises(ValueError):
        p.close_state()
    with pytest.raises(ValueError):
        e.create_partition("m", block_size=BS, state_dir=str(tmp_path), state_io="bogus")
    with pytest.raises(ValueError):
        e.create_partition("m", block_size=BS, state_dir="")
    # With state_io="auto", KVR_STATE_IO chooses (an unknown value is an error); without a
    # state_dir it is not read.
    monkeypatch.setenv("KVR_STATE_IO", "sideways")
    with pytest.raises(ValueError):
        e.create_partition("m", block_size=BS, state_dir=str(tmp_path / "env"))
    e.create_partition("no-state", block_size=BS)
    monkeypatch.setenv("KVR_STATE_IO", "plain")
    assert e.create_partition("env", block_size=BS,
                              state_dir=str(tmp_path / "env")).state_stats()["uring"] is False
    monkeypatch.delenv("KVR_STATE_IO")
    f = tmp_path / "a-file"
    f.write_text("")
    with pytest.raises(OSError):
        e.create_partition("m", block_size=BS, state_dir=str(f / "sub"), state_io="plain")
    # The failed creation left no partition behind.
    e.create_partition("m", block_size=BS)
    # Two partitions of this process never write in the same directory.
    a = kvr.Engine().create_partition("x", block_size=BS, state_dir=str(tmp_path / "s"))
    with pytest.raises(OSError):
        kvr.Engine().create_partition("x", block_size=BS, state_dir=str(tmp_path / "s"))
    a.close_state()
    del a
    gc.collect()
    kvr.Engine().create_partition("x", block_size=BS, state_dir=str(tmp_path / "s"))


def test_selection_service_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    monkeypatch.delenv("KVR_STATE_DIR", raising=False)
    root = str(tmp_path / "state")
    s = kvr.SelectionService(state_dir=root, state_io="plain")
    s.upsert_worker_sync({"worker_id": 7, "model_name": "m", "block_size": BS,
                          "endpoint": "http://w7.invalid"})
    assert os.path.exists(os.path.join(root, "workers.json"))
    # Written at the partition's creation by a low-priority thread: on a busy machine it
    # can take a moment.
    deadline = time.time() + 10
    while not snapshot_numbers(root) and time.time() < deadline:
        time.sleep(0.01)
    before = snapshot_numbers(root)
    assert before, "the partition's first snapshot is written at its creation"
    s.shutdown()
    after = snapshot_numbers(root)
    assert max(after) > max(before), (before, after)  # shutdown wrote a final snapshot

    s2 = kvr.SelectionService(state_dir=root, state_io="plain")
    try:
        assert [w["worker_id"] for w in s2.list_workers()] == [7]
    finally:
        s2.shutdown()
    with pytest.raises(ValueError):
        kvr.SelectionService(state_dir=root, state_io="bogus")
