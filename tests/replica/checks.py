"""The replica tests' checks: each prints ok/FAIL and is remembered, and `finish` ends the
run: all must pass, or, in a negative control, at least one must fail."""

FAILURES = []


class StopChecks(Exception):
    """Raised where a negative control's checks end (caught before `finish`, which then
    gives the verdict)."""


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def finish(negative, passed, negative_failed, negative_passed):
    """Exits non-zero unless the run went as it must; prints `passed` (or, for a negative
    control, `negative_failed`) otherwise."""
    if negative:
        if FAILURES:
            print(f"negative control: {negative_failed}")
            return
        raise SystemExit(f"negative control: {negative_passed}")
    if FAILURES:
        raise SystemExit(f"{len(FAILURES)} check(s) failed")
    print(passed)
