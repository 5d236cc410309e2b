"""Native clients: CUDA processes that are not our workers, joined to our MPS server (MPS mode
only; docs/operations.md).  The backend's part of them, a mixin of :class:`Backend`."""

from __future__ import annotations

from meshd_mps.base.errors import MpsError, NotOurClient, WrongMode
from meshd_mps.mps.clients import Clients


class NativeClients:
    """``native_env``, ``add_native``, ``drop_native`` and ``natives`` over ``mps`` (MPS mode's
    clients; None in blink mode, which has no server to join: WrongMode)."""

    isolation: str

    @property
    def mps(self) -> Clients | None:
        """MPS mode's clients; None in blink mode (the backend's, which overrides this)."""
        raise NotImplementedError

    def _mps_mode(self, what: str) -> Clients:
        mps = self.mps
        if mps is None:
            raise WrongMode(f"{what}: native clients join our MPS server; this backend's isolation is {self.isolation}",
                            isolation=self.isolation)
        return mps

    def native_env(self) -> dict[str, str]:
        """The environment a CUDA process that is not one of our workers needs to join our MPS
        server as a native client (then register its pid: ``add_native``)."""
        return self._mps_mode("native env").native_env()

    async def add_native(self, pid: int) -> None:
        """Register ``pid`` as a native client: checked to be a client of our server (MpsError
        otherwise), then counted against the server's clients and not logged as foreign; dropped
        when it exits."""
        mps = self._mps_mode(f"native client {pid}")
        mps.daemon.check_alive()  # a dead daemon is ours to report (500), not the caller's pid
        try:
            await mps.check_native(pid)
        except MpsError as e:
            raise NotOurClient(f"native client {pid} not registered: {e} (start it with the environment of"
                               " `meshd-mps native`, and register it once its CUDA context exists)", pid=pid) from e

    def drop_native(self, pid: int) -> bool:
        """``pid`` no longer a native client of ours; False if it was not one."""
        return self._mps_mode(f"native client {pid}").drop_native(pid)

    def natives(self) -> list[int]:
        """The native clients that still run (none in blink mode)."""
        return sorted(self.mps.native) if self.mps is not None else []
