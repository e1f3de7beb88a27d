// Block-id KV transfer between an engine's paged cache and kvflow's chunk staging buffer.
//
// One kernel for every format (docs/KERNELS.md), dtype and layer group: the host planner
// (kvflow/kernels/plan.py) reduces each (layer, kv) to an affine stride descriptor and
// each group to a vector width and a vector order, and this kernel only moves bytes.
//
// Work unit: a warp tile = 32 lanes x UNROLL vectors (x the group's iters) of one segment, i.e. one
// block of one (kv, layer). Warp tiles are numbered chunk-major, then group, then
// (kv, layer), then block, so consecutive warps sweep the staging buffer in order.
// Inside a segment vector v sits at run r = v / run_vecs, word w = v % run_vecs, and the
// run splits into (outer, inner) = (r / inner, r % inner); each side adds
// outer * s_outer + inner * s_inner + w * VEC. The planner orders vectors so the
// destination is linear (coalesced full-sector writes) where it can, and a linear side
// skips the divisions. Loads and stores cache normally (.cs, evict-first, is a build
// option: it cost 1-5% of bandwidth and spared an L2-resident neighbour nothing measurable).
//
// A *staged* group (narrow vectors, linear 16-byte aligned destination: 132-byte int8
// heads, odd-sized heads, padded rows read) is moved in 16-byte granules of the
// destination instead: each granule's bytes come from at most two source runs, each read
// as aligned 16-byte granules and funnel-shifted into place, so loads and stores are
// 16 bytes wide whatever the layout's alignment.
#include <cstddef>
#include <cstdint>

#ifndef KVF_LANE_BYTES
#define KVF_LANE_BYTES 64  // bytes each lane moves per unrolled step (vectors: 4..16)
#endif
#ifndef KVF_STREAM_LOADS
#define KVF_STREAM_LOADS 0  // .cs loads (evict-first): measured slower, no gain beside them
#endif
#ifndef KVF_STREAM_STORES
#define KVF_STREAM_STORES 0  // .cs stores (evict-first): likewise
#endif
#ifndef KVF_TILED_MIN_CTAS
#define KVF_TILED_MIN_CTAS 1  // resident CTAs per SM the tiled kernel's registers allow
#endif
#ifndef KVF_LINEAR_MIN_CTAS
#define KVF_LINEAR_MIN_CTAS 1  // resident CTAs per SM the linear kernel's registers allow
#endif

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
  uint32_t pad[2];
};

enum Linear : int { kBoth = 0, kStage = 1, kCache = 2 };
constexpr uint32_t kStaged = 4;      // or-ed into GroupDesc::linear (plan.STAGED)
constexpr uint32_t kTiled = 8;       // or-ed with kStaged (plan.TILED): via shared memory
constexpr uint32_t kWarpTiled = 16;  // or-ed with kTiled (plan.WARP_TILED): a warp per segment
constexpr uint32_t kPrefetchGaps = 32;  // or-ed (plan.PREFETCH_GAPS): destination has gaps
constexpr uint32_t kOrderBits = 3;      // the Linear value in GroupDesc::linear
// Destination granules per lane per step of a staged group: each reads about two granules.
constexpr unsigned kStagedUnroll = KVF_LANE_BYTES / 32 > 0 ? KVF_LANE_BYTES / 32 : 1;

struct GroupDesc {
  int64_t stage_offset;       // byte offset of the group inside a chunk row
  int64_t layer_stage_bytes;  // staging bytes of one (kv, layer): chunk_tokens * row_bytes
  int64_t seg_bytes;          // bytes of one block of one (kv, layer)
  int64_t stage_outer;        // staging byte strides of (outer, inner)
  int64_t stage_inner;
  uint32_t tile_begin;        // first warp tile of the group inside a chunk
  uint32_t tile_end;
  uint32_t first_entry;       // index of the group's first (kv, layer) entry
  uint32_t vec_log2;          // vector width in bytes = 1 << vec_log2 (staged: 16)
  uint32_t seg_vecs;          // vectors in one segment (staged: destination granules)
  uint32_t linear;            // Linear: which side is linear in v, | kStaged
  FastDiv tiles_per_seg;
  uint32_t span;              // tiled: source bytes of a segment loaded to shared memory
  uint32_t iters;             // unrolled steps per warp tile
  uint32_t iters_pad[2];
  FastDiv run_vecs;           // vectors in one run contiguous on both sides (staged: bytes)
  FastDiv inner;              // runs per outer index
};

