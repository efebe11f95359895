// Linnet's CPU kernels as one extension module (see __init__.py), built once per ISA level (build.py).
#include <torch/extension.h>

#include "vec.h"

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemv_f16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemm_f16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemm_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor repack_rows8_float(const torch::Tensor& w);
torch::Tensor packed_float_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               int64_t layer, const torch::Tensor& slots, const torch::Tensor& pos, int64_t window,
                               double scale, double softcap);
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt, int64_t out_features);
torch::Tensor repack_rows8(const torch::Tensor& w, int64_t fmt);
torch::Tensor huge_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype);
torch::Tensor dequant_rows(const torch::Tensor& blocks, const torch::Tensor& ids, int64_t fmt);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor argmax(const torch::Tensor& x);
torch::Tensor silu(const torch::Tensor& x);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& y,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor attention_block(const torch::Tensor& qkv, int64_t heads, int64_t kv_heads,
                              const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                              double eps, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pos,
                              const torch::Tensor& token_slots, torch::Tensor& k_cache, torch::Tensor& v_cache,
                              int64_t layer, int64_t window, double scale);
void write_cache(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& pos, const torch::Tensor& rows,
                 torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t layer);
int64_t register_kernels(const std::vector<std::tuple<int64_t, torch::Tensor, int64_t>>& kernels);
void release_kernels(int64_t session);
int64_t activate(int64_t session);

// The kernels run without the GIL, as torch's own operators do: an engine thread in a kernel lets the
// server's event loop (HTTP, streaming) run meanwhile instead of waiting out every GEMV.
using no_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("level", &linnet::level_name, "the ISA level this build was compiled for");
  m.def("bf16_dot", [] { return linnet::kBf16Dot; }, "whether this level multiplies bfloat16 pairs natively");
  m.def("packed_bf16_dot", [] { return linnet::kPackedBf16Dot; },
        "whether the packed bfloat16 linear multiplies pairs natively (else it widens, as float16)");
  m.def("amx", [] {
    if constexpr (linnet::kAmx) return linnet::amx_usable();
    else return false;
  }, "whether bfloat16 prompts run on AMX's tiles (this level has them and the OS grants them)");
  m.def("gemv_bf16", &gemv_bf16, no_gil(), "bf16 x [M, K] @ w [N, K].T, 8 rows a pass");
  m.def("gemv_f16", &gemv_f16, no_gil(), "f16 x [M, K] @ w [N, K].T, float32 inside, 8 rows a pass");
  m.def("gemm_f16", &gemm_f16, no_gil(), "f16 x [..., K] @ w [N, K].T, register tiles widening w, float32 inside");
  m.def("gemm_bf16", &gemm_bf16, no_gil(), "bf16 x [..., K] @ w [N, K].T, register tiles widening w, float32 inside");
  m.def("bf16_linear", &bf16_linear, no_gil(), "bf16 x [..., K] @ w [N, K].T: the GEMV for a few rows; prompts by the tiles where the ISA has no bf16 dot, else F.linear");
  m.def("row_linear", &row_linear, no_gil(), "16-bit/f32 x [..., K] @ w [N, K].T: the GEMV for 1-2 rows, a GEMM for prompts");
  m.def("gemv_f32", &gemv_f32, no_gil(), "f32 x [M, K] @ w [N, K].T, 8 rows a pass");
  m.def("repack_rows8_float", &repack_rows8_float, no_gil(), "f16/bf16/f32 w [N, K] -> [ceil(N/8), K/16, 8, 16]: 8 rows interleaved (a copy)");
  m.def("packed_float_linear", &packed_float_linear, no_gil(), "f16/f32 x [..., K] @ W.T, W [N, K] from repack_rows8_float: N given");
  m.def("quant_linear", &quant_linear, no_gil(), "float32 x [..., K] @ W.T, W [N, K] as q8_0 (0) / q4_0 (1) blocks from repack_rows8");
  m.def("repack_rows8", &repack_rows8, no_gil(), "GGUF q8_0 (0) / q4_0 (1) blocks [N, K/32*bb] -> 8 rows interleaved per block");
  m.def("huge_page_zeros", &huge_page_zeros, no_gil(), "zeros in 2 MiB pages, as repacked weights are held");
  m.def("dequant_rows", &dequant_rows, no_gil(), "rows ids [...] of q8_0 (0) / q4_0 (1) blocks [V, K/32*bb] -> float32 [..., K]");
  m.def("register_kernels", &register_kernels, "a session's kernels [(kind, weight, format)] for ops.cpp; its id");
  m.def("release_kernels", &release_kernels, "forget a session's kernels");
  m.def("activate", &activate, "make a session's kernels active in this thread (0: none); the previous id");
  m.def("decode_attention", &decode_attention, no_gil(), "one-token queries [B, H, D] over the KV cache in place",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("layer"), py::arg("slots"), py::arg("pos"),
        py::arg("window"), py::arg("scale"), py::arg("softcap") = 0.0);
  m.def("rms_norm", &rms_norm, no_gil(), "x [..., D] / rms(x) * weight [D], the statistics in float32");
  m.def("rope", &rope, no_gil(), "rotate-half rope of x [B, T, H, D] by cos, sin [B, T, rot]");
  m.def("silu", &silu, no_gil(), "x * sigmoid(x) of x [..., D], float32 inside, rounded once");
  m.def("silu_mul", &silu_mul, no_gil(), "silu(gate) * up of gate_up [..., 2F] (the two halves) -> [..., F]");
  m.def("add_rms_norm", &add_rms_norm, no_gil(), "(x + y, rms_norm(x + y, weight)): a residual add and the norm after it");
  m.def("attention_block", &attention_block, no_gil(),
        "a decode step's attention block: qkv [1, N, (H + 2 KV) D] split, normed, rotated, cached, attended -> [1, N, H D]");
  m.def("argmax", &argmax, no_gil(), "x [..., V] -> int64 [...]: the first index of the largest (or of a NaN)");
  m.def("write_cache", &write_cache, no_gil(), "k, v [B, T, KV, D] into caches [L, rows, KV, S, D] at rows, positions [B, T]");
}
