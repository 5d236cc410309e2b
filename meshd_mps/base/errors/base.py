"""The root of the tree and its branches: what kind of failure an error is for a caller."""

from __future__ import annotations

from typing import Any, ClassVar, Self


class MeshError(Exception):
    """Base of every error meshd-mps raises on purpose.  ``FIELDS`` names the attributes that an
    API answer carries beside the message."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS}

    def prefixed(self, what: str, form: str = "{what}: {message}") -> Self:
        """The same error (type and fields), its message put in what it happened in ("load: worker
        7 exited", or with ``form="{what} ({message})"`` "echo (worker 7 exited)"); raise it
        ``from`` the original to keep the cause."""
        e = type(self).__new__(type(self))  # not copy.copy: that calls __init__ without the fields
        e.__dict__.update(self.__dict__)
        e.args = (form.format(what=what, message=self), *self.args[1:])
        return e


# ---- the branches ---------------------------------------------------------------------------


class BadRequest(MeshError):
    """The request itself is wrong (a field, a manifest, a program the GPU cannot run at all):
    sent again unchanged, it fails again.  Nothing was changed."""


class NotFound(MeshError):
    """What the request names does not exist here."""


class Conflict(MeshError):
    """The request is fine, but what runs now does not allow it (the name is taken, the GPU is
    full, the program is not running).  Nothing was changed."""


class Timeout(MeshError):
    """A wait ran past its deadline (``deadlines.py``)."""


class Unavailable(MeshError):
    """The daemon cannot serve this now (starting, shutting down)."""
