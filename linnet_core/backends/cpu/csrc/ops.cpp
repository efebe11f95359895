// Linnet's kernels as operators of PyTorch's dispatcher (namespace linnet_kernels), for compiled
// steps: inductor calls a C++ operator in ~5 us, a Python custom op in ~25 (41 calls a decode step
// at the 191M Qwen3's shape: ~1 ms of a 4.7 ms step). A compiled step refers to a weight by its
// handle, its position in the session's kernel list, so compiled code cached on disk stays valid
// in another process; each session registers its weights once, and the thread that runs its step
// makes them the active ones (`activate`) around the call.
#include <torch/extension.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

// Token rows up to which a bf16 or float32-row linear runs Linnet's GEMV (two passes over w at most):
// a decode step's rows, or a speculative check's (k + 1 per row), each row's result its own alone.
constexpr int64_t GEMV_MAX_ROWS = 16;

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemv_f16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemm_f16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemm_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor packed_float_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N);
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt, int64_t out_features);
torch::Tensor quant_gemv_many(const torch::Tensor& x, const std::vector<torch::Tensor>& ws,
                              const std::vector<int64_t>& rows, int64_t fmt, int64_t N);
torch::Tensor dequant_rows(const torch::Tensor& blocks, const torch::Tensor& ids, int64_t fmt);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               int64_t layer, const torch::Tensor& slots, const torch::Tensor& pos, int64_t window,
                               double scale, double softcap);

namespace {

// NONE: a kernel of the Python side (oneDNN's); TABLE: a token table's plain blocks; PACKED: float16 or
// float32 from repack_rows8_float
enum Kind : int64_t { NONE = 0, BF16 = 1, BLOCKS = 2, TABLE = 3, ROW = 4, PACKED = 5 };

struct Kernel {
  int64_t kind;
  torch::Tensor weight;  // bf16 / f16 [N, K], blocks from repack_rows8 or repack_rows8_float, or a table's blocks as stored
  int64_t fmt;           // BLOCKS: quant_linear's format code
};

std::mutex registry_mutex;
std::unordered_map<int64_t, std::vector<Kernel>> registry;  // node-based: a session's vector never moves
int64_t next_session = 1;
thread_local const std::vector<Kernel>* active = nullptr;
thread_local int64_t active_id = 0;

const Kernel& kernel(int64_t handle, std::initializer_list<int64_t> kinds) {
  const bool found = active != nullptr && handle >= 0 && handle < (int64_t)active->size() &&
                     std::find(kinds.begin(), kinds.end(), (*active)[handle].kind) != kinds.end();
  TORCH_CHECK(found, "linnet_kernels: no session's kernel ", handle, " of this kind is active in this thread");
  return (*active)[handle];
}

}  // namespace

// x [..., K] @ w.T for float16 or float32 w [N, K] in its row layout (a head tied to the token table):
// Linnet's GEMV for decode's one or two rows; for float16 prompts its tiled GEMM (2x MKL's float32
// GEMM over widened copies, ~7x PyTorch's CPU float16 GEMM), for float32 ones ATen's; ATen's where K
// is not a multiple of 16.
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& w) {
  if (w.scalar_type() == at::kBFloat16) return bf16_linear(x, w);  // a bf16 weight the packed layout cannot take
  const int64_t K = x.size(-1), rows = x.numel() / K;
  if (K % 16 != 0 || rows == 0 || x.scalar_type() != w.scalar_type()) return at::linear(x, w);
  if (w.scalar_type() == at::kFloat) return rows <= GEMV_MAX_ROWS ? gemv_f32(x, w) : at::linear(x, w);
  return rows <= 2 ? gemv_f16(x, w) : gemm_f16(x, w);
}

