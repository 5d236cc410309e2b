"""The error tree: every error type has a deliberate status, fields travel with it, causes are kept."""

from __future__ import annotations

import inspect

import pytest

from meshd_mps.base import errors as E
from meshd_mps.serving.status import status_of

#: Every MeshError subclass and the status the API answers it with.  A new error type fails the
#: completeness test below until it is placed here: a status is a decision, not a default.
EXPECTED = {
    E.MeshError: 500, E.BadRequest: 400, E.NotFound: 404, E.Conflict: 409, E.Timeout: 504, E.Unavailable: 503,
    E.ConfigError: 400, E.NoDriver: 500, E.DeviceError: 500, E.NotServedHere: 400, E.CompileError: 400,
    E.ManifestError: 400, E.BadName: 400, E.BadRestartPolicy: 400, E.HashMismatch: 400, E.LimitError: 400, E.ImageRefused: 400,
    E.AbiMismatch: 400, E.UpgradeMismatch: 400, E.PayloadTooLarge: 413, E.NotLoaded: 404, E.AlreadyLoaded: 409,
    E.NoFreeSlot: 409, E.SlotTaken: 409, E.NotRunning: 409, E.StillRunning: 409, E.CapacityError: 409, E.ClientLimit: 409,
    E.LeaseOver: 409, E.DataTooLarge: 409, E.WriteOutOfRange: 400, E.NoData: 409, E.DataNotFound: 404,
    E.NotStarted: 409, E.HaltTimeout: 409, E.CallTimeout: 504, E.MailboxError: 400, E.RingFull: 409,
    E.NotServing: 409, E.BadRestoreMode: 400, E.BadResponse: 502, E.OldWorker: 409,
    E.FrameError: 500, E.WorkerError: 500, E.WorkerGone: 500, E.NoContext: 503, E.WorkerUnfit: 500, E.NoReply: 500,
    E.SpawnFailed: 500, E.MpsError: 500, E.StateError: 500, E.WrongMode: 409,
    E.NotNative: 404, E.NotOurClient: 409, E.NvmlUnavailable: 500,
    E.ProtocolMismatch: 500, E.PeerMismatch: 500, E.NotAdoptable: 500,
    E.ConfigFileError: 400, E.StateDirRefused: 400, E.StateFileNewer: 400, E.StateIOError: 500,
    # the fleet's: a node's refusal of a fleet call is a bad gateway's, its own status in a field
    E.FleetError: 500, E.FleetUnavailable: 503, E.BadSpec: 422, E.NoSuchProgram: 404, E.AlreadyDeclared: 409,
    E.NoReplica: 503, E.ReplicaLost: 503, E.UpgradeFailed: 409, E.FleetTimeout: 504, E.CallRefused: 502,
    E.CallPortToken: 401, E.NotAReplica: 404, E.CallPortRelay: 503,
}


def _all_errors() -> set[type[E.MeshError]]:
    return {c for _, c in inspect.getmembers(E, inspect.isclass) if issubclass(c, E.MeshError)}


def test_every_error_type_has_a_decided_status():
    assert _all_errors() - set(EXPECTED) == set()


def _instance(cls: type[E.MeshError]) -> E.MeshError:
    """One of each, built with its own fields (keyword-only ones named by the signature)."""
    sig = inspect.signature(cls.__init__)
    kw: dict[str, object] = {}
    args: list[object] = []
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value: object = f"<{name}>" if p.annotation in ("str", str) else 3
        if p.default is not p.empty:
            continue
        if p.kind == p.KEYWORD_ONLY:
            kw[name] = value
        else:
            args.append(value if name != "message" else f"a {cls.__name__}")
    return cls(*args, **kw)


@pytest.mark.parametrize("cls", sorted(EXPECTED, key=str), ids=lambda c: getattr(c, "__name__", repr(c)))
def test_status_and_fields(cls):
    e = _instance(cls)
    assert status_of(e) == EXPECTED[cls]
    assert set(e.fields()) == set(cls.FIELDS)
    for k in cls.FIELDS:
        assert getattr(e, k) is not None


def test_prefixed_keeps_the_type_the_fields_and_the_cause():
    e = E.ClientLimit("mps: 48 clients already", have=48, asked=49, device=1)
    try:
        try:
            raise e
        except E.ClientLimit as inner:
            raise inner.prefixed("load") from inner
    except E.ClientLimit as outer:
        assert str(outer) == "load: mps: 48 clients already"
        assert outer.fields() == {"limit": "MPS clients", "have": 48, "asked": 49, "device": 1}
        assert outer.__cause__ is e and str(e) == "mps: 48 clients already"  # the original is untouched
    g = E.WorkerGone("worker 7 exited", pid=7).prefixed("echo", "{what} ({message})")
    assert str(g) == "echo (worker 7 exited)" and g.pid == 7 and isinstance(g, E.WorkerError)


def test_unknown_exceptions_are_500():
    assert status_of(RuntimeError("a bug")) == 500
    assert status_of(KeyError("x")) == 500
