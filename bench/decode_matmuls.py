"""One decoding step's matrix products alone, three ways: ``F.linear`` on the row-major
weights, oneDNN's product on weights packed once (what the eager CPU decoder reads,
``models/packed_linear.py``), and packed with q/k/v and gate/up as one matrix each.

    python bench/decode_matmuls.py [--rows 1,8] [--threads N]

The shapes are SmolLM2-135M's (30 layers: q 576x576, k and v 192x576 each, o 576x576,
gate and up 1536x576 each, down 576x1536; the tied head 49,152x576), fp32, random weights.
Each figure is the median of 20 passes after 3 warm-up passes, in milliseconds per pass:
the floor of a decoding step at that many rows, before attention, norms or sampling.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS, DIM, FFN, KV, VOCAB = 30, 576, 1536, 192, 49152
SEPARATE = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (FFN, DIM), (DIM, FFN)]
GROUPED = [(DIM + 2 * KV, DIM), (DIM, DIM), (2 * FFN, DIM), (DIM, FFN)]


def one_pass(rows: int, shapes, pack: bool, layers: int = LAYERS):
    """A function running every layer's products and the head once, on ``rows`` rows."""
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(rows, n, generator=g) for n in (DIM, FFN)}
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(layers) for o, i in shapes]
    weights.append(torch.randn(VOCAB, DIM, generator=g) * 0.02)
    sizes = [w.shape[1] for w in weights]
    if pack:
        weights = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]

        def run():
            for w, n in zip(weights, sizes):
                torch.ops.mkldnn._linear_pointwise(inputs[n], w, None, "none", [], "")
    else:
        def run():
            for w, n in zip(weights, sizes):
                F.linear(inputs[n], w)
    return run


def median_ms(run) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8", help="rows per product, by commas")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--layers", type=int, default=LAYERS, help="fewer for a quick check")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"ms per pass, {a.threads} threads")
    print("| rows | F.linear, row-major | oneDNN, packed | packed, q/k/v and gate/up as one |")
    print("|---:|---:|---:|---:|")
    for rows in [int(r) for r in a.rows.split(",")]:
        cells = [median_ms(one_pass(rows, SEPARATE, False, a.layers)),
                 median_ms(one_pass(rows, SEPARATE, True, a.layers)),
                 median_ms(one_pass(rows, GROUPED, True, a.layers))]
        print(f"| {rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
