"""kvr.SelectionService replica sync (Dynamo's replica_sync_port / replica_sync_peers and
its three peer methods): two services in this process, each applying the other's bookings."""

import socket
import time

import pytest

import kvr

BS = 16


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def requests(s):
    return sum(r["active_requests"] for p in s.loads() for r in p["loads"])


def wait(pred, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    pa, pb = free_port(), free_port()
    a = kvr.SelectionService(replica_sync_port=pa, replica_sync_peers=[f"tcp://127.0.0.1:{pb}"])
    b = kvr.SelectionService(replica_sync_port=pb, replica_sync_peers=[f"tcp://127.0.0.1:{pa}"])
    for s in (a, b):
        s.upsert_worker_sync({"worker_id": 1, "model_name": "m", "block_size": BS,
                              "endpoint": "http://w1.invalid"})
    yield a, b, pa, pb
    a.shutdown()
    b.shutdown()


def test_bookings_cross_both_ways(pair):
    a, b, _, _ = pair
    body = {"model_name": "m", "token_ids": list(range(4 * BS)),
            "pinned_worker": {"worker_id": 1, "dp_rank": 0}}
    # A peer misses what was published before it subscribed: book until B has one.
    n = 0
    while not wait(lambda: requests(b) >= 1, timeout=0.5):
        a.select_and_reserve_sync({**body, "selection_id": f"a-{n}"})
        n += 1
        assert n < 20, "B never saw A's bookings"
    assert wait(lambda: b.replica_sync_stats()["applied"] >= 1)
    # Every later booking and free crosses.
    before = requests(b)
    a.select_and_reserve_sync({**body, "selection_id": "a-last"})
    assert wait(lambda: requests(b) == before + 1)
    b.free_reservation_sync("a-last")  # B frees A's booking: A sees it
    assert wait(lambda: requests(a) == n)
    with pytest.raises(kvr.SelectionServiceError):
        a.free_reservation_sync("a-last")
    # An id A booked is taken in B too.
    with pytest.raises(kvr.SelectionServiceError) as e:
        b.select_and_reserve_sync({**body, "selection_id": "a-0"})
    assert "already reserved" in str(e.value)


def test_peer_methods(pair):
    a, _, _, pb = pair
    assert a.list_replica_peers() == [f"tcp://127.0.0.1:{pb}"]
    extra = f"tcp://127.0.0.1:{free_port()}"
    assert a.register_replica_peer(extra) is True
    assert a.register_replica_peer(extra) is False
    assert extra in a.list_replica_peers()
    assert a.deregister_replica_peer(extra) is True
    assert a.deregister_replica_peer(extra) is False
    with pytest.raises(Exception, match="unsupported scheme"):
        a.register_replica_peer("http://x:1")
    with pytest.raises(TypeError):
        a.register_replica_peer(5)


def test_without_sync(monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    s = kvr.SelectionService()
    try:
        assert s.list_replica_peers() == []
        assert s.replica_sync_stats() == {}
        with pytest.raises(Exception, match="replica sync is disabled"):
            s.register_replica_peer("tcp://127.0.0.1:1")
        with pytest.raises(Exception, match="replica sync is disabled"):
            s.deregister_replica_peer("tcp://127.0.0.1:1")
    finally:
        s.shutdown()
    with pytest.raises(ValueError, match="replica_sync_peers requires replica_sync_port"):
        kvr.SelectionService(replica_sync_peers=["tcp://127.0.0.1:1"])
    with pytest.raises(Exception, match="greater than zero"):
        kvr.SelectionService(replica_sync_port=0)
    with pytest.raises(Exception, match="invalid replica peer endpoint"):
        kvr.SelectionService(replica_sync_port=free_port(), replica_sync_peers=["bogus"])
