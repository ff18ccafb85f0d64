"""How many distinct keys a check has met, in bounded memory however long the campaign runs.

A worker meets hundreds of new keys a second for days; remembering each one (the schedule once kept every key it met,
about 5 KB of case a key) grows without end. The count is exact up to `EXACT_LIMIT` keys, then a HyperLogLog sketch
(Flajolet et al., 2007) of 2^PRECISION registers estimates it within about 1 % (1.04 / sqrt(2^PRECISION)). It is fed
the 64-bit hash the schedule already takes of each key, so counting costs no second hash of the key (the sketch
libraries, datasketch's HyperLogLog for one, hash bytes of their own on every update: several times the cost).
"""

from __future__ import annotations

import math

EXACT_LIMIT = 1 << 16  # hashes kept exactly (about 4 MB at most), past where the sketch's own estimate is good
PRECISION = 14  # 2^14 one-byte registers: 16 KB, a standard error of about 0.8 %
_REGISTERS = 1 << PRECISION
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # Python's hash of a small int is the int itself: its bits are spread before use


class DistinctCount:
    """The number of distinct hashes added: exact while few, estimated once past EXACT_LIMIT. Adding and counting both
    take constant time (the sketch keeps its harmonic sum up to date as registers rise)."""

    def __init__(self) -> None:
        self.exact: set[int] | None = set()
        self.registers = bytearray(_REGISTERS)
        self.inverse_sum = float(_REGISTERS)  # sum of 2^-register over all registers
        self.zeros = _REGISTERS

    def add(self, key_hash: int) -> None:
        mixed = (key_hash + _MIX) & _MASK  # splitmix64: every bit of the hash moves every bit of the result
        mixed = ((mixed ^ mixed >> 30) * 0xBF58476D1CE4E5B9) & _MASK
        mixed = ((mixed ^ mixed >> 27) * 0x94D049BB133111EB) & _MASK
        mixed ^= mixed >> 31
        index, rest = mixed & (_REGISTERS - 1), mixed >> PRECISION
        rank = 64 - PRECISION - rest.bit_length() + 1  # where the first 1 bit of the rest is, counted from its top
        old = self.registers[index]
        if rank > old:
            self.registers[index] = rank
            self.inverse_sum += 2.0 ** -rank - 2.0 ** -old
            self.zeros -= old == 0
        if self.exact is not None:
            self.exact.add(key_hash)
            if len(self.exact) > EXACT_LIMIT:
                self.exact = None

    def __len__(self) -> int:
        if self.exact is not None:
            return len(self.exact)
        estimate = 0.7213 / (1 + 1.079 / _REGISTERS) * _REGISTERS * _REGISTERS / self.inverse_sum
        if estimate <= 2.5 * _REGISTERS and self.zeros:
            estimate = _REGISTERS * math.log(_REGISTERS / self.zeros)  # linear counting: the better estimate while registers are empty
        return round(estimate)