struct Entry {  // one (kv, layer): affine cache address in bytes
  int64_t base;
  int64_t s_block;
  int64_t s_outer;
  int64_t s_inner;
};

static_assert(sizeof(FastDiv) == 16, "mirror plan.FASTDIV");
static_assert(sizeof(PlanHeader) == 56 && offsetof(PlanHeader, chunk_bytes) == 40,
              "mirror plan.HEADER");
static_assert(sizeof(GroupDesc) == 128 && offsetof(GroupDesc, tile_begin) == 40 &&
                  offsetof(GroupDesc, tiles_per_seg) == 64 && offsetof(GroupDesc, inner) == 112,
              "mirror plan.GROUP");
static_assert(sizeof(Entry) == 32, "mirror plan.ENTRY");

template <int VEC> struct VecType;
template <> struct VecType<16> { using T = uint4; };
template <> struct VecType<8> { using T = uint2; };
template <> struct VecType<4> { using T = unsigned int; };
template <> struct VecType<2> { using T = unsigned short; };
template <> struct VecType<1> { using T = unsigned char; };

// Vectors per lane per unrolled step: KVF_LANE_BYTES bytes, at least 4 vectors and at
// most 16 (8 where addresses are computed per vector, to bound registers).
template <int VEC, int LIN> __host__ __device__ constexpr unsigned unroll() {
  constexpr unsigned most = LIN == 0 ? 16 : 8;
  return KVF_LANE_BYTES / VEC < 4 ? 4 : (KVF_LANE_BYTES / VEC > most ? most : KVF_LANE_BYTES / VEC);
}

template <typename T> __device__ __forceinline__ T load(const T* p) {
#if KVF_STREAM_LOADS
  return __ldcs(p);
#else
  return *p;
#endif
}


template <typename T> __device__ __forceinline__ void store(T* p, T value) {
#if KVF_STREAM_STORES
  __stcs(p, value);
#else
  *p = value;
#endif
}

// Byte offsets of vector v on the cache and staging sides of a segment.
struct Split {
  int64_t cache, stage;
};

template <int VEC>
__device__ __forceinline__ Split split(const GroupDesc& g, const Entry& e, uint32_t v) {
  const uint32_t run = divide(g.run_vecs, v);
  const uint32_t w = v - run * g.run_vecs.d;
  const uint32_t outer = divide(g.inner, run);
  const uint32_t inner = run - outer * g.inner.d;
  const int64_t word = static_cast<int64_t>(w) * VEC;
  return {outer * e.s_outer + inner * e.s_inner + word,
          outer * g.stage_outer + inner * g.stage_inner + word};
}

// A scatter into a destination with bytes it does not own between its runs (padded
// rows) writes sectors in part, and HBM then merges each on eviction (read, then
// write). Asking L2 for those sectors first, before the block's stores, measured
// faster: each lane takes runs lane, lane + 32, ... and prefetches the sectors
// holding a run's first and last bytes where they are not sector-aligned.
template <int VEC>
__device__ __forceinline__ void prefetch_partial_sectors(const GroupDesc& g, const Entry& e,
                                                         const char* cache, uint32_t lane) {
  const uint32_t run_bytes = g.run_vecs.d * VEC;
  const uint32_t runs = g.seg_vecs / g.run_vecs.d;
  for (uint32_t r = lane; r < runs; r += kWarp) {
    const uint32_t outer = divide(g.inner, r);
    const char* start = cache + outer * e.s_outer + (r - outer * g.inner.d) * e.s_inner;
    const char* last = start + run_bytes - 1;
    if (reinterpret_cast<uintptr_t>(start) & 31) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(start));
    }
    if ((reinterpret_cast<uintptr_t>(last) & 31) != 31) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(last));
    }
  }
}

