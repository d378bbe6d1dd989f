"""Differential test: the HTTP compatibility harness's scripted sequence
(tests/compat/harness.py `_scenario`, fed by vLLM 0.33.0's real KV-event publisher) run
against Dynamo 1.6.1's `dynamo.llm.SelectionService` and against `kvr.SelectionService`
(with `cost_model="dynamo"`, Dynamo's scorer), in process, and the transcripts compared by the harness's own rules
(`compare_transcripts`: status, body, error texts) with the allow-lists of
tests/compat/known-differences.md and tests/python/known-differences.md.

Needs the compatibility venv's packages (Dynamo, pyzmq, msgspec) on the path: run.sh
puts them there. Skips without them unless KVR_REQUIRE_DYNAMO=1.
"""

import copy
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
COMPAT = os.path.join(os.path.dirname(HERE), "compat")

try:
    import dynamo.llm as dynamo_llm
    from dynamo.llm.exceptions import SelectionServiceError as DynamoError
    import zmq  # noqa: F401  (the publisher's)
    import msgspec  # noqa: F401
    HAVE_DYNAMO = True
except ImportError:
    HAVE_DYNAMO = False
    if os.environ.get("KVR_REQUIRE_DYNAMO") == "1":
        raise

import kvr
import harness
from adapter import InProcess

pytestmark = pytest.mark.skipif(not HAVE_DYNAMO, reason="Dynamo's venv is not on the path")


def allow_list():
    return (harness.load_allow_list(os.path.join(COMPAT, "known-differences.md"))
            + harness.load_allow_list(os.path.join(HERE, "known-differences.md")))


def run_side(name, svc, error_type, inproc):
    base = inproc.add(name, svc, error_type)
    try:
        return harness.scenario(base)
    finally:
        inproc.close(name)
        svc.shutdown()


@pytest.fixture(scope="module")
def transcripts():
    inproc = InProcess(harness.http)
    real = harness.http
    harness.http = inproc
    try:
        ta = run_side("dynamo", dynamo_llm.SelectionService(), DynamoError, inproc)
        # kvr's default cost model (latency) routes differently by design; with Dynamo's
        # model the answers must be Dynamo's.
        tb = run_side("kvr", kvr.SelectionService(cost_model="dynamo"),
                      kvr.SelectionServiceError, inproc)
    finally:
        harness.http = real
    return ta, tb


def test_scenario_ran_on_both(transcripts):
    ta, tb = transcripts
    # Events reached both services (else the overlap steps compare nothing real).
    assert not ta["notes"], ta["notes"]
    assert not tb["notes"], tb["notes"]
    called = [s for s in ta["steps"] if s["status"] != "n/a"]
    assert len(called) > 100, len(called)
    # Steps the class has no call for answer n/a on both sides, and only those.
    assert [s["name"] for s in ta["steps"] if s["status"] == "n/a"] == \
        [s["name"] for s in tb["steps"] if s["status"] == "n/a"]


def test_same_answers_as_dynamo(transcripts):
    ta, tb = transcripts
    unexplained, allowed = harness.compare_transcripts(ta, tb, allow_list())
    harness.print_diff(unexplained, allowed, "dynamo", "kvr")
    assert not unexplained, f"{len(unexplained)} differences from Dynamo's class (printed above)"


def test_comparison_catches_a_difference(transcripts):
    """Negative control: a perturbed copy of kvr's transcript must be reported."""
    ta, tb = transcripts
    bad = copy.deepcopy(tb)
    step = next(s for s in bad["steps"] if s["name"] == "select-P1")
    step["value"]["worker_id"] = 99
    err = next(s for s in bad["steps"] if s["name"] == "claim-unknown")
    err["value"]["error"] += " (perturbed)"
    unexplained, _ = harness.compare_transcripts(ta, bad, allow_list())
    names = {u[0] for u in unexplained}
    assert {"select-P1", "claim-unknown"} <= names, names


def test_hash_tokens_matches_compute_block_hash_for_seq():
    h = dynamo_llm.compute_block_hash_for_seq
    toks = list(range(1000, 1000 + 16 * 5 + 3))
    mm = [None, {"mm_objects": [{"mm_hash": 7, "offsets": []}, {"mm_hash": 3, "offsets": []}]}]
    cases = [
        dict(tokens=toks, kv_block_size=16),
        dict(tokens=toks, kv_block_size=1),
        dict(tokens=toks[:15], kv_block_size=16),
        dict(tokens=[], kv_block_size=16),
        dict(tokens=toks, kv_block_size=16, lora_name="adapter-a"),
        dict(tokens=toks, kv_block_size=16, cache_namespace="ns"),
        dict(tokens=toks, kv_block_size=16, lora_name="a", cache_namespace="ns"),
        dict(tokens=toks, kv_block_size=16, block_mm_infos=mm),
        dict(tokens=toks, kv_block_size=16, is_eagle=True),
        dict(tokens=toks[:32], kv_block_size=16, is_eagle=True),
        dict(tokens=[0, 2**32 - 1] * 8, kv_block_size=16),
    ]
    for c in cases:
        assert kvr.hash_tokens(**c) == h(**c), c
