"""Declarative header layouts: one table in, offsets, masks and pack/unpack out.

A layout is a tuple of ``(field, struct_format, default)`` entries in wire order. All
formats are big-endian (network order) and unpadded. ``field`` is either a name or a
:class:`Bits` of ``(name, width)`` pairs that share one integer word, most significant bit
first; the default of a ``Bits`` entry is the whole word, as in dpkt. Example (BTH's second
byte)::

    (Bits(("se", 1), ("m", 1), ("padcnt", 2), ("tver", 4)), "B", 0)

From the table, :meth:`Layout.constants` derives the module-level ints that Numba kernels
read (kernels never write a header offset or mask by hand). For header ``H`` and field ``F``:

- ``H_LEN``       header length in bytes;
- ``H_OFF_F``     byte offset, from the start of the header, of the word holding ``F``;
- ``H_SIZE_F``    length in bytes of that word (1, 2, 4 or 8; for byte-string fields such as
  addresses, the string length);
- ``H_F_MASK``    (integer fields) the bits of ``F`` within the big-endian word;
- ``H_F_SHIFT``   (integer fields) so that ``F = (word & H_F_MASK) >> H_F_SHIFT``.

A field that fills its word has ``MASK = 2**(8*SIZE) - 1`` and ``SHIFT = 0``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_INT_FORMATS = {"B": 1, "H": 2, "I": 4, "Q": 8}


class Bits(tuple):
    """Sub-fields of one integer word: ``Bits(("name", width), ...)``, MSB first."""

    def __new__(cls, *pairs: tuple[str, int]):
        return super().__new__(cls, pairs)


@dataclass(frozen=True)
class Field:
    """Where one field lives. ``mask``/``shift`` are ``None`` for byte-string fields."""

    name: str
    offset: int
    size: int
    mask: int | None
    shift: int | None
    default: int | bytes


class Layout:
    """One header: its table, the spec section it follows, and what derives from them.

    Parameters
    ----------
    name:
        Header name, also the prefix of the derived constants (``"BTH"``).
    spec:
        The specification section the table follows.
    table:
        ``(field, struct_format, default)`` entries in wire order.
    """

    def __init__(self, name: str, spec: str, table: tuple):
        self.name = name
        self.spec = spec
        self.table = table
        self._struct = struct.Struct("!" + "".join(fmt for _, fmt, _ in table))
        self.size = self._struct.size
        self.fields: dict[str, Field] = {}
        offset = 0
        for key, fmt, default in table:
            size = struct.calcsize("!" + fmt)
            if isinstance(key, Bits):
                if fmt not in _INT_FORMATS:
                    raise ValueError(
                        f"{name}: bit-fields {key} need an integer format, got {fmt!r}")
                if sum(width for _, width in key) != 8 * size:
                    raise ValueError(f"{name}: bit-fields {key} do not fill their {size}-byte word")
                shift = 8 * size
                for sub, width in key:
                    shift -= width
                    mask = ((1 << width) - 1) << shift
                    self._add(Field(sub, offset, size, mask, shift, (default & mask) >> shift))
            elif fmt in _INT_FORMATS:
                self._add(Field(key, offset, size, (1 << (8 * size)) - 1, 0, default))
            else:
                self._add(Field(key, offset, size, None, None, default))
            offset += size

    def _add(self, field: Field) -> None:
        if field.name in self.fields:
            raise ValueError(f"{self.name}: field {field.name!r} declared twice")
        self.fields[field.name] = field

    def constants(self) -> dict[str, int]:
        """The derived ints, named as described in the module docstring."""
        out = {f"{self.name}_LEN": self.size}
        for f in self.fields.values():
            upper = f.name.upper()
            out[f"{self.name}_OFF_{upper}"] = f.offset
            out[f"{self.name}_SIZE_{upper}"] = f.size
            if f.mask is not None:
                out[f"{self.name}_{upper}_MASK"] = f.mask
                out[f"{self.name}_{upper}_SHIFT"] = f.shift
        return out

    def pack(self, **values) -> bytes:
        """The header's bytes; fields not given take their defaults.

        Raises ``ValueError`` for an unknown field or a value that does not fit its width.
        """
        unknown = set(values) - set(self.fields)
        if unknown:
            raise ValueError(
                f"{self.name} has no field {sorted(unknown)}; its fields are {list(self.fields)}")
        words = []
        for key, fmt, _ in self.table:
            subs = [name for name, _ in key] if isinstance(key, Bits) else [key]
            if fmt not in _INT_FORMATS:
                words.append(self._bytes_value(key, values.get(key, self.fields[key].default)))
                continue
            word = 0
            for sub in subs:
                f = self.fields[sub]
                value = values.get(sub, f.default)
                limit = f.mask >> f.shift
                if not isinstance(value, int) or not 0 <= value <= limit:
                    raise ValueError(
                        f"{self.name}.{sub} = {value!r} does not fit; allowed 0..{limit:#x}")
                word |= value << f.shift
            words.append(word)
        return self._struct.pack(*words)

    def _bytes_value(self, name: str, value) -> bytes:
        size = self.fields[name].size
        if not isinstance(value, (bytes, bytearray)) or len(value) != size:
            raise ValueError(f"{self.name}.{name} = {value!r}; allowed: {size} bytes")
        return bytes(value)

    def unpack(self, buf, offset: int = 0) -> dict:
        """Field name -> value (int, or bytes for byte-string fields) of the header at
        ``buf[offset:]``. Raises ``ValueError`` if fewer than ``size`` bytes remain."""
        if offset < 0 or len(buf) - offset < self.size:
            raise ValueError(
                f"{self.name} needs {self.size} bytes at offset {offset}, buffer has {len(buf)}")
        out = {}
        for (key, fmt, _), word in zip(self.table, self._struct.unpack_from(buf, offset)):
            if isinstance(key, Bits):
                for sub, _ in key:
                    f = self.fields[sub]
                    out[sub] = (word & f.mask) >> f.shift
            else:
                out[key] = word
        return out
