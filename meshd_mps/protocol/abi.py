"""Program ABI v1: the constants a resident program and meshd-mps agree on.

docs/program-abi.md explains them; examples/include/mesh_program.h is the
device-side copy.  Offsets are bytes into one mailbox slot; every word is
little-endian and naturally aligned.
"""

from __future__ import annotations

#: Value of the program's ``mesh_rt_abi`` global that this meshd-mps accepts.
RT_ABI = 1
RT_ABI_SYMBOL = "mesh_rt_abi"
ENTRY = "mesh_main"
#: The program's data (docs/program-abi.md, "Data"): u64 globals the worker writes before each launch.
DATA_SYMBOL = "mesh_data"  # the device address of the program's data (0: it has none)
DATA_BYTES_SYMBOL = "mesh_data_bytes"  # its size in bytes

SLOT_BYTES = 4096
SLOTS = 256
MAILBOX_BYTES = SLOT_BYTES * SLOTS  # 1 MiB

# ---- one slot ------------------------------------------------------------------------------
CONTROL = 0  # u32, host writes: RUN or HALT
STATE = 4  # u32, program writes: IDLE, RUNNING, EXITED
HEARTBEAT = 8  # u64, program increments
BEAT_TIME = 16  # u64, program writes %globaltimer (ns) at each beat
MAX_GAP = 24  # u64, program writes the largest gap between beats (ns) since the last reset
GAP_RESET = 32  # u32, host writes 1; the program zeroes MAX_GAP and this word
REQ_HEAD = 64  # u32, host increments after writing a request
RESP_HEAD = 68  # u32, program increments after writing the response to request RESP_HEAD
SERVES = 72  # u32, program writes SERVING when it polls the ring (the header's ring helpers); zeroed at launch
DATA_SEQ = 76  # u32, host increments once a write to the program's data has been copied (zeroed at launch)
# Bytes 96..127: the program's payload region (protocol/payloads.py), written by its worker at each launch.
PAYLOADS = 96  # u64, the region's device address (0: the program declared no payloads beyond a ring entry)
REQUEST_MAX = 104  # u32, the manifest's max_request: the most bytes a request may have
RESPONSE_MAX = 108  # u32, the manifest's max_response: the most bytes a response may have
REQUEST_STRIDE = 112  # u32, bytes from one entry's request area to the next (0: requests are inline only)
RESPONSE_STRIDE = 116  # u32, the same for the response areas, which start at RING * REQUEST_STRIDE
RING = 8  # entries
ENTRY_BYTES = 192  # u32 length + up to 188 payload bytes; over 188, u32 length + u32 offset in the payload region
ENTRY_PAYLOAD = ENTRY_BYTES - 4
REQ_BASE = 128
RESP_BASE = REQ_BASE + RING * ENTRY_BYTES  # 1664
USER_BASE = RESP_BASE + RING * ENTRY_BYTES  # 3200: free for the program
ENTRY_WORDS = ENTRY_BYTES // 4  # 48: a warp copies an entry a word per lane (mesh_ring_load)
BEAT_EVERY = 100_000  # ns: mesh_ring_wait's beat interval (echo's; a program may pick another)

RUN, HALT = 0, 1
SERVING = 1  # SERVES: the kernel has polled its request ring
IDLE, RUNNING, EXITED = 0, 1, 2
