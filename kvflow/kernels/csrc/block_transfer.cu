// Block-id KV transfer between an engine's paged cache and kvflow's chunk staging buffer.
//
// One kernel for every SPEC format, dtype and layer group: the host planner
// (kvflow/kernels/plan.py) reduces each (layer, kv) to an affine stride descriptor and
// each group to a vector width, and this kernel only moves bytes. The unit of work is a
// warp tile: 32 lanes x UNROLL vectors of one block segment (one block of one (kv, layer)).
// Warp tiles are numbered chunk-major, then group, then (kv, layer), then block, so
// consecutive warps sweep the staging buffer sequentially. Accesses use streaming (.cs)
// loads and stores so the copy does not evict the engine's working set from L2.
#include <cstddef>
#include <cstdint>

namespace kvf {

constexpr unsigned kWarp = 32;
constexpr unsigned kWarpsPerCta = 8;
constexpr unsigned kThreads = kWarp * kWarpsPerCta;

// q = n / d for n < 2^31, by multiply-high and shift (magic numbers from the host).
struct FastDiv {
  uint32_t d, m, s, pad;
};

__device__ __forceinline__ uint32_t divide(const FastDiv& f, uint32_t n) {
  return (__umulhi(n, f.m) + n) >> f.s;
}

struct PlanHeader {
  uint32_t num_groups;
  uint32_t blocks_per_chunk;
  FastDiv tiles_per_chunk;
  FastDiv per_chunk;
  int64_t chunk_bytes;  // bytes of one staging row (one chunk)
};

struct GroupDesc {
  int64_t stage_offset;       // byte offset of the group inside a chunk row
  int64_t layer_stage_bytes;  // staging bytes of one (kv, layer): chunk_tokens * row_bytes
  int64_t seg_bytes;          // bytes of one block of one (kv, layer)
  uint32_t tile_begin;        // first warp tile of the group inside a chunk
  uint32_t tile_end;
  uint32_t first_entry;       // index of the group's first (kv, layer) entry
  uint32_t vec_log2;          // vector width in bytes = 1 << vec_log2
  uint32_t seg_vecs;          // vectors in one segment
  uint32_t contiguous;        // 1: a cache block of one (kv, layer) is one contiguous run
  FastDiv tiles_per_seg;
  FastDiv num_layers;
  FastDiv run_vecs;           // vectors in one contiguous cache run (token row or head)
  FastDiv runs_per_token;     // 1 (token rows contiguous) or num_heads (heads apart)
};

struct Entry {  // one (kv, layer): affine cache address in bytes
  int64_t base;
  int64_t s_block;
  int64_t s_token;
  int64_t s_run;
};

static_assert(sizeof(FastDiv) == 16, "mirror plan.FASTDIV");
static_assert(sizeof(PlanHeader) == 48 && offsetof(PlanHeader, chunk_bytes) == 40,
              "mirror plan.HEADER");
static_assert(sizeof(GroupDesc) == 112 && offsetof(GroupDesc, tile_begin) == 24 &&
                  offsetof(GroupDesc, tiles_per_seg) == 48 &&
                  offsetof(GroupDesc, runs_per_token) == 96,
              "mirror plan.GROUP");
static_assert(sizeof(Entry) == 32, "mirror plan.ENTRY");

template <int VEC> struct VecType;
template <> struct VecType<16> { using T = uint4; };
template <> struct VecType<8> { using T = uint2; };
template <> struct VecType<4> { using T = unsigned int; };
template <> struct VecType<2> { using T = unsigned short; };
template <> struct VecType<1> { using T = unsigned char; };

// Vectors per lane per warp tile: 64 bytes per lane, between 4 and 16 vectors.
template <int VEC> __host__ __device__ constexpr unsigned unroll() {
  return VEC >= 4 ? 64 / VEC : 16;
}

// Cache byte offset of vector v inside a block segment addressed by runs.
template <int VEC>
__device__ __forceinline__ int64_t run_offset(const GroupDesc& g, const Entry& e, uint32_t v) {
  const uint32_t run = divide(g.run_vecs, v);
  const uint32_t w = v - run * g.run_vecs.d;
  const uint32_t token = divide(g.runs_per_token, run);
  const uint32_t head = run - token * g.runs_per_token.d;
  return static_cast<int64_t>(token) * e.s_token + static_cast<int64_t>(head) * e.s_run +
         static_cast<int64_t>(w) * VEC;
}

template <int VEC, bool GATHER, bool CONTIGUOUS>
__device__ __forceinline__ void copy_tile(const GroupDesc& g, const Entry& e, char* cache,
                                          char* stage, uint32_t tile, uint32_t lane) {
  using T = typename VecType<VEC>::T;
  constexpr unsigned U = unroll<VEC>();
  // Vector u of this lane is first + u * kWarp; `left` bounds u without 32-bit wraparound,
  // so contiguous addresses fold into one base register plus immediate offsets.
  const uint32_t first = tile * (kWarp * U) + lane;
  const int32_t left = static_cast<int32_t>(g.seg_vecs) - static_cast<int32_t>(first);
  T* stage_v = reinterpret_cast<T*>(stage) + first;
  T* cache_v = reinterpret_cast<T*>(cache) + first;
  T buf[U];
#pragma unroll
  for (unsigned u = 0; u < U; ++u) {
    if (static_cast<int32_t>(u * kWarp) < left) {
      const T* src;
      if (GATHER) {
        src = CONTIGUOUS ? cache_v + u * kWarp
                         : reinterpret_cast<const T*>(cache + run_offset<VEC>(g, e, first + u * kWarp));
      } else {
        src = stage_v + u * kWarp;
      }
      buf[u] = __ldcs(src);
    }
  }
#pragma unroll
  for (unsigned u = 0; u < U; ++u) {
    if (static_cast<int32_t>(u * kWarp) < left) {
      T* dst;
      if (GATHER) {
        dst = stage_v + u * kWarp;
      } else {
        dst = CONTIGUOUS ? cache_v + u * kWarp
                         : reinterpret_cast<T*>(cache + run_offset<VEC>(g, e, first + u * kWarp));
      }
      __stcs(dst, buf[u]);
    }
  }
}

template <int VEC, bool GATHER>
__device__ __forceinline__ void copy_tile_any(const GroupDesc& g, const Entry& e, char* cache,
                                              char* stage, uint32_t tile, uint32_t lane) {
  if (g.contiguous) {
    copy_tile<VEC, GATHER, true>(g, e, cache, stage, tile, lane);
  } else {
    copy_tile<VEC, GATHER, false>(g, e, cache, stage, tile, lane);
  }
}

template <bool GATHER>
__device__ __forceinline__ void dispatch(const GroupDesc& g, const Entry& e, char* cache,
                                         char* stage, uint32_t tile, uint32_t lane) {
  switch (g.vec_log2) {
    case 4: copy_tile_any<16, GATHER>(g, e, cache, stage, tile, lane); break;
    case 3: copy_tile_any<8, GATHER>(g, e, cache, stage, tile, lane); break;
    case 2: copy_tile_any<4, GATHER>(g, e, cache, stage, tile, lane); break;
    case 1: copy_tile_any<2, GATHER>(g, e, cache, stage, tile, lane); break;
    default: copy_tile_any<1, GATHER>(g, e, cache, stage, tile, lane); break;
  }
}

}  // namespace kvf