// x [..., K] @ w.T for bfloat16 w [N, K]: Linnet's GEMV for up to GEMV_MAX_ROWS bf16 rows (decode,
// speculative checks: each row computed as alone); prompts by F.linear where the ISA multiplies bf16
// (oneDNN's GEMM), else by the widening tiles: oneDNN without it took 2.2 s for a 191M model's
// 128-token prompt on an AVX2 EPYC, 5.8x llama.cpp's time.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t K = x.size(-1), rows = x.numel() / K;
  if (x.scalar_type() != at::kBFloat16 || rows == 0) return at::linear(x, w);
  if (K % 32 == 0 && rows <= GEMV_MAX_ROWS) return gemv_bf16(x.contiguous(), w);
  if (!linnet::kBf16Dot && K % 16 == 0 && w.is_contiguous()) return gemm_bf16(x, w);
  return at::linear(x, w);
}

namespace {

torch::Tensor linear(const torch::Tensor& x, int64_t handle, int64_t out_features, const c10::optional<torch::Tensor>& bias) {
  const Kernel& k = kernel(handle, {BLOCKS, BF16, ROW, PACKED});
  torch::Tensor y;
  if (k.kind == BLOCKS) {
    y = quant_linear(x, k.weight, k.fmt, out_features);
  } else if (k.kind == PACKED) {
    y = packed_float_linear(x, k.weight, out_features);
  } else if (k.kind == ROW) {
    y = row_linear(x, k.weight);
  } else {
    y = bf16_linear(x, k.weight);
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// Up to this many (token, expert) pairs, the experts run as GEMVs in one pass per stage (decode's few
// rows); past it each chosen expert's matrices run once over all its tokens (a prompt's GEMMs).
constexpr int64_t GEMV_PAIRS = 64;

// The GGUF block format all the chosen experts' kernels share (the GEMV pass's kind), or -1.
int64_t shared_block_format(std::initializer_list<int64_t> bases, const std::vector<int64_t>& chosen) {
  int64_t fmt = -1;
  for (int64_t base : bases)
    for (int64_t e : chosen) {
      const Kernel& k = kernel(base + e, {BLOCKS, BF16, ROW, PACKED});
      if (k.kind != BLOCKS || (fmt >= 0 && k.fmt != fmt)) return -1;
      fmt = k.fmt;
    }
  return fmt;
}

// x [..., H] through the experts `weights` [..., E] chose (nonzero), summed by weight: down_e(act(gate_e x)
// * up_e x); act 0 silu, 1 gelu, 2 gelu-tanh; each expert `width` wide. Expert e's kernels are handles
// gate + e, up + e, down + e (a stack packed one kernel per expert). Only the chosen experts run, so a
// decode step reads just their weights, and the dozens of small calls a Python loop made a layer are one.
torch::Tensor experts(const torch::Tensor& x, const torch::Tensor& weights, int64_t gate, int64_t up, int64_t down,
                      int64_t width, int64_t act) {
  const int64_t H = x.size(-1), E = weights.size(-1);
  TORCH_CHECK(x.numel() / H == weights.numel() / E, "linnet_kernels::experts: x and weights differ in tokens");
  const auto flat = x.reshape({-1, H});
  const auto w = weights.reshape({-1, E}).to(at::kFloat).contiguous();
  auto out = torch::zeros_like(flat);
  const float* wp = w.data_ptr<float>();
  const int64_t N = w.size(0);
  std::vector<int64_t> tokens, chosen;  // the (token, expert) pairs, by expert
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < N; ++t)
      if (wp[t * E + e] != 0.0f) tokens.push_back(t), chosen.push_back(e);
  const bool few = !tokens.empty() && (int64_t)tokens.size() <= GEMV_PAIRS;
  const int64_t fmt = few ? shared_block_format({gate, up, down}, chosen) : -1;
  if (fmt >= 0) {  // decode: each pair's three products as GEMVs, all pairs' in one pass per stage
    const int64_t P = tokens.size();
    std::vector<torch::Tensor> first;
    std::vector<int64_t> rows;
    for (int64_t base : {gate, up})
      for (int64_t p = 0; p < P; ++p)
        first.push_back(kernel(base + chosen[p], {BLOCKS}).weight), rows.push_back(tokens[p]);
    auto gu = quant_gemv_many(flat, first, rows, fmt, width);  // [2P, F]: the gates, then the ups
    auto g = gu.narrow(0, 0, P), u = gu.narrow(0, P, P);
    auto h = (act == 0 ? at::silu(g) : at::gelu(g, act == 2 ? "tanh" : "none")) * u;
    std::vector<torch::Tensor> second;
    std::vector<int64_t> own(P);
    for (int64_t p = 0; p < P; ++p) second.push_back(kernel(down + chosen[p], {BLOCKS}).weight), own[p] = p;
    auto y = quant_gemv_many(h, second, own, fmt, H);  // [P, H]
    std::vector<float> scale(P);
    for (int64_t p = 0; p < P; ++p) scale[p] = wp[tokens[p] * E + chosen[p]];
    y.mul_(torch::tensor(scale).unsqueeze(1));
    out.index_add_(0, torch::tensor(tokens, torch::kLong), y);  // each token's experts in expert order
    return out.reshape(x.sizes());
  }
  for (int64_t e = 0; e < E; ++e) {  // a prompt: each chosen expert once over all its tokens, in expert order
    std::vector<int64_t> rows;
    for (int64_t t = 0; t < N; ++t)
      if (wp[t * E + e] != 0.0f) rows.push_back(t);
    if (rows.empty()) continue;
    const bool all = (int64_t)rows.size() == N;
    auto index = torch::tensor(rows, torch::kLong);
    auto xe = all ? flat : flat.index_select(0, index);
    auto g = linear(xe, gate + e, width, c10::nullopt);
    auto u = linear(xe, up + e, width, c10::nullopt);
    auto h = (act == 0 ? at::silu(g) : at::gelu(g, act == 2 ? "tanh" : "none")) * u;
    auto y = linear(h, down + e, H, c10::nullopt);
    auto scale = w.index_select(0, index).select(1, e).unsqueeze(1).to(y.scalar_type());
    y.mul_(scale);
    if (all) out.add_(y);
    else out.index_add_(0, index, y);
  }
  return out.reshape(x.sizes());
}

}  // namespace

// The session's kernels in handle order: (kind, weight or an undefined tensor, format) each; its id.
int64_t register_kernels(const std::vector<std::tuple<int64_t, torch::Tensor, int64_t>>& kernels) {
  std::vector<Kernel> list;
  for (const auto& [kind, weight, fmt] : kernels) list.push_back({kind, weight, fmt});
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_session, std::move(list));
  return next_session++;
}

