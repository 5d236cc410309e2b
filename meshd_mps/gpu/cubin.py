"""What a cubin (nvJitLink's ELF) says without a GPU: its symbols, a global's initial value and a
kernel's registers per thread, for ``meshd-mps check``.

The worker asks the driver the same things of a loaded module (cuModuleGetFunction, the
``mesh_rt_abi`` global, CU_FUNC_ATTRIBUTE_NUM_REGS); without a GPU there is no driver to ask, so
they are read from the ELF: the symbol table, the initialised globals' section, and the
``.nv.info`` attributes (EIATTR_REGCOUNT, which nvJitLink writes for every kernel: the value the
driver reports).  A few fixed ELF64 records read with ``struct``: pyelftools would do it too, but
is not a dependency of meshd-mps, and these three lookups need none of its DWARF machinery.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
SHT_SYMTAB, SHT_NOBITS = 2, 8
STT_OBJECT, STT_FUNC = 1, 2
#: The .nv.info attribute with a kernel's register count: (symbol index u32, registers u32).
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 4  # an attribute with a u16 size and that many bytes; the others are 4 bytes in all


class CubinError(ValueError):
    """Bytes that are not an ELF64 cubin this reader understands."""


@dataclass(frozen=True)
class Symbol:
    name: str
    kind: int  # STT_FUNC, STT_OBJECT, ...
    section: int
    value: int
    size: int


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    offset: int
    size: int
    link: int


class Cubin:
    """One cubin's sections and symbols."""

    def __init__(self, data: bytes):
        self.data = data
        try:
            if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
                raise CubinError("not a little-endian ELF64 file")
            e = _EHDR.unpack_from(data)
            shoff, shentsize, shnum, shstrndx = e[6], e[11], e[12], e[13]
            raw = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
            names = raw[shstrndx][4]
            self.sections = [_Section(self._str(names, s[0]), s[1], s[4], s[5], s[6]) for s in raw]
            self.symbols: list[Symbol] = []
            for s in self.sections:
                if s.type == SHT_SYMTAB:
                    strtab = self.sections[s.link].offset
                    for at in range(s.offset, s.offset + s.size, _SYM.size):
                        n, info, _other, shndx, value, size = _SYM.unpack_from(data, at)
                        self.symbols.append(Symbol(self._str(strtab, n), info & 0xF, shndx, value, size))
        except (struct.error, IndexError, UnicodeDecodeError) as err:
            raise CubinError(f"not a cubin this reader understands: {err}") from err

    def _str(self, table: int, at: int) -> str:
        end = self.data.index(b"\0", table + at)
        return self.data[table + at : end].decode()

    def symbol(self, name: str, kind: int) -> Symbol | None:
        return next((s for s in self.symbols if s.name == name and s.kind == kind), None)

    def u32(self, sym: Symbol) -> int | None:
        """A global u32's initial value (0 in an uninitialised section), None if it cannot be read."""
        if not 0 < sym.section < len(self.sections):
            return None
        sec = self.sections[sym.section]
        if sec.type == SHT_NOBITS:
            return 0
        if sym.value + 4 > sec.size:
            return None
        return int.from_bytes(self.data[sec.offset + sym.value : sec.offset + sym.value + 4], "little")

    def registers(self, kernel: str) -> int | None:
        """The kernel's registers per thread (EIATTR_REGCOUNT), None where the cubin does not say."""
        index = next((i for i, s in enumerate(self.symbols) if s.name == kernel and s.kind == STT_FUNC), None)
        if index is None:
            return None
        for sec in self.sections:
            if sec.name != ".nv.info":
                continue
            at, end = sec.offset, sec.offset + sec.size
            while at + 4 <= end:
                fmt, attr, size = self.data[at], self.data[at + 1], int.from_bytes(self.data[at + 2 : at + 4], "little")
                if fmt != EIFMT_SVAL:
                    at += 4
                    continue
                if attr == EIATTR_REGCOUNT and size >= 8:
                    sym, regs = struct.unpack_from("<II", self.data, at + 4)
                    if sym == index:
                        return regs
                at += 4 + size
        return None