// gather != 0: cache -> staging; else staging -> cache. block_ids is [chunks, per_chunk]
// int32, skip is [chunks] int32; num_tiles = chunks * tiles_per_chunk.
extern "C" __global__ void __launch_bounds__(kvf::kThreads)
kvf_block_transfer(const kvf::PlanHeader* __restrict__ hdr,
                   const kvf::GroupDesc* __restrict__ groups,
                   const kvf::Entry* __restrict__ entries,
                   const int32_t* __restrict__ block_ids,
                   const int32_t* __restrict__ skip,
                   char* __restrict__ staging,
                   uint32_t num_tiles,
                   uint32_t gather) {
  using namespace kvf;
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t tile = blockIdx.x * kWarpsPerCta + threadIdx.x / kWarp;
  if (tile >= num_tiles) return;
  const uint32_t chunk = divide(hdr->tiles_per_chunk, tile);
  uint32_t rem = tile - chunk * hdr->tiles_per_chunk.d;
  uint32_t gi = 0;
  while (gi + 1 < hdr->num_groups && rem >= groups[gi].tile_end) ++gi;
  const GroupDesc& g = groups[gi];
  rem -= g.tile_begin;
  const uint32_t seg = divide(g.tiles_per_seg, rem);
  const uint32_t seg_tile = rem - seg * g.tiles_per_seg.d;
  const uint32_t kv_layer = divide(hdr->per_chunk, seg);
  const uint32_t block = seg - kv_layer * hdr->blocks_per_chunk;
  if (block < static_cast<uint32_t>(skip[chunk])) return;
  const Entry& e = entries[g.first_entry + kv_layer];
  const int64_t id = block_ids[static_cast<int64_t>(chunk) * hdr->blocks_per_chunk + block];
  char* cache = reinterpret_cast<char*>(e.base + id * e.s_block);
  char* stage = staging + static_cast<int64_t>(chunk) * hdr->chunk_bytes + g.stage_offset +
                static_cast<int64_t>(kv_layer) * g.layer_stage_bytes +
                static_cast<int64_t>(block) * g.seg_bytes;
  if (gather) {
    dispatch<true>(g, e, cache, stage, seg_tile, lane);
  } else {
    dispatch<false>(g, e, cache, stage, seg_tile, lane);
  }
}
