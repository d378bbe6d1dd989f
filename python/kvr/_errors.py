"""kvr's exceptions (raised by the native module too)."""

from __future__ import annotations


class SelectionServiceError(Exception):
    """A selection failure that is not bad input, as Dynamo's ``SelectionServiceError``:
    ``kind`` is a stable category (``not_ready``, ``not_found``, ``conflict``,
    ``overloaded``, ``scheduler``, ``internal``) and ``status_code`` the HTTP status
    ``kvr serve`` answers for it (503, 404, 409, 429, 503, 500)."""

    kind: str
    status_code: int

    def __init__(self, message: str, kind: str, status_code: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.status_code = status_code

    def __reduce__(self):
        return (type(self), (str(self), self.kind, self.status_code))
