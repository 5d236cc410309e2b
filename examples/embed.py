"""Embedding meshd-mps in an asyncio host (docs/api.md): run as written.

    python examples/embed.py            # on the GPU, blink mode
    python examples/embed.py --gpu sim --isolation mps   # no GPU (put meshd_mps/standin on PATH for mps)
"""

import argparse
import asyncio
import json
import pathlib

from meshd_mps import Backend, Programs
from meshd_mps.gpu.compiler import cuda_to_ptx

HERE = pathlib.Path(__file__).resolve().parent


def example(name: str) -> tuple[dict, bytes]:
    d = HERE / name
    ptx = cuda_to_ptx((d / f"{name}.cu").read_bytes(), name, include=[str(HERE / "include")])
    return json.loads((d / "manifest.json").read_text()), ptx


async def main(gpu: str, isolation: str) -> None:
    async with Backend.open(isolation=isolation, gpu=gpu, pool=2) as backend:  # the supervisor runs in this task
        print("device:", backend.caps.name, "isolation:", backend.isolation)
        programs = Programs(backend)
        hb = await programs.load(*example("heartbeat"))
        await programs.load(*example("echo"))
        print("echo says:", (await programs.call("echo", b"hello")).decode())
        for row in programs.list():
            print(f"{row['name']:10} slot {row['slot']}  {row['state']:8} pid {row['pid']}  heartbeat {row['heartbeat']}")
        backend.mailbox.halt(hb.slot)  # the program's contract: return when CONTROL says HALT
        done = await hb.launch  # a Launch is awaitable: the program's DONE
        print("heartbeat ended:", "ok" if done.ok else done.message)
        await programs.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="cuda", choices=("cuda", "sim"))
    ap.add_argument("--isolation", default="blink", choices=("blink", "mps"))
    a = ap.parse_args()
    asyncio.run(main(a.gpu, a.isolation))
