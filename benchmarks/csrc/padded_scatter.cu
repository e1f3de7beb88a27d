// Hand-written scatters of 132-byte rows into 148-byte padded rows (16-row blocks at
// random block ids), to bound what any kernel can reach on this layout. Each moves the
// linear rows `src` into the blocks `ids` of `cache`; they differ only in how they treat
// the 16 pad bytes after each row, which belong to no row of the tensor.
//   owned_words            4-byte stores of the owned bytes only (a warp per 128 bytes)
//   owned_words_prefetched the same, a warp per block, each pad's sectors prefetched to L2
//   pad_rewritten          whole 16-byte granules, pad words read back and stored again
//                          (safe only while nothing else writes the pad)
//   pad_zeroed             whole 16-byte granules, pad zeroed (destroys the pad)
#ifndef ROW_BYTES
#define ROW_BYTES 132
#endif
#ifndef ROW_STRIDE
#define ROW_STRIDE 148
#endif
#ifndef BLOCK_ROWS
#define BLOCK_ROWS 16
#endif
#define ROW_WORDS (ROW_BYTES / 4)
#define BLOCK_SPAN (BLOCK_ROWS * ROW_STRIDE)
static_assert(ROW_BYTES % 4 == 0 && ROW_STRIDE % 4 == 0 && BLOCK_SPAN % 16 == 0,
              "rows, strides and block spans are whole words and granules");

struct WarpSlot {
  int lane;
  long first;
  long step;
};

__device__ __forceinline__ WarpSlot warp_slot() {
  long thread = blockIdx.x * (long)blockDim.x + threadIdx.x;
  return {static_cast<int>(threadIdx.x & 31), thread >> 5, ((long)gridDim.x * blockDim.x) >> 5};
}

__device__ __forceinline__ char* block_base(char* cache, const int* ids, long block) {
  return cache + (long)ids[block] * BLOCK_SPAN;
}

extern "C" __global__ void owned_words(const unsigned* __restrict__ src, char* __restrict__ cache,
                                       const int* __restrict__ ids, long nblocks) {
  long words = nblocks * BLOCK_ROWS * ROW_WORDS;
  for (long g = blockIdx.x * (long)blockDim.x + threadIdx.x; g < words;
       g += (long)gridDim.x * blockDim.x) {
    long row = g / ROW_WORDS;
    int word = static_cast<int>(g - row * ROW_WORDS);
    long block = row / BLOCK_ROWS;
    int t = static_cast<int>(row - block * BLOCK_ROWS);
    *reinterpret_cast<unsigned*>(block_base(cache, ids, block) + t * ROW_STRIDE + word * 4) =
        src[g];
  }
}

extern "C" __global__ void owned_words_prefetched(const unsigned* __restrict__ src,
                                                  char* __restrict__ cache,
                                                  const int* __restrict__ ids, long nblocks) {
  WarpSlot w = warp_slot();
  for (long b = w.first; b < nblocks; b += w.step) {
    char* base = block_base(cache, ids, b);
    if (w.lane < BLOCK_ROWS) {  // the pad's first and last byte: the sectors written in part
      const char* pad = base + w.lane * ROW_STRIDE + ROW_BYTES;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(pad));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(pad + (ROW_STRIDE - ROW_BYTES - 1)));
    }
    const unsigned* rows = src + b * BLOCK_ROWS * ROW_WORDS;
    for (int k = w.lane; k < BLOCK_ROWS * ROW_WORDS; k += 32) {
      int t = k / ROW_WORDS, word = k - t * ROW_WORDS;
      *reinterpret_cast<unsigned*>(base + t * ROW_STRIDE + word * 4) = rows[k];
    }
  }
}

// Whole 16-byte granules over each block's span; the pad's words are read back
// (KEEP_PAD) or zeroed.
template <bool KEEP_PAD>
__device__ void whole_granules(const unsigned* __restrict__ src, char* __restrict__ cache,
                               const int* __restrict__ ids, long nblocks) {
  WarpSlot w = warp_slot();
  for (long b = w.first; b < nblocks; b += w.step) {
    uint4* base = reinterpret_cast<uint4*>(block_base(cache, ids, b));
    const unsigned* rows = src + b * BLOCK_ROWS * ROW_WORDS;
    for (int j = w.lane; j < BLOCK_SPAN / 16; j += 32) {
      unsigned v[4];
      unsigned pad_words = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        int offset = j * 16 + k * 4, t = offset / ROW_STRIDE, col = offset - t * ROW_STRIDE;
        bool owned = col < ROW_BYTES;
        v[k] = owned ? rows[t * ROW_WORDS + col / 4] : 0u;
        pad_words |= owned ? 0u : 1u << k;
      }
      if (KEEP_PAD && pad_words) {
        uint4 old = base[j];
        unsigned kept[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = (pad_words >> k) & 1u ? kept[k] : v[k];
      }
      base[j] = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

extern "C" __global__ void pad_rewritten(const unsigned* __restrict__ src, char* __restrict__ cache,
                                         const int* __restrict__ ids, long nblocks) {
  whole_granules<true>(src, cache, ids, nblocks);
}

extern "C" __global__ void pad_zeroed(const unsigned* __restrict__ src, char* __restrict__ cache,
                                      const int* __restrict__ ids, long nblocks) {
  whole_granules<false>(src, cache, ids, nblocks);
}
