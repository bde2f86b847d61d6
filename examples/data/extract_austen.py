"""Rebuild pride_and_prejudice_1-15.txt from Debian's r-cran-janeaustenr package, byte for byte.

    apt-get download r-cran-janeaustenr            # r-cran-janeaustenr_1.0.0-1_all.deb
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb pkg
    python examples/data/extract_austen.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata

The package keeps each novel as an R character vector (one element per line of the Project
Gutenberg text) in R's lazy-load database (Rdata.rdx: the index, Rdata.rdb: the objects). This
script reads that format with a small reader of R's serialization (XDR, versions 2 and 3) --
no R needed -- takes ``prideprejudice``, joins its lines with newlines and keeps the text from
the start through the end of chapter 15. It prints the SHA-256 recorded in README.md.
"""
import bz2
import gzip
import hashlib
import lzma
import pathlib
import struct
import sys
import zlib

LAST_CHAPTER = 15


class _Reader:
    """R's unserialize for the types a data package holds (no environments or closures)."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer's and minimal reader's R versions
        if version == 3:
            n = self.int()
            self.pos += n  # the native encoding's name

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NULL
            return None
        if kind == 255:  # a reference to an earlier symbol
            index = flags >> 8
            return self.refs[(index or self.int()) - 1]
        if kind == 1:  # symbol
            name = self.item()
            self.refs.append(name)
            return name
        if kind in (2, 6):  # pairlist, language object: a linked list of (tag, value)
            out = {}
            while kind in (2, 6):
                attributes = self.item() if has_attr else None
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            if kind != 254:
                raise ValueError(f"pairlist ends with type {kind}")
            return out
        if kind == 9:  # one string
            n = self.int()
            if n == -1:
                return None
            text = self.data[self.pos:self.pos + n].decode("utf-8")
            self.pos += n
            return text
        if kind in (10, 13):  # logical, integer
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # double
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19):  # character vector, list
            value = [self.item() for _ in range(self.int())]
        else:
            raise ValueError(f"R type {kind} is not supported")
        if has_attr:
            attributes = self.item()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if kind == 19 and names:
                return dict(zip(names, value))
        return value


def _unserialize(blob: bytes, compression) -> object:
    length, body = struct.unpack(">I", blob[:4])[0], blob[4:]
    if compression in (True, 1):
        data = zlib.decompress(body)
    else:  # 2: bzip2, 3: xz, after a one-byte type
        kind, body = body[:1], body[1:]
        data = {b"2": bz2.decompress, b"Z": lzma.decompress, b"0": bytes}[kind](body)
    assert len(data) == length, "damaged database entry"
    return _Reader(data).item()


def lazy_load(prefix: pathlib.Path) -> dict:
    """``{name: object}`` of an R lazy-load database ``prefix.rdx`` / ``prefix.rdb``."""
    index = _Reader(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).item()
    rdb = prefix.with_suffix(".rdb").read_bytes()
    compression = index["compressed"][0]
    return {name: _unserialize(rdb[offset:offset + size], compression)
            for name, (offset, size) in index["variables"].items()}


def main():
    prefix = pathlib.Path(sys.argv[1])
    lines = lazy_load(prefix)["prideprejudice"]
    text = "\n".join(line if line is not None else "" for line in lines)
    end = text.index(f"Chapter {LAST_CHAPTER + 1}\n")
    text = text[:end].rstrip() + "\n"
    out = pathlib.Path(__file__).with_name(f"pride_and_prejudice_1-{LAST_CHAPTER}.txt")
    out.write_text(text, encoding="utf-8")
    print(f"{out}: {len(text.encode())} bytes, {len(text)} characters, "
          f"sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
