"""Ceiling for the roofline: the rate of mma.sync.m16n8k16 bf16 (fp32 accumulate), the tensor instruction the
kdtree kernel uses (and the one sm_120 has), in TFLOP/s. The measurement is the kernel library's
(src/peak.cu, kdtree.kernel.mma_peak_tflops: 8 independent accumulators per warp, all SMs busy), the same code
`python -m kdtree.bench` runs in the server image.

usage: python3 kernel_build/bench/tuning/mma_peak.py [warps per SM]
With the argument, one block of that many warps per SM (4 = one warp per scheduler: the rate a lone warp reaches).
"""

import sys

from kdtree import kernel

if __name__ == "__main__":
    print(f"{kernel.mma_peak_tflops(int(sys.argv[1]) if len(sys.argv) > 1 else 0):.1f}")
