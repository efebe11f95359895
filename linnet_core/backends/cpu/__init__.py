"""Linnet's own CPU kernels (csrc/*.cpp), built once per environment, and the Python side of each.

One job per module: `build` compiles and imports the shared object, `selfcheck` holds it against the
generated step's own ops, `extension` hands out the checked build and its thin wrappers,
`step_kernels` carries the small-op kernels a step receives, `linears` wraps linear weights.
The ISA-specific work (which flags, which sources) lives in `build`.

The kernels:

- `gemv_bf16`, `gemv_f16`: 16-bit matrix-vector products for one or two token rows. At batch 1 a
  decode step reads every weight once; these stream it one weight row at a time (a plain read's
  speed), bfloat16 with AVX-512 BF16's dot product as ggml's, float16 widened to float32 in registers.
- `quant_linear`: activations times weights held as GGUF q8_0 / q4_0 blocks (quant.py), as llama.cpp
  multiplies them: activations rounded to int8 blocks, int32 block sums by AVX-512 VNNI, over
  blocks repacked once at load (8 rows interleaved). A float32 path (dequantizing in registers,
  row by row) streamed q4_0 at 15.6 GB/s on this machine class; this one 36-47, a plain read of
  memory's speed (`bench/quant_gemv.py`), and prompts run 2.7x faster than float32 F.linear.
- `gemm_f16`: float16 prompts in register tiles, the weights widened in registers as llama.cpp's
  tinyBLAS does (2x MKL's float32 GEMM over widened copies, ~7x PyTorch's CPU float16 GEMM).
- `repack_f16_rows8`, `packed_half_linear`: float16 weights copied once at load 8 rows interleaved,
  decode's GEMV widening x once for 8 rows in one stream (~16% faster than the row kernel at
  Qwen3-4B's shapes) and the prompt tiles over the same layout; a head tied to the token table
  keeps the row layout and the kernels above.
- `ops.cpp`: the kernels as C++ operators (`torch.ops.linnet_kernels.*`) for compiled steps, and
  `half_linear`, float16's choice between the GEMV and the GEMM.
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
$LINNET_KERNELS), keyed by the PyTorch install and the sources, checked against the generic ops,
and used only where the CPU has AVX-512 BF16 and VNNI; anything missing means the generic ops as before,
never an error. `LINNET_DECODE_KERNELS=0` turns them off.
"""
