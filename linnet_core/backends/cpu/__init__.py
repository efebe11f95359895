"""Linnet's own CPU kernels (csrc/*.cpp), built once per environment, and the Python side of each.

One job per module: `build` picks the ISA level and compiles and imports the shared object,
`selfcheck` holds it against the generated step's own ops, `extension` hands out the checked build
and its thin wrappers, `step_kernels` carries the small-op kernels a step receives, `linears` wraps
linear weights.

Every kernel's arithmetic is written once, against `csrc/vec.h`: a float vector of the level's width
and the few operations the kernels use (loads and stores of float32/bfloat16/float16 rounding as
.to() does, FMA, reductions, exp, and the 8-row int8 block sums). The same sources are compiled once
per level with that level's flags, and the highest level this CPU runs is loaded, as ATen and ggml
dispatch (`LINNET_CPU_LEVEL` forces a lower one):

- `avx512-amx`: `avx512` plus AMX's bf16 tiles (Intel Xeon since Sapphire Rapids), for bf16 prompts;
- `avx512`: AVX-512 F/BW/VL with BF16 and VNNI (Intel since Cooper Lake, AMD since Zen 4);
- `avx2-vnni`: AVX2 + FMA + F16C with AVX-VNNI (Intel client CPUs since Alder Lake);
- `avx2`: AVX2 + FMA + F16C, the x86-64 floor (AMD before Zen 4, older Intel);
- `neon-i8mm`, `neon-dotprod-bf16`, `neon-dotprod`, `neon`: ARM64 with i8mm (usdot: the int8 block
  sums as VNNI takes them), bf16 (bfdot) and the dot-product extension (Graviton 3 and later have
  all three; Ampere Altra dotprod), or plain NEON.

The linears split their rows between threads as the threads come free (`csrc/dynamic_for.h`), not in
equal halves: a shared machine's cores drift apart; a decode's takes shrink as the rows run out, so each
thread reads a few long streams that the hardware prefetcher follows. The kernels:

- `gemv_bf16`, `gemv_f16`, `gemv_f32`: matrix-vector products for a few token rows (decode steps and
  speculative checks; 8 rows a pass, each row's sums its own). At batch 1 a decode step reads every weight once; these stream it one weight row at a time (a plain read's
  speed), bfloat16 with the ISA's pair dot product as ggml's (AVX-512 BF16, ARM bf16; widened
  elsewhere), float16 widened to float32 in registers.
- `quant_linear`: activations times weights held as GGUF q8_0 / q4_0 blocks (quant.py), as llama.cpp
  multiplies them: activations rounded to int8 blocks, int32 block sums by VNNI (AVX2's vpmaddubsw, ARM's sdot), over
  blocks repacked once at load (8 rows interleaved). A float32 path (dequantizing in registers,
  row by row) streamed q4_0 at 15.6 GB/s on this machine class; this one 36-47, a plain read of
  memory's speed (`bench/quant_gemv.py`), and prompts run 2.7x faster than float32 F.linear.
- `gemm_f16`, `gemm_bf16`: 16-bit prompts in register tiles, the weights widened in registers as
  llama.cpp's tinyBLAS does (2x MKL's float32 GEMM over widened copies, ~7x PyTorch's CPU float16
  GEMM; bf16's where the ISA has no bf16 dot, whose oneDNN GEMM there was ~6x slower).
- `repack_rows8_float`, `packed_float_linear`: float16, float32 and bfloat16 weights copied once at
  load in blocks of 4 rows interleaved, decode's GEMV loading x once for a block's rows (~16% faster
  than the row kernel at Qwen3-4B's shapes), and the prompt tiles one block, one stream, each.
  bfloat16 goes by AVX-512 BF16's pair dot, one instruction for 16 of x against two rows
  (`packed_bf16_dot()`; on a Zen 5 one-row decode as fast as the row GEMV, five rows 1.16x a
  one-row pass where the row GEMV took 1.40x, prompts 0.90-0.94x oneDNN's GEMM), widened as float16 where the ISA has no
  bf16 dot; on `avx512-amx` its prompts run on AMX's tiles (`amx_linear`: each panel of 32 rows turned
  into tiles once, 0.99-1.15x oneDNN's AMX GEMM), where the row layout kept for oneDNN had decode at
  0.85x. It stays in the row layout where the dot spans one row (ARM) or the CPU has AMX the build
  lacks (a forced lower level: oneDNN's bf16 prompts run on it). A head tied to the token table keeps
  the row layout and `row_linear`.
- `ops.cpp`: the kernels as C++ operators (`torch.ops.linnet_kernels.*`) for compiled steps, and
  `row_linear`, the row layout's choice between the GEMV and a GEMM.
- `decode_attention`: one-token queries over the KV cache in place (float32, float16, bfloat16),
  where the generic path copies each row's keys and values and calls SDPA (~6x slower at
  Qwen3-4B's shapes, measured on a cold cache as in a step).
- `step_ops.cpp`: RMSNorm, rope and the cache write, one call each for an eager step, where the
  emitted ATen ops are 3-8 calls (~1 ms of a 5.7 ms decode step at the 191M Qwen3's shape), and
  argmax (ATen's reads 16-bit logits one at a time: ~120 us at a 32000-token vocabulary); silu,
  silu * up and the residual add + norm for the eager step's fused groups (torch_groups).
- `attention_block.cpp`: a decode step's attention block (split into heads, q/k norms, rope, cache
  write, decode attention) in one call composing the kernels above.
Built with torch's C++ extension builder (g++ and ninja, ~100 s on 2 cores) into ~/.cache/linnet/kernels (or
$LINNET_KERNELS), keyed by the level, its flags, the PyTorch install and the sources, and checked
against the generic ops; below the floor (or with no compiler) the generic ops serve as before, said
once. `LINNET_DECODE_KERNELS=0` turns them off.
"""