template <int VEC, bool GATHER, Linear LIN>
__device__ __forceinline__ void copy_tile(const GroupDesc& g, const Entry& e, char* cache,
                                          char* stage, uint32_t tile, uint32_t iters,
                                          uint32_t lane) {
  using T = typename VecType<VEC>::T;
  constexpr unsigned U = unroll<VEC, LIN>();
  if (!GATHER && LIN == kStage && (g.linear & kPrefetchGaps) && tile == 0) {
    prefetch_partial_sectors<VEC>(g, e, cache, lane);
  }
  for (uint32_t it = 0; it < iters; ++it) {
    // Vector u of this lane is first + u * kWarp; `left` bounds u without 32-bit
    // wraparound, so linear addresses fold into one base register plus immediates.
    const uint32_t first = (tile * iters + it) * (kWarp * U) + lane;
    const int32_t left = static_cast<int32_t>(g.seg_vecs) - static_cast<int32_t>(first);
    if (left <= 0) return;
    T* stage_v = reinterpret_cast<T*>(stage) + first;
    T* cache_v = reinterpret_cast<T*>(cache) + first;
    T buf[U];
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      if (static_cast<int32_t>(u * kWarp) < left) {
        const T* src;
        if (LIN == kBoth) {
          src = (GATHER ? cache_v : stage_v) + u * kWarp;
        } else {
          const Split at = split<VEC>(g, e, first + u * kWarp);
          const bool src_linear = GATHER ? LIN == kCache : LIN == kStage;
          src = src_linear ? (GATHER ? cache_v : stage_v) + u * kWarp
                           : reinterpret_cast<const T*>(GATHER ? cache + at.cache
                                                               : stage + at.stage);
        }
        buf[u] = load(src);
      }
    }
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      if (static_cast<int32_t>(u * kWarp) < left) {
        T* dst;
        if (LIN == kBoth) {
          dst = (GATHER ? stage_v : cache_v) + u * kWarp;
        } else {
          const bool dst_linear = GATHER ? LIN == kStage : LIN == kCache;
          if (dst_linear) {
            dst = (GATHER ? stage_v : cache_v) + u * kWarp;
          } else {
            const Split at = split<VEC>(g, e, first + u * kWarp);
            dst = reinterpret_cast<T*>(GATHER ? stage + at.stage : cache + at.cache);
          }
        }
        store(dst, buf[u]);
      }
    }
  }
}

// The aligned 16-byte granule holding byte address p and, when `next`, the one after it
// (read only when it holds bytes the caller uses).
struct Granules {
  uint4 lo, hi;
};

__device__ __forceinline__ Granules granules_at(const char* p, bool next) {
  const uint4* granule =
      reinterpret_cast<const uint4*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(15));
  return {load(granule), next ? load(granule + 1) : make_uint4(0, 0, 0, 0)};
}

// The 16 bytes at byte address p out of its granules.
__device__ __forceinline__ uint4 bytes_at(const Granules& g, const char* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  const uint32_t w[8] = {g.lo.x, g.lo.y, g.lo.z, g.lo.w, g.hi.x, g.hi.y, g.hi.z, g.hi.w};
  const uint32_t q = (addr >> 2) & 3, shift = (addr & 3) * 8;
  uint32_t s[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    s[i] = q == 0 ? w[i] : q == 1 ? w[i + 1] : q == 2 ? w[i + 2] : w[i + 3];
  }
  return make_uint4(__funnelshift_r(s[0], s[1], shift), __funnelshift_r(s[1], s[2], shift),
                    __funnelshift_r(s[2], s[3], shift), __funnelshift_r(s[3], s[4], shift));
}

