// Rotary re-rotation of cached K for blend (docs/KERNELS.md, "Rotary re-rotation").
//
// One thread per (token, head, rotated pair) of one layer's K: it reads the pair, turns
// it by the token's cos/sin (a host-computed float32 table shared with the torch
// reference, kvflow/kernels/rope.py) and writes it back in place. Products and sums use
// the _rn intrinsics so nvcc never contracts them into FMAs: every float32 operation
// rounds exactly as the reference's torch ops do, and the two agree bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kvf_rope {

constexpr unsigned kThreads = 256;

__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load(const float* p) { return *p; }

// One rounding to the cache dtype, to nearest even (as torch's .to(dtype)).
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }

// A token's slot in the cache and the row of its delta in the cos/sin table (the
// plan's int32 [T, 3] rows).
struct Slot {
  int32_t block, offset, row;
};
static_assert(sizeof(Slot) == 12, "Slot mirrors the plan's int32 [T, 3] rows");

// rope: address of element `offset` (the rotary slice's first) of head 0, token 0,
// block 0 of the layer's K; s_block / s_tok / s_head: byte strides. table: float2
// (cos, sin) [deltas, half]. NEOX pairs element i with i + half, else 2i with 2i + 1.
// The host keeps num_tokens * num_heads * half below 2^31.
template <typename T, bool NEOX>
__device__ __forceinline__ void rerotate(char* __restrict__ rope, int64_t s_block, int64_t s_tok,
                                         int64_t s_head, const Slot* __restrict__ slots,
                                         const float2* __restrict__ table, uint32_t num_tokens,
                                         uint32_t num_heads, uint32_t half) {
  const uint32_t item = blockIdx.x * kThreads + threadIdx.x;
  if (item >= num_tokens * num_heads * half) return;
  const uint32_t pair = item % half;
  const uint32_t token_head = item / half;
  const uint32_t head = token_head % num_heads;
  const Slot slot = slots[token_head / num_heads];
  T* row = reinterpret_cast<T*>(rope + slot.block * s_block + slot.offset * s_tok +
                                static_cast<int64_t>(head) * s_head);
  T* first = row + (NEOX ? pair : 2 * pair);
  T* second = row + (NEOX ? pair + half : 2 * pair + 1);
  const float2 cs = table[static_cast<int64_t>(slot.row) * half + pair];
  const float x = load(first), y = load(second);
  store(first, __fsub_rn(__fmul_rn(x, cs.x), __fmul_rn(y, cs.y)));
  store(second, __fadd_rn(__fmul_rn(y, cs.x), __fmul_rn(x, cs.y)));
}

}  // namespace kvf_rope

// One entry point per (cache dtype, pairing): kvf_rope_rerotate_<dtype>_<pairing>.
#define KVF_ROPE_KERNEL(NAME, T, NEOX)                                                        \
  extern "C" __global__ void __launch_bounds__(kvf_rope::kThreads)                          \
      NAME(char* __restrict__ rope, int64_t s_block, int64_t s_tok, int64_t s_head,         \
           const kvf_rope::Slot* __restrict__ slots, const float2* __restrict__ table,       \
           uint32_t num_tokens, uint32_t num_heads, uint32_t half) {                         \
    kvf_rope::rerotate<T, NEOX>(rope, s_block, s_tok, s_head, slots, table, num_tokens,     \
                                num_heads, half);                                            \
  }

KVF_ROPE_KERNEL(kvf_rope_rerotate_bf16_neox, __nv_bfloat16, true)
KVF_ROPE_KERNEL(kvf_rope_rerotate_bf16_gptj, __nv_bfloat16, false)
KVF_ROPE_KERNEL(kvf_rope_rerotate_f16_neox, __half, true)
KVF_ROPE_KERNEL(kvf_rope_rerotate_f16_gptj, __half, false)
KVF_ROPE_KERNEL(kvf_rope_rerotate_f32_neox, float, true)
KVF_ROPE_KERNEL(kvf_rope_rerotate_f32_gptj, float, false)