void release_kernels(int64_t session) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (active_id == session) active = nullptr, active_id = 0;
  registry.erase(session);
}

// Make `session` (0: none) the active one in this thread; returns the one it replaces.
int64_t activate(int64_t session) {
  const int64_t previous = active_id;
  if (session == 0) {
    active = nullptr;
  } else {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(session);
    TORCH_CHECK(it != registry.end(), "linnet_kernels: no session ", session);
    active = &it->second;
  }
  active_id = session;
  return previous;
}

TORCH_LIBRARY(linnet_kernels, m) {
  m.def("linear(Tensor x, int handle, int out_features, Tensor? bias=None) -> Tensor");
  m.def("embedding(Tensor ids, int handle, int width) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, int layer, Tensor slots, Tensor pos, "
        "int window, float scale, float softcap=0.0) -> Tensor");
  m.def("experts(Tensor x, Tensor weights, int gate, int up, int down, int width, int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(linnet_kernels, CPU, m) {
  m.impl("linear", &linear);
  m.impl("experts", &experts);
  m.impl("embedding", [](const torch::Tensor& ids, int64_t handle, int64_t width) {
    const Kernel& k = kernel(handle, {TABLE});
    auto rows = dequant_rows(k.weight, ids, k.fmt);
    TORCH_CHECK(rows.size(-1) == width, "linnet_kernels::embedding: the table is ", rows.size(-1), " wide, not ", width);
    return rows;
  });
  m.impl("decode_attention", [](const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                int64_t layer, const torch::Tensor& slots, const torch::Tensor& pos, int64_t window,
                                double scale, double softcap) {
    return decode_attention(q.contiguous(), k_cache, v_cache, layer, slots, pos, window, scale, softcap);
  });
}
