// A decode step's attention block in one call, for the eager CPU step: the fused projection's output
// split into heads, q and k normed and rotated, k and v written to the cache, attention over it.
// The emitted block is ~15 Python-level ops a layer (a split, three reshapes, two norms, two ropes,
// the ragged attention's cache write, slicing and kernel call, a reshape): ~0.3 ms a layer at
// Qwen3-4B's shapes, most of it each op's first touch of code and data the weights' stream evicted.
// Here they are the same kernels called from C++, so the result is the emitted lines' exactly.
#include <torch/extension.h>

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void write_cache(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& pos, const torch::Tensor& rows,
                 torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t layer);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               int64_t layer, const torch::Tensor& slots, const torch::Tensor& pos, int64_t window,
                               double scale, double softcap);

// qkv [1, N, (H + 2 KV) D]: N one-token rows, token n of cache row token_slots[0, n] at position
// pos[0, n]; q_norm, k_norm [D] or None; cos, sin [1, N, rot]; caches [L, rows, KV, S, D] -> [1, N, H D].
torch::Tensor attention_block(const torch::Tensor& qkv, int64_t heads, int64_t kv_heads,
                              const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                              double eps, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pos,
                              const torch::Tensor& token_slots, torch::Tensor& k_cache, torch::Tensor& v_cache,
                              int64_t layer, int64_t window, double scale) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(0) == 1 && k_cache.dim() == 5, "attention_block: qkv [1, N, F], caches 5-D");
  const int64_t N = qkv.size(1), D = k_cache.size(4);
  TORCH_CHECK(qkv.size(2) == (heads + 2 * kv_heads) * D && pos.numel() == N && token_slots.numel() == N,
              "attention_block: qkv holds heads + 2 kv_heads of the cache's head size; one slot and position a token");
  // [1, N, H, D], [1, N, KV, D] x 2: views of qkv, as the emitted split and reshapes make them
  auto q = qkv.narrow(2, 0, heads * D).unflatten(2, {heads, D});
  auto k = qkv.narrow(2, heads * D, kv_heads * D).unflatten(2, {kv_heads, D});
  auto v = qkv.narrow(2, (heads + kv_heads) * D, kv_heads * D).unflatten(2, {kv_heads, D});
  if (q_norm) q = rms_norm(q, *q_norm, eps);
  if (k_norm) k = rms_norm(k, *k_norm, eps);
  q = rope(q, cos, sin);
  k = rope(k, cos, sin);
  write_cache(k, v, pos, token_slots, k_cache, v_cache, layer);
  const auto slots = token_slots.reshape({N}), positions = pos.reshape({N});
  return decode_attention(q.reshape({N, heads, D}), k_cache, v_cache, layer, slots, positions, window, scale, 0.0)
      .reshape({1, N, heads * D});
}
