#!/usr/bin/env python3
"""Writes kernels/tests/fixtures/dequant.txt: random blocks of each block type Warden reads
beside the 32-element ones it had first (Q5_0, Q5_1 and the K-quants), dequantized by an
independent implementation, the `gguf` Python package's `gguf.quants.dequantize`. The Rust
test kernels/tests/dequant_vectors.rs checks Warden's scalar dequantizer against them bit for
bit.

Deterministic (seed 20261206). Needs `numpy` and `gguf` (pip install numpy gguf==0.19.0).

File format, per type: a line `TYPE NAME ID BLOCKS`, a line with the blocks' bytes in hex, a
line with each value's f32 bits in hex, space-separated.
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# (type, block bytes, offsets of its f16 scale fields)
TYPES = [
    (T.Q5_0, 22, [0]),
    (T.Q5_1, 24, [0, 2]),
    (T.Q2_K, 84, [80, 82]),
    (T.Q3_K, 110, [108]),
    (T.Q4_K, 144, [0, 2]),
    (T.Q5_K, 176, [0, 2]),
    (T.Q6_K, 210, [208]),
]
BLOCKS = 4


def main() -> None:
    rng = np.random.RandomState(20261206)
    out = Path(__file__).resolve().parent.parent / "kernels/tests/fixtures/dequant.txt"
    lines = []
    for ty, size, f16s in TYPES:
        raw = rng.randint(0, 256, size=(BLOCKS, size)).astype(np.uint8)
        for b in range(BLOCKS):
            for at in f16s:
                # Finite, modest scales of either sign (minimums are often negative).
                v = np.float16(rng.uniform(-0.05, 0.05))
                raw[b, at:at + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
        values = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
        lines.append(f"TYPE {ty.name} {int(ty)} {BLOCKS}")
        lines.append(raw.tobytes().hex())
        lines.append(" ".join(f"{b:08x}" for b in values.view(np.uint32)))
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
