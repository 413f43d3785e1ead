"""A second, independent decoder of codec v2 payloads, written from docs/FORMAT.md alone (plain
Python, slow, small tensors only). tests/test_codec.py checks that it rebuilds what the real
decoder rebuilds, so the specification stays complete and true."""

from __future__ import annotations

import zstandard

FLOATS = {"BF16": (16, 7, 8), "F16": (16, 10, 5), "F32": (32, 23, 8)}
SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class Bad(Exception):
    pass


class Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u8(self) -> int:
        if self.pos >= len(self.data):
            raise Bad("truncated")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self, limit: int) -> int:
        value = 0
        for i in range(9):
            b = self.u8()
            value |= (b & 0x7F) << (7 * i)
            if b < 0x80:
                if value > limit:
                    raise Bad("varint above its limit")
                return value
        raise Bad("varint longer than 9 bytes")

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise Bad("truncated")
        self.pos += n
        return self.data[self.pos - n : self.pos]


class Bits:
    def __init__(self, data: bytes, nbits: int) -> None:
        self.data, self.nbits, self.pos = data, nbits, 0

    def bit(self) -> int:
        if self.pos >= self.nbits:
            raise Bad("bitstream exhausted")
        b = (self.data[self.pos // 8] >> (self.pos % 8)) & 1
        self.pos += 1
        return b

    def field(self, k: int) -> int:
        return sum(self.bit() << i for i in range(k))

    def golomb(self, m: int) -> int:
        b = (m - 1).bit_length()  # ceil(log2 m)
        cutoff = (1 << b) - m
        q = 0
        while self.bit() == 0:
            q += 1
            if q > 40:
                raise Bad("Golomb quotient above 40")
        if q == 40:
            length = self.field(6)
            if length > 62:
                raise Bad("escape length")
            return self.field(length)
        if m == 1:
            return q
        v = self.field(b - 1)
        if v < cutoff:
            return q * m + v
        return q * m + cutoff + 2 * (v - cutoff) + self.bit()


def decode(old: bytes | None, payload: bytes, dtype: str) -> bytes:
    """The new tensor bytes; raises Bad for anything the specification rejects."""
    rd = Bytes(payload)
    if rd.take(4) != b"DSC2":
        raise Bad("magic")
    method, size, flags = rd.u8(), rd.u8(), rd.u8()
    if size != SIZES[dtype] or flags not in (0, 1) or (flags == 1 and method != 1):
        raise Bad("header")
    nbytes = len(old) if old is not None else None
    n = rd.varint((nbytes // size) if nbytes is not None else 2**62)
    if method == 3:
        if flags:
            raise Bad("split flags")
        count = rd.varint(min(n, 65536))
        if count < 2:
            raise Bad("split parts")
        table = [(rd.varint(n), rd.varint(len(payload))) for _ in range(count)]
        if sum(e for e, _ in table) != n or any(e == 0 for e, _ in table):
            raise Bad("split elements")
        if sum(length for _, length in table) != len(payload) - rd.pos:
            raise Bad("split lengths")
        parts = [rd.take(length) for _, length in table]
        for part in parts:
            if len(part) < 8 or part[:4] != b"DSC2" or part[4] not in (0, 1, 2) or part[5] != size:
                raise Bad("split part")
        out, first = bytearray(), 0
        for (elements, _), part in zip(table, parts):
            before = old[first * size : (first + elements) * size] if old is not None else None
            if before is None and part[4] != 0:
                raise Bad("split part needs the previous tensor")
            rebuilt = decode(before, part, dtype)
            if len(rebuilt) != elements * size:
                raise Bad("split part size")
            out += rebuilt
            first += elements
        return bytes(out)
    if method in (0, 2):
        planes = []
        for _ in range(size):
            coder, stored = rd.u8(), rd.take(rd.varint(2**62))
            if coder == 0:
                plane = stored
            elif coder == 1:
                if zstandard.frame_content_size(stored) != n:
                    raise Bad("zstd size")
                plane = zstandard.ZstdDecompressor().decompress(stored, max_output_size=n)
            else:
                raise Bad("coder")
            if len(plane) != n:
                raise Bad("plane length")
            planes.append(plane)
        if rd.pos != len(payload):
            raise Bad("trailing bytes")
        out = bytearray(n * size)
        for i in range(n):
            for j in range(size):
                out[i * size + j] = planes[j][i] ^ (old[i * size + j] if method == 2 else 0)
        return bytes(out)
    if method != 1 or dtype not in FLOATS or old is None:
        raise Bad("method")
    width, mant, exp_bits = FLOATS[dtype]
    sign, full = 1 << (width - 1), (1 << width) - 1
    old_bits = [int.from_bytes(old[i * size : (i + 1) * size], "little") for i in range(n)]

    n_changed = rd.varint(n)
    row_len = rd.varint(max(n, 1))
    if row_len < 1:
        raise Bad("row_len")
    n_rows = -(-n // row_len)
    row_mode = rd.u8()
    if row_mode > 2:
        raise Bad("row_mode")
    n_row_events = row_m = 0
    if row_mode:
        n_row_events, row_m = rd.varint(n_rows), rd.varint(2**40)
        if row_m < 1:
            raise Bad("row_m")
    k_classes = rd.varint(1 << exp_bits)
    classes = []
    hi = -1
    for _ in range(k_classes):
        lo = hi + 1 + rd.varint(2**62)
        hi = lo + rd.varint(2**62)
        if hi >= 1 << exp_bits:
            raise Bad("class range")
        cflags = rd.u8()
        if cflags > 5:
            raise Bad("cflags")
        dense, mode = cflags & 1, cflags >> 1
        n_events = rd.varint(n)
        n_class_changes = rd.varint(n) if dense else n_events
        m = rd.varint(2**40)
        if m < 1 or n_class_changes < 1:
            raise Bad("class counts")
        mag_m, freqs = 0, []
        if mode == 1:
            mag_m = rd.varint(2**40)
            if mag_m < 1:
                raise Bad("mag_m")
        elif mode == 2:
            t = rd.varint(64)
            if t < 2:
                raise Bad("T")
            freqs = [rd.varint(4096) for _ in range(t)]
            if sum(freqs) != 4096:
                raise Bad("table sum")
        classes.append(
            {
                "lo": lo,
                "hi": hi,
                "dense": dense,
                "mode": mode,
                "n_events": n_events,
                "n_changes": n_class_changes,
                "m": m,
                "mag_m": mag_m,
                "freqs": freqs,
            }
        )
    if sum(c["n_changes"] for c in classes) != n_changed or sum(c["n_events"] for c in classes) > n:
        raise Bad("class sums")
    nbits = rd.varint(8 * len(payload))
    if sum(c["n_events"] for c in classes) + n_row_events > nbits:
        raise Bad("more codes than bits")
    bits = Bits(rd.take(-(-nbits // 8)), nbits)
    model = None
    if flags == 1:
        model = _sign_model(rd, n, n_rows, row_len, n_changed)
        signs = model["flips"]
    else:
        signs = rd.take(-(-n_changed // 8))
    rans_len = rd.varint(2**62)
    if rans_len % 2 or rans_len != len(payload) - rd.pos:
        raise Bad("rans length")
    words = [int.from_bytes(rd.take(2), "little") for _ in range(rans_len // 2)]
    if (rans_len > 0) != any(c["mode"] == 2 for c in classes):
        raise Bad("rans presence")
    if n_changed == 0:
        if classes or row_mode or nbits:
            raise Bad("empty delta")
        return bytes(old)

    # rows
    dead = [False] * n_rows
    r = -1
    for _ in range(n_row_events):
        r += bits.golomb(row_m) + 1
        if r >= n_rows:
            raise Bad("row past the end")
        dead[r] = True
    if row_mode == 2:
        dead = [not d for d in dead]
    # event ranks per class
    for c in classes:
        ranks, rank = [], -1
        for _ in range(c["n_events"]):
            rank += bits.golomb(c["m"]) + 1
            ranks.append(rank)
        c["events"] = set(ranks)
        c["last_event"] = rank
    # magnitudes (bitstream part and rANS), in values order
    rans = Rans(words) if words else None
    steps = []
    k = 0
    for c in classes:
        c["first_value"] = k
        for _ in range(c["n_changes"]):
            if c["mode"] == 0:
                mag = 0
            elif c["mode"] == 1:
                mag = bits.golomb(c["mag_m"])
            else:
                s = rans.symbol(c["freqs"])
                mag = s
                if s == len(c["freqs"]) - 1:
                    length = bits.field(6)
                    if length > 62:
                        raise Bad("escape length")
                    mag += bits.field(length)
            if mag >= full:
                raise Bad("magnitude")
            negative = (signs[k // 8] >> (k % 8)) & 1
            steps.append(-(mag + 1) if negative else mag + 1)
            k += 1
    if rans:
        rans.end()
    if bits.pos != nbits:
        raise Bad("bitstream length")
    # apply
    new_bits = list(old_bits)
    rank = [0] * len(classes)
    used = [0] * len(classes)
    for i in range(n):
        if dead[i // row_len] if row_mode else False:
            continue
        e = (old_bits[i] >> mant) & ((1 << exp_bits) - 1)
        ci = next((j for j, c in enumerate(classes) if c["lo"] <= e <= c["hi"]), None)
        if ci is None:
            continue
        c = classes[ci]
        is_event = rank[ci] in c["events"]
        rank[ci] += 1
        if is_event == bool(c["dense"]):
            continue  # unchanged
        if used[ci] >= c["n_changes"]:
            raise Bad("more changes than announced")
        step = steps[c["first_value"] + used[ci]]
        used[ci] += 1
        if model is not None and model["negative"](i // row_len, i % row_len):
            step = -step  # the flip bit says "opposite of the prediction"
        u = old_bits[i]
        key = (u | sign) if not u & sign else full - u
        key += step
        if not 0 <= key <= full:
            raise Bad("key out of range")
        new_bits[i] = key ^ sign if key >= sign else full - key
    for ci, c in enumerate(classes):
        if used[ci] != c["n_changes"] or c["last_event"] >= rank[ci]:
            raise Bad("class not fully used")
    return b"".join(b.to_bytes(size, "little") for b in new_bits)


class Rans:
    """A rANS stream (FORMAT.md, "rANS"), with every check it names."""

    def __init__(self, words: list[int]) -> None:
        if len(words) < 2:
            raise Bad("rans")
        self.words, self.x, self.wi = words, words[0] + 65536 * words[1], 2
        if self.x < 1 << 16:
            raise Bad("rans state")

    def symbol(self, freqs: list[int]) -> int:
        if freqs is not getattr(self, "freqs", None):  # cum_s of this table, computed once
            self.freqs, self.cum = freqs, [sum(freqs[:s]) for s in range(len(freqs) + 1)]
        cum = self.cum
        j = self.x % 4096
        s = next(s for s in range(len(freqs)) if cum[s] <= j < cum[s + 1])
        self.x = freqs[s] * (self.x // 4096) + j - cum[s]
        if self.x < 1 << 16:
            if self.wi >= len(self.words):
                raise Bad("rans words")
            self.x, self.wi = self.x * 65536 + self.words[self.wi], self.wi + 1
        return s

    def end(self) -> None:
        if self.x != 1 << 16 or self.wi != len(self.words):
            raise Bad("rans end")


def _rans_symbols(words: list[int], freqs: list[int], count: int) -> list[int]:
    """``count`` symbols of a rANS stream that must end with them."""
    rans = Rans(words)
    out = [rans.symbol(freqs) for _ in range(count)]
    rans.end()
    return out


def _sign_model(rd: Bytes, n: int, n_rows: int, row_len: int, n_changed: int) -> dict:
    """The "Predicted signs" section: the flip bits (as sign bytes) and the prediction."""
    if row_len % 64 or n_rows < 2 or n_rows * row_len != n or n_changed < 1:
        raise Bad("sign model shape")
    model = rd.u8()
    rank, bits = model & 15, model >> 4
    if not 1 <= rank <= 3 or bits not in (1, 2) or (bits == 1 and rank != 1):
        raise Bad("sign model")
    levels = [[1, 1, 1, 1] for _ in range(rank)]
    if bits == 2:
        levels = [[rd.u8() for _ in range(4)] for _ in range(rank)]
        if any(v == 0 for lv in levels for v in lv):
            raise Bad("level 0")

    def entries(count: int, first_level: int) -> list[list[int]]:
        raw = rd.take(-(-count * rank * bits // 8))
        stream = Bits(raw, len(raw) * 8)
        out = []
        for _ in range(count):
            row = []
            for t in range(rank):
                field = stream.field(bits)
                mag = 1 if bits == 1 else levels[t][first_level + (field >> 1)]
                row.append(-mag if field & 1 else mag)
            out.append(row)
        return out

    rows, cols = entries(n_rows, 0), entries(row_len, 2)
    f4 = [rd.varint(4096) for _ in range(16)]
    if sum(f4) != 4096:
        raise Bad("flip table sum")
    f8 = [max(1, (f4[i % 16] * f4[i // 16] + 2048) // 4096) for i in range(256)]
    top = f8.index(max(f8))
    f8[top] += 4096 - sum(f8)
    if f8[top] < 1:
        raise Bad("flip byte table")
    n_bytes = -(-n_changed // 8)
    flips = bytearray(n_bytes)
    for k in range(4):
        flip_len = rd.varint(2**62)
        if flip_len % 2 or flip_len < 4 or flip_len > len(rd.data) - rd.pos:
            raise Bad("flip length")
        words = [int.from_bytes(rd.take(2), "little") for _ in range(flip_len // 2)]
        for i, symbol in enumerate(_rans_symbols(words, f8, len(range(k, n_bytes, 4)))):
            flips[k + 4 * i] = symbol
    return {"flips": bytes(flips), "negative": lambda i, j: sum(a * b for a, b in zip(rows[i], cols[j])) < 0}
