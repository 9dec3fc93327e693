/* kdtree's tile configurations: the one table of them, an X-macro list. Whoever includes it defines
 * KDTREE_TILE_CONFIG first and reads one row per configuration:
 *
 *   KDTREE_TILE_CONFIG(NAME, ID, Type, BM, BN, STAGES, NO, QREG, PIPELINE, Q_DIRECT, SMEM_LIMIT)
 *     NAME        enum kdtree_config's KDTREE_CONFIG_<NAME> (kdtree_verify.h); in Python and KDTREE_KERNEL_CONFIG, the
 *                 name in lower case
 *     ID          its value in the C ABI
 *     Type        the kernel's tile configuration type, Cfg<BM, BN, STAGES, NO, QREG, PIPELINE, Q_DIRECT>
 *                 (src/tile_config.cuh says what each argument is; the KDTREE_* knobs are tuning builds' -D flags)
 *     SMEM_LIMIT  shared memory per block, in bytes, of the GPUs it is for (a static_assert holds its size to it)
 *
 * Rows are in the order of the automatic choice: kdtree.kernel plans in the first configuration whose shared memory
 * the GPU allows per block. kdtree/config.py's TILE_CONFIGS lists NAME and ID again, in this order, for Python (the
 * setting's allowed values, the binding, the automatic choice); tests/kernel_build/test_kernel_abi.py holds the two equal.
 * Used by kdtree_verify.h (the enum) and src/tile_config.cuh (the types, their checks and the dispatch). */

/* sm_90 / sm_100: 12 warps (168 registers each), 191 KB shared, tile by tile. */
KDTREE_TILE_CONFIG(WIDE, 1, Wide, /*BM=*/64, /*BN=*/32, /*STAGES=*/3, /*NO=*/8, /*QREG=*/KDTREE_WIDE_QREG,
                   /*PIPELINE=*/false, /*Q_DIRECT=*/false, /*SMEM_LIMIT=*/232448)
/* sm_120: wide's 64 rows and 12 warps in 99 KB: 16-key tiles, and only the ldmatrix part of Q in shared memory. */
KDTREE_TILE_CONFIG(COMPACT, 2, Compact, /*BM=*/64, /*BN=*/16, /*STAGES=*/KDTREE_COMPACT_STAGES, /*NO=*/8,
                   /*QREG=*/KDTREE_COMPACT_QREG, /*PIPELINE=*/KDTREE_COMPACT_PIPELINE, /*Q_DIRECT=*/true,
                   /*SMEM_LIMIT=*/101376)