// Bytes [0, n) of x, then bytes [n, 16) of y.
__device__ __forceinline__ uint4 splice(const uint4& x, const uint4& y, uint32_t n) {
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
  uint32_t out[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int32_t keep = static_cast<int32_t>(n) - 4 * k;  // bytes of word k taken from x
    const uint32_t mask = keep >= 4 ? 0xffffffffu : keep <= 0 ? 0u : (1u << (8 * keep)) - 1;
    out[k] = (xs[k] & mask) | (ys[k] & ~mask);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Where the 16 bytes of destination granule d (a byte offset into the segment) lie on the
// source side. Destination byte d is byte c = d % run_bytes of run r = d / run_bytes,
// found on the source side at (outer, inner) = divmod(r, inner). The granule's first n
// bytes come from run r at offset a; the rest from the start of run r + 1, read from
// offset b, n bytes before it (b = a when the granule lies in one run). Offsets are bytes
// from the source side's segment base.
struct GranuleSource {
  int64_t a, b;
  uint32_t n;
};

__device__ __forceinline__ GranuleSource granule_source(const GroupDesc& g, int64_t s_outer,
                                                        int64_t s_inner, uint32_t d) {
  const uint32_t run_bytes = g.run_vecs.d;
  const uint32_t r = divide(g.run_vecs, d);
  const uint32_t c = d - r * run_bytes;
  const uint32_t outer = divide(g.inner, r);
  const uint32_t in = r - outer * g.inner.d;
  const int64_t a = outer * s_outer + in * s_inner + c;
  const uint32_t n = min(16u, run_bytes - c);
  const bool wrap = in + 1 == g.inner.d;
  const int64_t b =
      n < 16 ? (wrap ? outer + 1 : outer) * s_outer + (wrap ? 0u : in + 1) * s_inner - n : a;
  return {a, b, n};
}

// A staged group's warp tile: lane-contiguous 16-byte granules of the linear destination,
// each spliced from its two source runs (granule_source). Every lane computes its
// addresses, then issues all its loads, then splices and stores, so a second run costs no
// extra round trip.
template <bool GATHER>
__device__ __forceinline__ void copy_staged(const GroupDesc& g, const Entry& e, char* cache,
                                            char* stage, uint32_t tile, uint32_t iters,
                                            uint32_t lane) {
  constexpr unsigned U = kStagedUnroll;
  const char* src = GATHER ? cache : stage;
  uint4* dst = reinterpret_cast<uint4*>(GATHER ? stage : cache);
  const int64_t s_outer = GATHER ? e.s_outer : g.stage_outer;
  const int64_t s_inner = GATHER ? e.s_inner : g.stage_inner;
  for (uint32_t it = 0; it < iters; ++it) {
    const uint32_t first = (tile * iters + it) * (kWarp * U) + lane;
    const int32_t left = static_cast<int32_t>(g.seg_vecs) - static_cast<int32_t>(first);
    if (left <= 0) return;
    const char* a[U];
    const char* b[U];
    uint32_t n[U];
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      const GranuleSource at = granule_source(g, s_outer, s_inner, (first + u * kWarp) * 16);
      a[u] = src + at.a;
      b[u] = src + at.b;
      n[u] = at.n;
    }
    Granules x[U], y[U];
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      if (static_cast<int32_t>(u * kWarp) < left) {
        x[u] = granules_at(a[u], (reinterpret_cast<uintptr_t>(a[u]) & 15) + n[u] > 16);
        y[u] = granules_at(b[u], n[u] < 16 && (reinterpret_cast<uintptr_t>(b[u]) & 15) != 0);
      }
    }
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      if (static_cast<int32_t>(u * kWarp) < left) {
        store(dst + first + u * kWarp, splice(bytes_at(x[u], a[u]), bytes_at(y[u], b[u]), n[u]));
      }
    }
  }
}

// Dynamic shared memory of a tiled group's CTA: one segment's source span, or one per
// warp for a warp-tiled group.
extern __shared__ uint4 kvf_span[];

