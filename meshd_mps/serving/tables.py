"""What the CLI prints for ``meshd-mps ps`` and ``meshd-mps status``: the daemon's JSON answers
as aligned text tables (durations in s, m, h, d).  Standard library only, as the client is."""

from __future__ import annotations

from typing import Any


def duration(s: float) -> str:
    """12.3s, 4m05s, 2h03m, 3d04h."""
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in rows)


def beat_age(p: dict[str, Any]) -> str:
    """BEAT-AGE: seconds since the heartbeat was last seen advancing; "-" if it never beat (or the
    daemon does not say)."""
    age = p.get("beat_age_s")
    return "-" if age is None or isinstance(age, bool) or not isinstance(age, (int, float)) else duration(float(age))


def restarts(p: dict[str, Any]) -> str:
    """RESTARTS: how often it came back by itself, and its restart policy where it is not the default."""
    n, restart = p.get("restarts", 0), p.get("restart", "on-failure")
    return str(n) if restart == "on-failure" else f"{n} ({restart})"


def size(n: int | None) -> str:
    """A program's data size, for people ("-": none)."""
    if not n:
        return "-"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def ps_table(programs: list[dict[str, Any]]) -> str:
    head = ["NAME", "SLOT", "STATE", "PID", "GPU", "HEARTBEAT", "BEAT-AGE", "UPTIME", "UPGRADES", "RESTARTS", "HASH", "DATA"]
    errors = any(p.get("error") for p in programs)
    if errors:
        head.append("ERROR")
    rows = [head]
    for p in programs:
        r = [p["name"], str(p["slot"]), p["state"], str(p["pid"]), str(p.get("device", "-")), str(p["heartbeat"]),
             beat_age(p), duration(p["uptime_s"]), str(p["upgrades"]), restarts(p), p["hash"], size(p.get("data_bytes"))]
        if errors:
            r.append(p.get("error") or "")
        rows.append(r)
    out = table(rows)
    return out if programs else out + "(no programs loaded)\n"


def status_table(s: dict[str, Any]) -> str:
    caps = s.get("caps") or {}
    pool = s.get("pool") or {}
    devices = s.get("devices") or []
    rows = [
        ["socket", s.get("socket", "")],
        ["pid", str(s.get("pid", ""))],
        ["isolation", s.get("isolation", "")],
        ["gpu", s.get("gpu", "")],
    ]
    if len(devices) <= 1:
        rows.append(["device", f"{s.get('device')} ({caps.get('arch', '?')}, {caps.get('sms_total', '?')} SMs)"])
    rows.append(["sms", f"{caps.get('sms', '?')} per program" + (" (green context)" if caps.get("green") else "")])
    if len(devices) > 1:  # a row per GPU: what it is, its programs, its pool (MPS) or blinks (blink)
        for d in devices:
            c = d.get("caps") or {}
            what = [f"{d.get('name')} ({c.get('arch', '?')}, {c.get('sms_total', '?')} SMs)",
                    f"{d.get('programs', 0)} program{'' if d.get('programs', 0) == 1 else 's'}"]
            if "pool" in d:
                what.append(f"pool {len(d['pool'])} idle of {d.get('pool_cap', 0)} {_pids(d['pool'])}, reserve"
                            f" {d.get('pool_reserve', 0)} of {d.get('pool_reserve_cap', 0)}")
            if "blinks" in d:
                what.append(f"context {d.get('context_pid')}, {d.get('blinks', 0)} blinks")
            rows.append([f"gpu {d.get('device')}", ", ".join(what)])
    if s.get("isolation") == "mps":
        clients = s.get("clients")
        rows += [
            ["pool", f"{len(pool.get('idle', []))} idle of {pool.get('capacity', 0)} {_pids(pool.get('idle', []))}"
                     f", reserve {pool.get('reserve', 0)} of {pool.get('reserve_capacity', 0)} (kept for upgrades)"],
            ["mps daemon", f"{s.get('daemon_died') or s.get('daemon_pid')} ({s.get('mps_dir')})"],
            ["mps server", f"{s.get('server_pid') or '-'}, clients " + (_pids(clients) if clients is not None
                                                                         else s.get("clients_error", "?"))],
        ]
    else:
        last = s.get("last_blink_ms")
        rows += [["context", str(s.get("context_pid"))],
                 ["blinks", f"{s.get('blinks', 0)}" + (f", the last {last:.2f} ms" if last is not None else "")]]
    rows += [
        ["workers", f"{len(s.get('workers', []))} {_pids(s.get('workers', []))}, {s.get('retired', 0)} retired"],
        ["programs", str(s.get("programs", 0)) + (f" (their data: {size(s['data_bytes'])})" if s.get("data_bytes") else "")],
        ["stalled", str(s.get("stalled", 0))],
        ["loads", str(s.get("loads", 0))],
        ["uptime", duration(float(s.get("uptime_s", 0)))],
        ["versions", ", ".join(f"{k} {v}" for k, v in (s.get("versions") or {}).items())],
    ]
    return table(rows + state_rows(s.get("state")))


def state_rows(st: dict[str, Any] | None) -> list[list[str]]:
    """The desired state's rows (status's ``state``): its directory, live restore, and what the
    start did with what it found there (``restore``: adopted, restored, declared, halted, skipped,
    left) and with the workers left running (``adoption``)."""
    if not st:
        return []
    rows = [["state dir", str(st.get("dir") or "-")],
            ["live restore", "on" if st.get("live_restore") else "off"]]
    r = st.get("restore") or {}
    did = [f"{k} {', '.join(r[k])}" for k in ("adopted", "restored", "declared") if r.get(k)]
    if r.get("halted"):
        did.append("halted " + ", ".join(str(h.get("program", "?")) for h in r["halted"]))
    did += [f"skipped {n} ({why})" for n, why in (r.get("skipped") or {}).items()]
    did += [f"left {n} ({why})" for n, why in (r.get("left") or {}).items()]
    rows.append(["at start", "; ".join(did) or "nothing to restore"])
    a = st.get("adoption")
    if a is not None:  # live restore: the workers an earlier meshd-mps left
        rows.append(["workers left", ", ".join(f"{k} {_pids(a.get(k, []))}" for k in ("adopted", "dismissed", "gone"))])
    return rows


def _pids(pids: list[int]) -> str:
    return "[" + ", ".join(str(p) for p in pids) + "]"

