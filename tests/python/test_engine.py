"""The typed hot path (kvr.Engine / Partition / Decision), token buffers, hash_tokens on
its own, and that engine work releases the GIL."""

import array
import sys
import threading
import time

import pytest

import kvr

BS = 16


@pytest.fixture
def part():
    e = kvr.Engine(seed=1)
    p = e.create_partition("m", "g", block_size=BS)
    for w in (1, 2, 3):
        p.upsert_worker(w)
    return e, p


def test_select_prefers_the_cached_worker(part):
    e, p = part
    toks = list(range(5000, 5000 + 8 * BS))
    assert p.store(2, 0, toks) == 8
    d = p.select(toks)
    assert (d.worker_id, d.dp_rank, d.selection_id) == (2, 0, None)
    assert d.cached_tokens == 8 * BS and d.device_blocks == 8
    b = p.select(toks, reserve=True)
    assert b.worker_id == 2 and b.selection_id is not None
    assert p.load(2)[2] == 1
    e.mark_prefill_complete(b.selection_id)
    e.add_output_blocks(b.selection_id, 2)
    assert e.free(b.selection_id) is True
    assert p.load(2) == (0, 0, 0)
    assert e.free(b.selection_id) is False  # freed before
    with pytest.raises(kvr.SelectionServiceError) as err:
        e.free(123456789)  # never booked
    assert err.value.kind == "not_found"


@pytest.mark.parametrize("make", [
    lambda t: t,
    lambda t: tuple(t),
    lambda t: array.array("I", t),
    lambda t: array.array("i", t),
    lambda t: array.array("q", t),
    lambda t: array.array("L", t),
    lambda t: array.array("H", [x % 65536 for x in t]),
    lambda t: memoryview(array.array("I", t)),
    lambda t: range(t[0], t[-1] + 1),
])
def test_token_containers_agree(part, make):
    _, p = part
    toks = list(range(7000, 7000 + 4 * BS))
    p.store(3, 0, toks)
    d = p.select(make(toks))
    ref = p.select(toks)
    assert (d.worker_id, d.cached_tokens) == (ref.worker_id, ref.cached_tokens)
    assert kvr.hash_tokens(make(toks), BS) == kvr.hash_tokens(toks, BS)


def test_numpy_arrays_if_present(part):
    np = pytest.importorskip("numpy")
    toks = list(range(9000, 9000 + 4 * BS))
    ref = kvr.hash_tokens(toks, BS)
    for dt in (np.uint32, np.int32, np.int64, np.uint64):
        assert kvr.hash_tokens(np.array(toks, dtype=dt), BS) == ref
    # A strided view is not contiguous: read through the sequence path.
    assert kvr.hash_tokens(np.array(toks * 2, dtype=np.uint32).reshape(2, -1)[0], BS) == ref


@pytest.mark.parametrize("bad", [
    "abc", b"abc", [1, -1], [2**32], [1.0], [None], array.array("d", [1.0]),
    array.array("i", [-5]), object(), 5,
])
def test_bad_tokens_are_value_errors(part, bad):
    _, p = part
    with pytest.raises(ValueError):
        p.select(bad)
    with pytest.raises(ValueError):
        kvr.hash_tokens(bad, BS)


def test_bad_arguments(part):
    e, p = part
    with pytest.raises(ValueError):
        kvr.hash_tokens([1, 2], 0)
    with pytest.raises(ValueError):
        e.create_partition("m", "g")  # exists
    with pytest.raises(ValueError):
        e.create_partition("m2", block_size=0)
    with pytest.raises(kvr.SelectionServiceError) as err:
        p.select([1, 2, 3], allowed_workers=[99])
    assert err.value.status_code == 503
    ev = e.create_partition("noevents", use_kv_events=False)
    ev.upsert_worker(1)
    with pytest.raises(ValueError):
        ev.store(1, 0, [1] * BS)


def test_hash_tokens_known_values():
    # Pinned from dynamo.llm.compute_block_hash_for_seq 1.6.1 (the differential test
    # compares many more cases against the real function).
    assert kvr.hash_tokens(list(range(10)), 4) == [9143094415614847814, 12124091508212882195]
    assert kvr.hash_tokens(list(range(9)), 4, is_eagle=True) == [14562210786876287112,
                                                                 15916330181359808192]


def test_threads_book_and_free(part):
    e, p = part
    p.store(1, 0, list(range(4 * BS)))
    errors = []

    def work(t):
        try:
            buf = array.array("I", range(t, t + 8 * BS))
            for _ in range(2000):
                d = p.select(buf, reserve=True)
                e.free(d.selection_id)
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    for w in (1, 2, 3):
        assert p.load(w) == (0, 0, 0)


def progress_during(call):
    """Stamps a pure-Python thread made in the middle half of `call`'s run. The switch
    interval is cut to 0.2 ms so that a call holding the GIL leaves the thread at most
    that much at its start, far less than a quarter of the call."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        return _progress_during(call)
    finally:
        sys.setswitchinterval(old)


def _progress_during(call):
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    t.join()
    q = (t1 - t0) / 4
    return sum(1 for s in stamps if t0 + q <= s <= t1 - q)


def test_gil_is_released_during_engine_work():
    big = array.array("I", range(1 << 24))  # 64 MiB of tokens, hashed in place
    # Up to 20 tries: on a loaded machine the OS may not run the other thread during one
    # short (~10 ms) call; with the GIL held it cannot run in any of them.
    for _ in range(20):
        if progress_during(lambda: kvr.hash_tokens(big, 1 << 16)) > 0:
            return
    pytest.fail("no Python thread ran while the engine hashed, in 20 tries: GIL held")


def test_gil_check_catches_a_gil_holding_call():
    """Negative control: sorting a big list holds the GIL; the check sees no progress."""
    data = [(i * 7919) % 1_000_003 for i in range(1_000_000)]
    assert progress_during(lambda: sorted(data)) == 0