// Copy 16 bytes global -> shared without registers (cp.async; evict-first in L2 when
// loads stream, as .cs does for the register path).
__device__ __forceinline__ void async_granule(uint4* to, const uint4* from) {
  const uint32_t to_shared = static_cast<uint32_t>(__cvta_generic_to_shared(to));
#if KVF_STREAM_LOADS
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(to_shared),
               "l"(from), "l"(policy)
               : "memory");
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to_shared), "l"(from)
               : "memory");
#endif
}

// The shared-memory granule holding byte `at` of `span` and, when `next`, the one after.
__device__ __forceinline__ Granules granules_in(const uint4* span, uint32_t at, bool next) {
  const uint4* granule = span + (at >> 4);
  return {*granule, next ? granule[1] : make_uint4(0, 0, 0, 0)};
}

// A tiled group's segment, moved by a whole CTA (or, warp-tiled, by one warp): the
// source span (contiguous, 16-byte aligned) goes to shared memory in 16-byte cp.async
// copies, then each thread builds destination granules out of it as the staged path
// does from global memory, so global loads and stores are all whole, linear 16-byte
// granules. Every warp of the CTA is on a CTA-tiled segment (the planner aligns those
// groups to CTAs), so the barrier is uniform; a warp-tiled segment uses the warp's own
// slice of shared memory and a warp barrier.
template <bool GATHER>
__device__ __forceinline__ void copy_tiled(const GroupDesc& g, const Entry& e, char* cache,
                                           char* stage) {
  const uint4* src = reinterpret_cast<const uint4*>(GATHER ? cache : stage);
  uint4* dst = reinterpret_cast<uint4*>(GATHER ? stage : cache);
  const bool per_warp = g.linear & kWarpTiled;
  const uint32_t threads = per_warp ? kWarp : kThreads;
  const uint32_t tid = per_warp ? threadIdx.x % kWarp : threadIdx.x;
  uint4* span = kvf_span + (per_warp ? threadIdx.x / kWarp * (g.span / 16) : 0);
  for (uint32_t i = tid; i < g.span / 16; i += threads) async_granule(span + i, src + i);
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
  if (per_warp) {
    __syncwarp();
  } else {
    __syncthreads();
  }
  const int64_t s_outer = GATHER ? e.s_outer : g.stage_outer;
  const int64_t s_inner = GATHER ? e.s_inner : g.stage_inner;
  for (uint32_t j = tid; j < g.seg_vecs; j += threads) {
    const GranuleSource at = granule_source(g, s_outer, s_inner, j * 16);
    // offsets into the span (< 48 KiB): 32-bit arithmetic from here
    const uint32_t a = static_cast<uint32_t>(at.a), b = static_cast<uint32_t>(at.b), n = at.n;
    const Granules x = granules_in(span, a, (a & 15) + n > 16);
    const Granules y = granules_in(span, b, n < 16 && (b & 15) != 0);
    const char* base = reinterpret_cast<const char*>(span);
    store(dst + j, splice(bytes_at(x, base + a), bytes_at(y, base + b), n));
  }
}

template <int VEC, bool GATHER, bool GENERAL>
__device__ __forceinline__ void copy_tile_any(const GroupDesc& g, const Entry& e, char* cache,
                                              char* stage, uint32_t tile, uint32_t iters,
                                              uint32_t lane) {
  const uint32_t order = g.linear & kOrderBits;
  if (!GENERAL || order == kBoth) {
    copy_tile<VEC, GATHER, kBoth>(g, e, cache, stage, tile, iters, lane);
  } else if (order == kStage) {
    copy_tile<VEC, GATHER, kStage>(g, e, cache, stage, tile, iters, lane);
  } else {
    copy_tile<VEC, GATHER, kCache>(g, e, cache, stage, tile, iters, lane);
  }
}

// Kernel instantiations: every group linear, any group, or every group tiled.
enum Kind : int { kLinearOnly = 0, kAny = 1, kTiledOnly = 2 };

