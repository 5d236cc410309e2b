"""What ``Backend.open`` returns: an awaitable, and an async context manager, around a backend
being opened (``backend/facade.py``); either way a failed open leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

import anyio

from meshd_mps.supervision.supervisor import Supervisor


class Opens(Protocol):
    """What an Opening needs of the backend it opens."""

    sup: Supervisor

    async def _open(self) -> None: ...

    async def _give_up(self) -> None: ...

    async def close(self) -> None: ...


B = TypeVar("B", bound=Opens)


class Opening(Generic[B]):
    """What ``Backend.open`` returns.  Awaited: the open backend, its supervisor's task group in a
    task of its own (for a host that cannot nest; ``close`` ends it).  ``async with``: the group
    entered in the caller's task, so that a failure of one of its tasks reaches the caller, and the
    backend closed at the block's end.  Either way a failed open leaves nothing behind."""

    def __init__(self, make: Callable[[], B]):
        self._make = make
        self._b: B | None = None

    def __await__(self) -> Generator[Any, None, B]:
        return self._detached().__await__()

    async def _detached(self) -> B:
        b = self._make()
        try:
            await b.sup.start()
            await b._open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await b._give_up()
            raise
        return b

    async def __aenter__(self) -> B:
        b = self._b = self._make()
        await b.sup.__aenter__()
        try:
            await b._open()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await b._give_up()
            await self.__aexit__(type(e), e, e.__traceback__)
            raise
        return b

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        assert self._b is not None
        with anyio.CancelScope(shield=True):
            await self._b.close()
        if isinstance(exc, Exception):
            # The block's own error (or the open's) is raised as it is, not inside the group's
            # ExceptionGroup; a failure of the group's tasks still is (with it as the context).
            await self._b.sup.__aexit__(None, None, None)
            return False
        return await self._b.sup.__aexit__(typ, exc, tb)