template <bool GATHER, Kind KIND>
__device__ __forceinline__ void dispatch(const GroupDesc& g, const Entry& e, char* cache,
                                         char* stage, uint32_t tile, uint32_t iters,
                                         uint32_t lane) {
  constexpr bool GENERAL = KIND == kAny;
  if (KIND == kTiledOnly || (GENERAL && (g.linear & kTiled))) {
    copy_tiled<GATHER>(g, e, cache, stage);
    return;
  }
  if (GENERAL && (g.linear & kStaged)) {
    copy_staged<GATHER>(g, e, cache, stage, tile, iters, lane);
    return;
  }
  switch (g.vec_log2) {
    case 4: copy_tile_any<16, GATHER, GENERAL>(g, e, cache, stage, tile, iters, lane); break;
    case 3: copy_tile_any<8, GATHER, GENERAL>(g, e, cache, stage, tile, iters, lane); break;
    case 2: copy_tile_any<4, GATHER, GENERAL>(g, e, cache, stage, tile, iters, lane); break;
    case 1: copy_tile_any<2, GATHER, GENERAL>(g, e, cache, stage, tile, iters, lane); break;
    default: copy_tile_any<1, GATHER, GENERAL>(g, e, cache, stage, tile, iters, lane); break;
  }
}

// gather != 0: cache -> staging; else staging -> cache. block_ids is [chunks, per_chunk]
// int32, skip is [chunks] int32; num_tiles = chunks * tiles_per_chunk.
template <Kind KIND>
__device__ __forceinline__ void transfer(const PlanHeader* __restrict__ hdr,
                                         const GroupDesc* __restrict__ groups,
                                         const Entry* __restrict__ entries,
                                         const int32_t* __restrict__ block_ids,
                                         const int32_t* __restrict__ skip,
                                         char* __restrict__ staging, uint32_t num_tiles,
                                         uint32_t gather) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t tile = blockIdx.x * kWarpsPerCta + threadIdx.x / kWarp;
  if (tile >= num_tiles) return;
  const uint32_t chunk = divide(hdr->tiles_per_chunk, tile);
  uint32_t rem = tile - chunk * hdr->tiles_per_chunk.d;
  uint32_t gi = 0;
  while (gi + 1 < hdr->num_groups && rem >= groups[gi].tile_end) ++gi;
  const GroupDesc& g = groups[gi];
  if (rem < g.tile_begin || rem >= g.tile_end) return;  // padding before a tiled group
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
    dispatch<true, KIND>(g, e, cache, stage, seg_tile, g.iters, lane);
  } else {
    dispatch<false, KIND>(g, e, cache, stage, seg_tile, g.iters, lane);
  }
}

}  // namespace kvf

// One entry point per instantiation (launch bounds last); gather != 0: cache -> staging.
#define KVF_TRANSFER_KERNEL(NAME, KIND, ...)                                               \
  extern "C" __global__ void __launch_bounds__(__VA_ARGS__)                               \
      NAME(const kvf::PlanHeader* __restrict__ hdr, const kvf::GroupDesc* __restrict__ groups, \
           const kvf::Entry* __restrict__ entries, const int32_t* __restrict__ block_ids,  \
           const int32_t* __restrict__ skip, char* __restrict__ staging, uint32_t num_tiles, \
           uint32_t gather) {                                                               \
    kvf::transfer<KIND>(hdr, groups, entries, block_ids, skip, staging, num_tiles, gather); \
  }

// Every group's segments are contiguous on both sides (the common NHD case): lean code.
KVF_TRANSFER_KERNEL(kvf_block_transfer_linear, kvf::kLinearOnly, kvf::kThreads, KVF_LINEAR_MIN_CTAS)

// Any group layout (runs addressed through the stride descriptor).
KVF_TRANSFER_KERNEL(kvf_block_transfer, kvf::kAny, kvf::kThreads)

// Every group tiled (narrow heads in head-major blocks): the shared-memory path alone,
// lean enough for more resident CTAs, so one CTA's loads overlap another's stores.
KVF_TRANSFER_KERNEL(kvf_block_transfer_tiled, kvf::kTiledOnly, kvf::kThreads, KVF_TILED_MIN_CTAS)
