// Fused CPU kernels over packed b-bit codes (b in {1, 2, 3, 4, 8}; layout of wushkv.quantizers.pack:
// code t of byte m sits at bits [t*b, (t+1)*b), low bits first; 3 bits: 8 codes in 3 bytes, the decode and code
// kernels only, see Unit). They read the packed bytes once and
// never expand them into a float copy: each token's codes are unpacked in registers (shift, mask, convert; AVX-512
// or AVX2) and used at once by vectorized dot products / accumulations.
//
//   code_dot(codes (B,H,N,nb) uint8, q (B,H,G,d) f32, bits)           -> (B,H,G,N): Σ_i c_ji q_gi
//   code_dot_tiles(codes, q (B,H,Q,G,d) f32, bits, tile, bias (B,H,Q,G) f32, s (B,H,N) f32) -> (B,H,G,N):
//       s_j·(Σ_i c_ji q[j/tile]_gi + bias[j/tile]_g) (KVarN's key tiles: each tile's queries scaled by its channel
//       scales, its q·zero, each token's s_tok)
//   code_weighted_sum(codes (B,H,N,nb) uint8, w (B,H,G,N) f32, bits, d) -> (B,H,G,d): Σ_j w_gj c_j
//   feedback_round(x (B,H,N,d) f32, scale/offset (B,H,N,g) f32, F (H,d,d) f32, bits) -> (B,H,N,d) uint8:
//       codes on each group's grid, rounded coordinate by coordinate with error feedback
//       (wushkv.quantizers.feedback; the PyTorch loop there is the reference)
//   paged_dequantize(cache, block_ids (nb,) i32, start, stop, ...) -> [k, v] (H, stop-start, d) f32: a request's cells
//       decoded through its block table (the prefill path)
//   paged_store(cache (NB,H,bs,C) uint8, slots (T,) i64, [k, v] (T,H,d) f32/f16/bf16, steps/offsets (T,H) f32, feedback (H,d,d), layout,
//       grid): the cells of new tokens written at their slots (wushkv_vllm.paged.SlotCodec.store; the same bytes as its
//       encode); QuEST's steps computed here where none are given (quest_steps: PyTorch's operations, in its order)
//   head_transform(x (T,Hx,d) f32/f16/bf16, mean (H,d) or empty, A (H,d,d)) -> (T,Hx,d) f32: (x − mean)·A per head (a
//       group of Hx/H heads per transform), each token on its own (wushkv_vllm.backend's key and query transforms)
//   windows_write(pool (P,U,H,2,d) token- or head-major, written (P,U) bool, cells (n,) i64, keep (n,) i64 or empty, k (T,H,d) f32, v (T,H,d)): the
//       windows' copies of new tokens (wushkv_vllm.paged.Windows.write)
//   paged_decode(cache (NB,H,bs,C) uint8, block_table (R,MB) i32, seq_lens (R,) i64, q (R,Hq,d) f32, pool (P,U,H,2,d) (strided),
//       written (P,U) bool, page_index (NB*bs/U,) i32, layout, windows, ...) -> (R,Hq,d) f32: one decode query per
//       request over its paged context of cells (wushkv_vllm.paged.SlotCodec; per-token codes, key tiles (KVarN's,
//       KIVI's), KVarN value tiles),
//       the window tokens from their full-precision copies (wushkv_vllm.paged.Windows), the rest straight from the
//       codes (+rmean: plus q·R_t μ from a table of cos/sin tθ); split-KV with an online-softmax merge
//   parts_decode(q (B,Hq,d) f32, spans (B,3,2) i64 or empty, widths [3], keys/values [sink, middle, recent] (B,H,n,d),
//       key middle [codes, scale, offset] or KVarN tiles [codes, s_tok, tile scale, tile zero] (or [] : full precision),
//       bits, tile, half, value middle [codes, scale, offset] or KVarN tiles [codes, scale, zero, channel scale],
//       bits, tile, half, visible (B,S) bool, scaling, softcap, sinks (Hq,), +rmean terms
//       (B,Hq,d), RoPE table (P,d), first (B,)) -> (B,Hq,d) f32: one decode query per row over a transformers-cache
//       layer (wushkv.decode._cpu_decode), as the Triton decode reads it on a GPU: split over (row, head, part, chunk)
//       with an online-softmax merge, the middle from its codes
//   kvarn_balance(A (N,R,C) f32, iters) -> [B, log_r (N,R), log_c (N,C)]: KVarN's dual-axis balance of each tile
//       (wushkv.quantizers.kvarn.balance; its PyTorch loop is the reference)
//   kvarn_rows(A, log_r, log_c, F (N,R,R) f32 or empty, bits, clip, alpha) -> [codes (N,R,C) u8, lo (N,R), step (N,R)]:
//       each balanced row's grid and codes, rows in order with error feedback when F is given
//       (wushkv.quantizers.kvarn.kvarn_quantize)
//
// The codes tensor may be a strided view (the cache's growable buffer); the last dim must be dense.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

static constexpr int64_t CHUNK = 1024;  // tokens per parallel work item

// tab[v*per + t] = code t of byte v, as float (3 bits, whose codes straddle bytes: none, code_at reads them)
static std::vector<float> byte_table(int64_t bits) {
  if (8 % bits) return {};
  const int64_t per = 8 / bits, mask = (1 << bits) - 1;
  std::vector<float> tab(256 * per);
  for (int64_t v = 0; v < 256; ++v)
    for (int64_t t = 0; t < per; ++t) tab[v * per + t] = float((v >> (t * bits)) & mask);
  return tab;
}

// codes of one packed row as floats: cf[0 .. nb*PER)
template <int PER>
static inline void unpack_row(const uint8_t* row, int64_t nb, const float* tab, float* cf) {
  for (int64_t m = 0; m < nb; ++m) {
    const float* src = tab + row[m] * PER;
    for (int t = 0; t < PER; ++t) cf[m * PER + t] = src[t];
  }
}

static inline void unpack_any(const uint8_t* row, int64_t nb, int64_t per, const float* tab, float* cf) {
  switch (per) {
    case 8: unpack_row<8>(row, nb, tab, cf); break;
    case 4: unpack_row<4>(row, nb, tab, cf); break;
    case 2: unpack_row<2>(row, nb, tab, cf); break;
    default: unpack_row<1>(row, nb, tab, cf);
  }
}

// A row of b-bit codes is read in units, the fewest whole bytes that hold whole codes: one byte of 8/b codes for
// b in {1, 2, 4, 8}, three bytes of 8 codes for b = 3 (wushkv.quantizers.pack's bit stream: code t of a unit sits at
// bits [t·b, (t+1)·b) of the unit read as a little-endian integer). The kernels below take a row's length in units
// (nb) and read code t of unit m; a 3-bit row must be whole units (⌈3d/8⌉ a multiple of 3: d a multiple of 8).
template <int BITS>
struct Unit {
  static constexpr int PER = BITS == 3 ? 8 : 8 / BITS;  // codes a unit
  static constexpr int BYTES = BITS == 3 ? 3 : 1;       // bytes a unit
};
static inline int64_t unit_per(int64_t bits) { return bits == 3 ? 8 : 8 / bits; }
static inline int64_t unit_bytes(int64_t bits) { return bits == 3 ? 3 : 1; }

// code t of unit m of a row (the scalar paths)
static inline int code_at(const uint8_t* row, int64_t m, int64_t t, int64_t bits) {
  if (bits == 3) {
    const uint8_t* u = row + 3 * m;
    return int(((uint32_t(u[0]) | uint32_t(u[1]) << 8 | uint32_t(u[2]) << 16) >> (3 * t)) & 7u);
  }
  return (row[m] >> (t * bits)) & ((1 << bits) - 1);
}

static void check(const torch::Tensor& codes, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 4 && codes.stride(3) == 1, "codes: uint8 (B,H,N,nb), dense last dim");
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8, "bits must be 1, 2, 3, 4 or 8");
  TORCH_CHECK(bits != 3 || codes.size(3) % 3 == 0, "3-bit rows are read 8 codes (3 bytes) at a time: their bytes (",
              codes.size(3), ") must be a multiple of 3 (head_dim a multiple of 8)");
}

// codes of one vector w (d; overwritten) on its groups' grids (scale s, offset o per group of gs channels), rounded
// coordinate by coordinate with error feedback F (d, d): each coordinate's error pushed onto the later ones
static inline void feedback_row(float* w, const float* s, const float* o, int64_t gs, const float* F, int64_t d, float qmax,
                                uint8_t* codes) {
  for (int64_t j = 0; j < d; ++j) {
    const float sj = s[j / gs], oj = o[j / gs];
    // a step stored as 0 divides by float32's tiny (wushkv.quantizers.feedback): 0/0 would feed NaN forward
    float c = std::floor((w[j] - oj) / std::max(sj, std::numeric_limits<float>::min()) + 0.5f);
    c = c < 0.f ? 0.f : (c > qmax ? qmax : c);
    codes[j] = static_cast<uint8_t>(c);
    const float e = w[j] - (c * sj + oj);
    const float* row = F + j * d;
    for (int64_t k = j + 1; k < d; ++k) w[k] -= e * row[k];
  }
}

torch::Tensor feedback_round(torch::Tensor x, torch::Tensor scale, torch::Tensor offset, torch::Tensor F, int64_t bits) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat32, "x must be (B,H,N,d) float32");
  TORCH_CHECK(F.dim() == 3 && F.scalar_type() == torch::kFloat32, "F must be (H,d,d) float32");
  x = x.contiguous(); scale = scale.contiguous(); offset = offset.contiguous(); F = F.contiguous();
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), d = x.size(3), ng = scale.size(3);
  TORCH_CHECK(F.size(0) == H && F.size(1) == d && F.size(2) == d && d % ng == 0, "shape mismatch");
  const int64_t gs = d / ng;
  const float qmax = float((1 << bits) - 1);
  auto codes = torch::empty({B, H, N, d}, x.options().dtype(torch::kUInt8));
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const float* fp = F.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::parallel_for(0, B * H * N, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(d);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = (r / N) % H;
      for (int64_t k = 0; k < d; ++k) w[k] = xp[r * d + k];
      feedback_row(w.data(), sp + r * ng, op + r * ng, gs, fp + h * d * d, d, qmax, cp + r * d);
    }
  });
  return codes;
}


// ---- paged decode -----------------------------------------------------------------------------------------------
// One side (keys or values) of a cell: byte offsets of its codes, its step/scale and its offset (-1: symmetric, the
// offset is scale * half, QuEST's (1/2 - 2^(b-1))), its width and the metadata's dtype (0 f16, 1 bf16, 2 f32, 3 E5M3:
// one byte, a symmetric side's step).
// Key tiles (tile > 0, KVarN's, wushkv.quantizers.kvarn): k[t, i] = s_tok[t] * (scale[i] * code + zero[i]) per tile of
// `tile` tokens; `scale` is then the offset of the token's f16 s_tok (-1: none, s_tok 1, KIVI's per-channel keys) and
// the tile's f16 scale (d) and zero (d) are spread over its cells, `tmeta_w` bytes each at offset `tmeta`
// (wushkv_vllm.paged.SlotCodec).
struct CellSide {
  int64_t codes, scale, offset, bits;
  float half;
  int64_t meta, tile = 0, tmeta = 0, tmeta_w = 0;
};

// a side from its Python form [codes, scale, offset, bits, meta dtype(, tile, tile slice, its width)]
static CellSide cell_side(const std::vector<int64_t>& v, double half) {
  TORCH_CHECK(v.size() == 5 || v.size() == 8, "a side is (codes, scale, offset, bits, meta dtype[, tile, slice, width])");
  CellSide c{v[0], v[1], v[2], v[3], float(half), v[4]};
  if (v.size() == 8) { c.tile = v[5]; c.tmeta = v[6]; c.tmeta_w = v[7]; }
  TORCH_CHECK(c.bits == 1 || c.bits == 2 || c.bits == 3 || c.bits == 4 || c.bits == 8, "bits must be 1, 2, 3, 4 or 8, got ",
              c.bits);
  TORCH_CHECK(c.meta >= 0 && c.meta <= 3 && (c.meta != 3 || c.offset < 0), "metadata dtype 0-3 (3, E5M3: steps only), got ", c.meta);
  TORCH_CHECK(c.tile >= 0 && (c.tile == 0 || (c.tmeta_w > 0 && c.meta == 0)), "a tile side: f16 metadata and a slice");
  return c;
}

// kind 3 is E5M3 (wushkv.codecs.e5m3_round): one byte, float16's bits 14..7 (a positive step)
static inline float meta_at(const uint8_t* p, int64_t kind) {
  if (kind == 3) return static_cast<float>(c10::Half(uint16_t(uint16_t(p[0]) << 7), c10::Half::from_bits()));
  if (kind == 0) { c10::Half h; std::memcpy(&h, p, 2); return static_cast<float>(h); }
  if (kind == 1) { c10::BFloat16 b; std::memcpy(&b, p, 2); return static_cast<float>(b); }
  float f; std::memcpy(&f, p, 4); return f;
}

// a key tile's token scale s_tok (f16 at byte `off` of the cell); KIVI's tiles store none (off -1): 1
static inline float s_tok_at(const uint8_t* cell, int64_t off) { return off < 0 ? 1.f : meta_at(cell + off, 0); }


// Rows of codes are read in a permuted order: position t*nb + m is code t of unit m (t < PER, m < nb; Unit: a byte,
// or 3 bytes at 3 bits), so a row unpacks as PER runs over its units (shift, mask, convert: vector instructions, no
// table), and queries and value sums are kept in that order (permuted once per work item, back at its end).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define WUSHKV_AVX512 1
#define WUSHKV_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
// CPUs without AVX-512 (AMD before Zen 4, most client CPUs): the same kernels over 8 lanes. Without them the decode
// fell back to scalar loops the compiler did not vectorize, 20-30x slower per token (docs/reference/performance.md)
#include <immintrin.h>
#define WUSHKV_AVX2 1
#define WUSHKV_SIMD 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
// 8-lane helpers and the transformers cache's multi-row kernels (axpy_rows_t, dot_rows_t): built on AVX-512 CPUs too
// (they all have AVX2 and FMA), so the code measured and tested on an AVX2 machine is the code that runs there
#define WUSHKV_ROWS 1
#endif

// which of the paths above this build took: "avx512", "avx2" or "scalar"
static const char* simd_path() {
#if defined(WUSHKV_AVX512)
  return "avx512";
#elif defined(WUSHKV_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#ifdef WUSHKV_ROWS
static inline __m128i load_upto16(const uint8_t* p, int64_t n);

// 8 bytes of a row from p as 8 int32 lanes; fewer than 8 left (a row's end): the rest zero, nothing read past it
static inline __m256i load8_u8(const uint8_t* p, int64_t left) {
  if (left >= 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepu8_epi32(load_upto16(p, left));
}

// the first `left` of 8 lanes (a mask for _mm256_maskload_ps / _mm256_maskstore_ps)
static inline __m256i lanes8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// exactly the first n ≤ 16 bytes at p, the rest of the 16 zero: whole dwords by a masked load (which reads nothing
// under its mask), the last 0-3 bytes one by one (a copy through memory instead, of a length known only at run time,
// was a library call and a stalled load per row: 3-bit groups of 32 channels, 4 units a row, ran at 2x the time)
static inline __m128i load_upto16(const uint8_t* p, int64_t n) {
  const int dw = static_cast<int>(n >> 2), rem = static_cast<int>(n & 3);
  const __m128i idx = _mm_setr_epi32(0, 1, 2, 3);
  __m128i x = _mm_maskload_epi32(reinterpret_cast<const int*>(p), _mm_cmpgt_epi32(_mm_set1_epi32(dw), idx));
  if (rem) {
    const uint8_t* t = p + 4 * dw;
    uint32_t v = t[0];
    if (rem > 1) v |= uint32_t(t[1]) << 8;
    if (rem > 2) v |= uint32_t(t[2]) << 16;
    x = _mm_or_si128(x, _mm_and_si128(_mm_set1_epi32(static_cast<int>(v)), _mm_cmpeq_epi32(_mm_set1_epi32(dw), idx)));
  }
  return x;
}

// 8 three-byte units of a row from p as 8 int32 lanes (lane m: bytes 3m, 3m+1, 3m+2, low first); fewer than 8 left:
// the rest zero, nothing read past the row (24 bytes read as 16 + 8, each half's four units spread by a byte shuffle)
static inline __m256i load8_u24(const uint8_t* p, int64_t left) {
  __m128i lo, hi;
  if (left >= 8) {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));       // bytes 0..15
    hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16));  // bytes 16..23
  } else {  // 3·left < 24 bytes, none read past them
    lo = load_upto16(p, std::min<int64_t>(16, 3 * left));
    hi = 3 * left > 16 ? load_upto16(p + 16, 3 * left - 16) : _mm_setzero_si128();
  }
  const __m128i spread = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  const __m128i a = _mm_shuffle_epi8(lo, spread);                          // units 0..3: bytes 0..11
  const __m128i b = _mm_shuffle_epi8(_mm_alignr_epi8(hi, lo, 12), spread);  // units 4..7: bytes 12..23
  return _mm256_set_m128i(b, a);
}

// 8 units of a row (Unit<BITS>) from p as 8 int32 lanes; fewer than 8 left: the rest zero
template <int BITS>
static inline __m256i load8(const uint8_t* p, int64_t left) {
  if constexpr (BITS == 3)
    return load8_u24(p, left);
  else
    return load8_u8(p, left);
}

// code t of the 8 units in x, as floats
template <int BITS>
static inline __m256 code8(__m256i x, int t) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(x, t * BITS), _mm256_set1_epi32((1 << BITS) - 1)));
}

// s[g] = Σ_i c_i q[g·stride + i] over one row's codes (permuted order), GN ≤ 4 queries, 8 units at a time: their
// accumulators in registers, the queries read from L1 (16 registers do not hold them). The AVX2 build's kernel for
// every width; the AVX-512 build's for 3 bits (its 16-lane kernels read whole bytes)
template <int BITS, int GN>
static inline void dot_codes8_t(const uint8_t* __restrict row, int64_t nb, const float* __restrict q, int64_t stride,
                                float* __restrict s) {
  constexpr int PER = Unit<BITS>::PER, UB = Unit<BITS>::BYTES;
  __m256 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
  int64_t m = 0;
  for (; m + 8 <= nb; m += 8) {
    const __m256i x = load8<BITS>(row + m * UB, 8);
#pragma GCC unroll 8
    for (int t = 0; t < PER; ++t) {
      const __m256 c = code8<BITS>(x, t);
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) acc[g] = _mm256_fmadd_ps(c, _mm256_loadu_ps(q + g * stride + t * nb + m), acc[g]);
    }
  }
  if (m < nb) {  // the row's last units: masked query loads (the permuted queries end at t·nb + nb)
    const __m256i x = load8<BITS>(row + m * UB, nb - m), lm = lanes8(nb - m);
    for (int t = 0; t < PER; ++t) {
      const __m256 c = code8<BITS>(x, t);
      for (int g = 0; g < GN; ++g) acc[g] = _mm256_fmadd_ps(c, _mm256_maskload_ps(q + g * stride + t * nb + m, lm), acc[g]);
    }
  }
  for (int g = 0; g < GN; ++g) s[g] = hsum8(acc[g]);
}

// acc[g·stride + i] += w[g]·c_i over one row's codes (permuted order), 8 units at a time (as dot_codes8_t)
template <int BITS>
static inline void axpy_codes8_t(const uint8_t* __restrict row, int64_t nb, const float* __restrict w, int64_t G,
                                 float* __restrict acc, int64_t stride) {
  constexpr int PER = Unit<BITS>::PER, UB = Unit<BITS>::BYTES;
  for (int64_t m = 0; m < nb; m += 8) {
    const int64_t left = nb - m;
    const __m256i x = load8<BITS>(row + m * UB, left), lm = lanes8(left);
#pragma GCC unroll 8
    for (int t = 0; t < PER; ++t) {
      const __m256 c = code8<BITS>(x, t);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * stride + t * nb + m;
        if (left >= 8)
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(w[g]), c, _mm256_loadu_ps(a)));
        else
          _mm256_maskstore_ps(a, lm, _mm256_fmadd_ps(_mm256_set1_ps(w[g]), c, _mm256_maskload_ps(a, lm)));
      }
    }
  }
}
#endif

#ifdef WUSHKV_AVX512
// GN queries (≤ 4) at BITS bits: accumulators in registers, the loops over code runs and queries unrolled
template <int BITS, int GN>
static inline void dot_codes_t(const uint8_t* __restrict row, int64_t nb, const float* __restrict q, int64_t stride,
                               float* __restrict s) {
  static_assert(8 % BITS == 0, "16-lane kernels read whole bytes (3 bits: dot_codes8_t)");
  constexpr int PER = 8 / BITS;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  __m512 acc[GN];
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t m = 0; m < nb; m += 16) {
    const __mmask16 lanes = nb - m >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - m)) - 1);
    const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, row + m));
#pragma GCC unroll 8
    for (int t = 0; t < PER; ++t) {
      const __m512 c = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(x, t * BITS), mask));
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g)
        acc[g] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(lanes, q + g * stride + t * nb + m), acc[g]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g) s[g] = _mm512_reduce_add_ps(acc[g]);
}


template <int BITS>
static inline void axpy_codes_t(const uint8_t* __restrict row, int64_t nb, const float* __restrict w, int64_t G,
                                float* __restrict acc, int64_t stride) {
  static_assert(8 % BITS == 0, "16-lane kernels read whole bytes (3 bits: axpy_codes8_t)");
  constexpr int PER = 8 / BITS;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  for (int64_t m = 0; m < nb; m += 16) {
    const __mmask16 lanes = nb - m >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - m)) - 1);
    const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, row + m));
#pragma GCC unroll 8
    for (int t = 0; t < PER; ++t) {
      const __m512 c = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(x, t * BITS), mask));
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * stride + t * nb + m;
        _mm512_mask_storeu_ps(a, lanes, _mm512_fmadd_ps(_mm512_set1_ps(w[g]), c, _mm512_maskz_loadu_ps(lanes, a)));
      }
    }
  }
}
#endif

#ifdef WUSHKV_AVX2
// GN queries (≤ 4), their accumulators in registers; queries read from L1 (16 registers do not hold them)
template <int BITS, int GN>
static inline void dot_codes_t(const uint8_t* __restrict row, int64_t nb, const float* __restrict q, int64_t stride,
                               float* __restrict s) {
  dot_codes8_t<BITS, GN>(row, nb, q, stride, s);
}

template <int BITS>
static inline void axpy_codes_t(const uint8_t* __restrict row, int64_t nb, const float* __restrict w, int64_t G,
                                float* __restrict acc, int64_t stride) {
  axpy_codes8_t<BITS>(row, nb, w, G, acc, stride);
}
#endif

#ifdef WUSHKV_SIMD
template <int BITS, int GN>
static inline void dot_codes_g(const uint8_t* row, int64_t nb, const float* q, int64_t stride, float* s) {
  if constexpr (BITS == 3)
    dot_codes8_t<BITS, GN>(row, nb, q, stride, s);
  else
    dot_codes_t<BITS, GN>(row, nb, q, stride, s);
}

template <int BITS>
static inline void dot_codes_b(const uint8_t* row, int64_t nb, const float* q, int64_t stride, int64_t G, float* s) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) dot_codes_g<BITS, 4>(row, nb, q + g * stride, stride, s + g);
  switch (G - g) {
    case 3: dot_codes_g<BITS, 3>(row, nb, q + g * stride, stride, s + g); break;
    case 2: dot_codes_g<BITS, 2>(row, nb, q + g * stride, stride, s + g); break;
    case 1: dot_codes_g<BITS, 1>(row, nb, q + g * stride, stride, s + g); break;
    default: break;
  }
}
#endif

// the scalar paths of dot_codes and axpy_codes (a build without AVX2)
static inline void dot_codes_any(const uint8_t* __restrict row, int64_t nb, int64_t bits, const float* __restrict q,
                                 int64_t stride, int64_t G, float* __restrict s) {
  const int64_t per = unit_per(bits);
  for (int64_t g = 0; g < G; ++g) s[g] = 0.f;
  for (int64_t t = 0; t < per; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * stride + t * nb;
      float a = 0.f;
      if (bits == 3) {
        for (int64_t m = 0; m < nb; ++m) a += static_cast<float>(code_at(row, m, t, 3)) * qg[m];
      } else {
        const int mask = (1 << bits) - 1;
#pragma omp simd reduction(+ : a)
        for (int64_t m = 0; m < nb; ++m) a += static_cast<float>((row[m] >> (t * bits)) & mask) * qg[m];
      }
      s[g] += a;
    }
}
static inline void axpy_codes_any(const uint8_t* __restrict row, int64_t nb, int64_t bits, const float* __restrict w,
                                  int64_t G, float* __restrict acc, int64_t stride) {
  const int64_t per = unit_per(bits);
  for (int64_t t = 0; t < per; ++t)
    for (int64_t g = 0; g < G; ++g) {
      float* a = acc + g * stride + t * nb;
      const float wg = w[g];
      if (bits == 3) {
        for (int64_t m = 0; m < nb; ++m) a[m] += wg * static_cast<float>(code_at(row, m, t, 3));
      } else {
        const int mask = (1 << bits) - 1;
#pragma omp simd
        for (int64_t m = 0; m < nb; ++m) a[m] += wg * static_cast<float>((row[m] >> (t * bits)) & mask);
      }
    }
}

// s[g] = Σ_i cf_i · q[g*stride + i] over the permuted codes of one row, for g < G
static inline void dot_codes(const uint8_t* __restrict row, int64_t nb, int64_t bits, const float* __restrict q,
                             int64_t stride, int64_t G, float* __restrict s) {
#if defined(WUSHKV_SIMD) && defined(WUSHKV_ROWS)
  switch (bits) {
    case 1: return dot_codes_b<1>(row, nb, q, stride, G, s);
    case 2: return dot_codes_b<2>(row, nb, q, stride, G, s);
    case 3: return dot_codes_b<3>(row, nb, q, stride, G, s);
    case 4: return dot_codes_b<4>(row, nb, q, stride, G, s);
    default: return dot_codes_b<8>(row, nb, q, stride, G, s);
  }
#else
  dot_codes_any(row, nb, bits, q, stride, G, s);
#endif
}

// acc[g*stride + i] += w[g] · cf_i over the permuted codes of one row, for g < G
static inline void axpy_codes(const uint8_t* __restrict row, int64_t nb, int64_t bits, const float* __restrict w,
                              int64_t G, float* __restrict acc, int64_t stride) {
#if defined(WUSHKV_SIMD) && defined(WUSHKV_ROWS)
  switch (bits) {
    case 1: return axpy_codes_t<1>(row, nb, w, G, acc, stride);
    case 2: return axpy_codes_t<2>(row, nb, w, G, acc, stride);
    case 3: return axpy_codes8_t<3>(row, nb, w, G, acc, stride);
    case 4: return axpy_codes_t<4>(row, nb, w, G, acc, stride);
    default: return axpy_codes_t<8>(row, nb, w, G, acc, stride);
  }
#else
  axpy_codes_any(row, nb, bits, w, G, acc, stride);
#endif
}

// x[j] <- exp(x[j] - m) for j < n; returns Σ_j of the new x[j]. With AVX-512 or AVX2: exp(y) = 2^k·p(r), y = k·ln2 + r,
// |r| ≤ ln2/2, p the degree-6 Taylor polynomial (relative error below 2e-7, float32's own rounding); scalar
// std::exp otherwise (a call per element, which would cost more than the codes' dot products)
static inline float exp_shifted_sum(float* __restrict x, int64_t n, float m) {
  float l = 0.f;
  int64_t j = 0;
#ifdef WUSHKV_AVX512
  const __m512 vm = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.3f), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2hi = _mm512_set1_ps(0.693359375f), ln2lo = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 c2 = _mm512_set1_ps(1.f / 2), c3 = _mm512_set1_ps(1.f / 6), c4 = _mm512_set1_ps(1.f / 24),
               c5 = _mm512_set1_ps(1.f / 120), c6 = _mm512_set1_ps(1.f / 720), one = _mm512_set1_ps(1.f);
  __m512 sum = _mm512_setzero_ps();
  for (; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    __m512 y = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + j), vm), lo);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(y, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, ln2hi, y);
    r = _mm512_fnmadd_ps(k, ln2lo, r);
    __m512 p = _mm512_fmadd_ps(c6, r, c5);
    p = _mm512_fmadd_ps(p, r, c4);
    p = _mm512_fmadd_ps(p, r, c3);
    p = _mm512_fmadd_ps(p, r, c2);
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
    const __m512 e = _mm512_scalef_ps(p, k);
    _mm512_mask_storeu_ps(x + j, lanes, e);
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
  }
  l = _mm512_reduce_add_ps(sum);
#elif defined(WUSHKV_AVX2)  // the same polynomial; 2^k built in the exponent bits (k ≥ −126 after the clamp at −87.3)
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2hi = _mm256_set1_ps(0.693359375f), ln2lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 c2 = _mm256_set1_ps(1.f / 2), c3 = _mm256_set1_ps(1.f / 6), c4 = _mm256_set1_ps(1.f / 24),
               c5 = _mm256_set1_ps(1.f / 120), c6 = _mm256_set1_ps(1.f / 720), one = _mm256_set1_ps(1.f);
  __m256 sum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 y = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(y, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, ln2hi, y);
    r = _mm256_fnmadd_ps(k, ln2lo, r);
    __m256 p = _mm256_fmadd_ps(c6, r, c5);
    p = _mm256_fmadd_ps(p, r, c4);
    p = _mm256_fmadd_ps(p, r, c3);
    p = _mm256_fmadd_ps(p, r, c2);
    p = _mm256_fmadd_ps(p, r, one);
    p = _mm256_fmadd_ps(p, r, one);
    const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
    _mm256_storeu_ps(x + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  l = hsum8(sum);
  for (; j < n; ++j) {  // the last n % 8
    x[j] = std::exp(x[j] - m);
    l += x[j];
  }
#else
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    l += x[j];
  }
#endif
  return l;
}

// max(m, x_0, ..., x_{n−1}) as the loop m = std::max(m, x_j) gives it (a NaN x_j skipped), in vector lanes: that
// loop's chain of dependent maxes took a fifth of a decode work item's own time (perf, session 79)
static inline float max_of(const float* __restrict x, int64_t n, float m) {
  int64_t j = 0;
#ifdef WUSHKV_AVX512
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 v = ninf;
  for (; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    v = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, lanes, x + j), v);  // the second operand where either is NaN
  }
  m = std::max(m, _mm512_reduce_max_ps(v));
#elif defined(WUSHKV_AVX2)
  __m256 v = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) v = _mm256_max_ps(_mm256_loadu_ps(x + j), v);
  alignas(32) float lane[8];
  _mm256_store_ps(lane, v);
  for (int k = 0; k < 8; ++k) m = std::max(m, lane[k]);
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// acc[g*astride + i] += Σ_j p[g*pstride + j]·sc_j · c_ji and osum[g] += Σ_j p[g*pstride + j]·of_j over `count`
// consecutive cells of one block (cell j at base + j*cstride; sc, of its value side's step and offset): a run of
// tokens read from their codes. The G × d/16 accumulators stay in registers for the whole run (axpy_codes loads and
// stores them for every token, a store-to-load chain per token).
using AxpyRun = void (*)(const uint8_t*, int64_t, int64_t, const CellSide&, int64_t, const float*, int64_t, float*,
                         int64_t, float*);
#ifdef WUSHKV_AVX512
// the run kernels' shared parts: the lane masks of a row's M groups of 16 bytes, and a row's codes as M·(8/BITS)
// vectors of 16 floats in the permuted order (vector mm·(8/BITS) + t, lane m: code t of byte 16·mm + m)
template <int M>
static inline void row_lanes(int64_t nb, __mmask16* lanes) {
  for (int mm = 0; mm < M; ++mm) lanes[mm] = nb - mm * 16 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - mm * 16)) - 1);
}

template <int BITS, int M>
static inline void unpack_codes_v(const uint8_t* row, const __mmask16* lanes, __m512* c) {
  constexpr int PER = 8 / BITS;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
#pragma GCC unroll 4
  for (int mm = 0; mm < M; ++mm) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes[mm], row + mm * 16));
#pragma GCC unroll 8
    for (int t = 0; t < PER; ++t) c[mm * PER + t] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(x, t * BITS), mask));
  }
}

template <int BITS, int GN, int M>
static void axpy_run_t(const uint8_t* base, int64_t cstride, int64_t count, const CellSide& V, int64_t nb, const float* p,
                       int64_t pstride, float* acc, int64_t astride, float* osum) {
  constexpr int PER = 8 / BITS;
  __mmask16 lanes[M];
  row_lanes<M>(nb, lanes);
  __m512 a[GN][M * PER];
  float os[GN];
  for (int g = 0; g < GN; ++g) {
    os[g] = 0.f;
    for (int k = 0; k < M * PER; ++k) a[g][k] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < count; ++j, base += cstride) {
    const float sc = meta_at(base + V.scale, V.meta);
    const float of = V.offset >= 0 ? meta_at(base + V.offset, V.meta) : sc * V.half;
    __m512 w[GN];
    for (int g = 0; g < GN; ++g) {
      const float pg = p[g * pstride + j];
      w[g] = _mm512_set1_ps(pg * sc);
      os[g] += pg * of;
    }
    __m512 c[M * PER];
    unpack_codes_v<BITS, M>(base + V.codes, lanes, c);
#pragma GCC unroll 8
    for (int k = 0; k < M * PER; ++k)
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) a[g][k] = _mm512_fmadd_ps(w[g], c[k], a[g][k]);
  }
  for (int g = 0; g < GN; ++g) {
    osum[g] += os[g];
    for (int mm = 0; mm < M; ++mm)
      for (int t = 0; t < PER; ++t) {
        float* dst = acc + g * astride + t * nb + mm * 16;
        _mm512_mask_storeu_ps(dst, lanes[mm], _mm512_add_ps(_mm512_maskz_loadu_ps(lanes[mm], dst), a[g][mm * PER + t]));
      }
  }
}

template <int BITS, int M>
static AxpyRun axpy_run_g(int64_t G) {
  switch (G) {
    case 1: return axpy_run_t<BITS, 1, M>;
    case 2: return axpy_run_t<BITS, 2, M>;
    case 3: return axpy_run_t<BITS, 3, M>;
    case 4: return axpy_run_t<BITS, 4, M>;
    default: return nullptr;
  }
}
#endif

// s[g*sstride + j] for `count` consecutive key cells of one block read from their codes, the G queries q (permuted,
// qstride apart) held in registers for the whole run: per token (TILE) s_tok·(q·code + add[g]) with add = the tile's
// q·zero, or sc·(q·code) + of·add[g] with add = Σ q. The G dot products are reduced together (hsum4).
using DotRun = void (*)(const uint8_t*, int64_t, int64_t, const CellSide&, int64_t, const float*, int64_t, const float*,
                        float*, int64_t);
#ifdef WUSHKV_AVX512
// the lane sums of a, b, c, d: out[0..3] (fewer shuffles than four _mm512_reduce_add_ps)
static inline void hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}

template <int BITS, int GN, int M, bool TILE>
static void dot_run_t(const uint8_t* base, int64_t cstride, int64_t count, const CellSide& K, int64_t nb, const float* q,
                      int64_t qstride, const float* add, float* s, int64_t sstride) {
  constexpr int PER = 8 / BITS;
  __mmask16 lanes[M];
  row_lanes<M>(nb, lanes);
  __m512 qv[GN][M * PER];
  for (int g = 0; g < GN; ++g)
    for (int mm = 0; mm < M; ++mm)
      for (int t = 0; t < PER; ++t) qv[g][mm * PER + t] = _mm512_maskz_loadu_ps(lanes[mm], q + g * qstride + t * nb + mm * 16);
  for (int64_t j = 0; j < count; ++j, base += cstride) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 c[M * PER];
    unpack_codes_v<BITS, M>(base + K.codes, lanes, c);
#pragma GCC unroll 8
    for (int k = 0; k < M * PER; ++k)
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(c[k], qv[g][k], acc[g]);
    float dots[4];
    hsum4(acc[0], acc[1], acc[2], acc[3], dots);
    if constexpr (TILE) {
      const float st = s_tok_at(base, K.scale);
      for (int g = 0; g < GN; ++g) s[g * sstride + j] = st * (dots[g] + add[g]);
    } else {
      const float sc = meta_at(base + K.scale, K.meta);
      const float of = K.offset >= 0 ? meta_at(base + K.offset, K.meta) : sc * K.half;
      for (int g = 0; g < GN; ++g) s[g * sstride + j] = sc * dots[g] + of * add[g];
    }
  }
}

template <int BITS, int M, bool TILE>
static DotRun dot_run_g(int64_t G) {
  switch (G) {
    case 1: return dot_run_t<BITS, 1, M, TILE>;
    case 2: return dot_run_t<BITS, 2, M, TILE>;
    case 3: return dot_run_t<BITS, 3, M, TILE>;
    case 4: return dot_run_t<BITS, 4, M, TILE>;
    default: return nullptr;
  }
}

template <bool TILE>
static DotRun dot_run_m(int64_t bits, int64_t G, int64_t M) {
  switch (bits * 10 + M) {
    case 11: return dot_run_g<1, 1, TILE>(G);
    case 21: return dot_run_g<2, 1, TILE>(G);
    case 22: return dot_run_g<2, 2, TILE>(G);
    case 41: return dot_run_g<4, 1, TILE>(G);
    case 42: return dot_run_g<4, 2, TILE>(G);
    case 44: return dot_run_g<4, 4, TILE>(G);
    case 81: return dot_run_g<8, 1, TILE>(G);
    case 82: return dot_run_g<8, 2, TILE>(G);
    case 84: return dot_run_g<8, 4, TILE>(G);
    default: return nullptr;
  }
}
#endif

#ifdef WUSHKV_ROWS
// Σ_j w[g·wstride + j]·(codes of row j) for count rows cstride bytes apart, added to acc[g·astride + ...] (permuted
// order): 8 bytes of every row at a time, the G × (8/BITS) sums of those lanes in registers over the rows (TC codes a
// byte a pass where they would not fit: 1 bit, or 4 queries), then added to acc once
template <int BITS, int GN>
static void axpy_rows_t(const uint8_t* rows, int64_t cstride, int64_t count, int64_t nb, const float* w, int64_t wstride,
                        float* acc, int64_t astride) {
  constexpr int PER = Unit<BITS>::PER, UB = Unit<BITS>::BYTES;
  constexpr int TC = GN * PER <= 12 ? PER : (12 / GN >= 4 ? 4 : (12 / GN >= 2 ? 2 : 1));
  for (int64_t m = 0; m < nb; m += 8) {
    const int64_t left = nb - m;
    const __m256i lm = lanes8(left);
    for (int t0 = 0; t0 < PER; t0 += TC) {
      __m256 a[GN][TC];
      for (int g = 0; g < GN; ++g)
        for (int t = 0; t < TC; ++t) a[g][t] = _mm256_setzero_ps();
      const uint8_t* row = rows + m * UB;
      for (int64_t j = 0; j < count; ++j, row += cstride) {
        const __m256i x = load8<BITS>(row, left);
        __m256 wg[GN];
        for (int g = 0; g < GN; ++g) wg[g] = _mm256_broadcast_ss(w + g * wstride + j);
#pragma GCC unroll 8
        for (int t = 0; t < TC; ++t) {
          const __m256 c = code8<BITS>(x, t0 + t);
#pragma GCC unroll 4
          for (int g = 0; g < GN; ++g) a[g][t] = _mm256_fmadd_ps(wg[g], c, a[g][t]);
        }
      }
      for (int g = 0; g < GN; ++g)
        for (int t = 0; t < TC; ++t) {
          float* dst = acc + g * astride + (t0 + t) * nb + m;
          if (left >= 8)
            _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), a[g][t]));
          else
            _mm256_maskstore_ps(dst, lm, _mm256_add_ps(_mm256_maskload_ps(dst, lm), a[g][t]));
        }
    }
  }
}
// out[g·ostride + j] = Σ_i c_ji q[g·qstride + i] (permuted order) for count rows cstride bytes apart, GN ≤ 4 queries:
// TT rows at a time, each query's vector loaded once for all of them, and the TT × GN sums reduced together (hadd
// trees: one horizontal sum per TT rows, not per row); the last count % TT rows one by one (dot_codes_t)
template <int BITS, int GN>
static void dot_rows_t(const uint8_t* rows, int64_t cstride, int64_t count, int64_t nb, const float* q, int64_t qstride,
                       float* out, int64_t ostride) {
  constexpr int PER = Unit<BITS>::PER, UB = Unit<BITS>::BYTES;
  constexpr int TT = GN <= 3 ? 4 : 2;  // TT × GN accumulators, a query and a code vector in 16 registers
  int64_t j = 0;
  for (; j + TT <= count; j += TT) {
    __m256 a[TT][GN];
    for (int r = 0; r < TT; ++r)
      for (int g = 0; g < GN; ++g) a[r][g] = _mm256_setzero_ps();
    const uint8_t* row = rows + j * cstride;
    for (int64_t m = 0; m < nb; m += 8) {
      const int64_t left = nb - m;
      const __m256i lm = lanes8(left);
#pragma GCC unroll 8
      for (int t = 0; t < PER; ++t) {
        __m256 c[TT];
#pragma GCC unroll 4
        for (int r = 0; r < TT; ++r) c[r] = code8<BITS>(load8<BITS>(row + r * cstride + m * UB, left), t);
#pragma GCC unroll 4
        for (int g = 0; g < GN; ++g) {
          const float* qg = q + g * qstride + t * nb + m;
          const __m256 qv = left >= 8 ? _mm256_loadu_ps(qg) : _mm256_maskload_ps(qg, lm);
#pragma GCC unroll 4
          for (int r = 0; r < TT; ++r) a[r][g] = _mm256_fmadd_ps(c[r], qv, a[r][g]);
        }
      }
    }
    for (int g = 0; g < GN; ++g) {
      float* o = out + g * ostride + j;
      if constexpr (TT == 4) {  // [Σa0, Σa1, Σa2, Σa3]
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0][g], a[1][g]), _mm256_hadd_ps(a[2][g], a[3][g]));
        _mm_storeu_ps(o, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
      } else {  // [Σa0, Σa1, Σa0, Σa1]
        const __m256 h = _mm256_hadd_ps(a[0][g], a[1][g]);
        const __m256 s = _mm256_hadd_ps(h, h);
        _mm_storel_pi(reinterpret_cast<__m64*>(o), _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
      }
    }
  }
  for (; j < count; ++j) {
    float d[GN];
    dot_codes_g<BITS, GN>(rows + j * cstride, nb, q, qstride, d);
    for (int g = 0; g < GN; ++g) out[g * ostride + j] = d[g];
  }
}
#endif

#ifdef WUSHKV_AVX2
// AVX2's 16 registers do not hold a run's queries or value sums whole, so its runs go otherwise than AVX-512's.
// Keys: token by token, the G dot products (dot_codes_t, queries from L1) and the cell's scaling in one call.
template <int BITS, int GN, bool TILE>
static void dot_run_t(const uint8_t* base, int64_t cstride, int64_t count, const CellSide& K, int64_t nb, const float* q,
                      int64_t qstride, const float* add, float* s, int64_t sstride) {
  for (int64_t j = 0; j < count; ++j, base += cstride) {
    float dots[GN];
    dot_codes_t<BITS, GN>(base + K.codes, nb, q, qstride, dots);
    if constexpr (TILE) {
      const float st = s_tok_at(base, K.scale);
      for (int g = 0; g < GN; ++g) s[g * sstride + j] = st * (dots[g] + add[g]);
    } else {
      const float sc = meta_at(base + K.scale, K.meta);
      const float of = K.offset >= 0 ? meta_at(base + K.offset, K.meta) : sc * K.half;
      for (int g = 0; g < GN; ++g) s[g * sstride + j] = sc * dots[g] + of * add[g];
    }
  }
}

template <int BITS, bool TILE>
static DotRun dot_run_g(int64_t G) {
  switch (G) {
    case 1: return dot_run_t<BITS, 1, TILE>;
    case 2: return dot_run_t<BITS, 2, TILE>;
    case 3: return dot_run_t<BITS, 3, TILE>;
    case 4: return dot_run_t<BITS, 4, TILE>;
    default: return nullptr;
  }
}

// Values: each cell's weights p·step (and its offsets' share of the sum), then axpy_rows_t over the run's codes.
static constexpr int64_t AXPY_RUN_MAX = 512;  // a run lies in one split (PAGED_CHUNK tokens)

template <int BITS, int GN>
static void axpy_run_t(const uint8_t* base, int64_t cstride, int64_t count, const CellSide& V, int64_t nb, const float* p,
                       int64_t pstride, float* acc, int64_t astride, float* osum) {
  for (; count > AXPY_RUN_MAX; count -= AXPY_RUN_MAX, base += AXPY_RUN_MAX * cstride, p += AXPY_RUN_MAX)  // (not reached)
    axpy_run_t<BITS, GN>(base, cstride, AXPY_RUN_MAX, V, nb, p, pstride, acc, astride, osum);
  float w[GN][AXPY_RUN_MAX];
  float os[GN] = {};
  const uint8_t* cell = base;
  for (int64_t j = 0; j < count; ++j, cell += cstride) {  // each cell's weights p·step, and its offsets' share
    const float sc = meta_at(cell + V.scale, V.meta);
    const float of = V.offset >= 0 ? meta_at(cell + V.offset, V.meta) : sc * V.half;
    for (int g = 0; g < GN; ++g) {
      w[g][j] = p[g * pstride + j] * sc;
      os[g] += p[g * pstride + j] * of;
    }
  }
  for (int g = 0; g < GN; ++g) osum[g] += os[g];
  axpy_rows_t<BITS, GN>(base + V.codes, cstride, count, nb, &w[0][0], AXPY_RUN_MAX, acc, astride);
}
template <int BITS>
static AxpyRun axpy_run_g(int64_t G) {
  switch (G) {
    case 1: return axpy_run_t<BITS, 1>;
    case 2: return axpy_run_t<BITS, 2>;
    case 3: return axpy_run_t<BITS, 3>;
    case 4: return axpy_run_t<BITS, 4>;
    default: return nullptr;
  }
}
#endif

// the register-resident key run for (bits, G, nb, tiles or not), or nullptr (then each token goes through dot_codes)
static DotRun dot_run_for(int64_t bits, int64_t G, int64_t nb, bool tile) {
#ifdef WUSHKV_AVX512
  if (bits == 3) return nullptr;  // (16-lane runs read whole bytes)
  const int64_t M = (nb + 15) / 16, per = 8 / bits;
  if (G < 1 || G > 4 || G * M * per > 16) return nullptr;  // the queries in at most 16 registers
  return tile ? dot_run_m<true>(bits, G, M) : dot_run_m<false>(bits, G, M);
#elif defined(WUSHKV_AVX2)
  (void)nb;
  switch (bits) {
    case 1: return tile ? dot_run_g<1, true>(G) : dot_run_g<1, false>(G);
    case 2: return tile ? dot_run_g<2, true>(G) : dot_run_g<2, false>(G);
    case 3: return tile ? dot_run_g<3, true>(G) : dot_run_g<3, false>(G);
    case 4: return tile ? dot_run_g<4, true>(G) : dot_run_g<4, false>(G);
    default: return tile ? dot_run_g<8, true>(G) : dot_run_g<8, false>(G);
  }
#else
  (void)bits, (void)G, (void)nb, (void)tile;
  return nullptr;
#endif
}

// the register-resident run for (bits, G, nb), or nullptr (no SIMD path, or more accumulators than registers hold):
// then each token goes through axpy_codes
static AxpyRun axpy_run_for(int64_t bits, int64_t G, int64_t nb) {
#ifdef WUSHKV_AVX512
  if (bits == 3) return nullptr;
  const int64_t M = (nb + 15) / 16, per = 8 / bits;
  if (G < 1 || G > 4 || G * M * per > 24) return nullptr;
  switch (bits * 10 + M) {
    case 11: return axpy_run_g<1, 1>(G);
    case 21: return axpy_run_g<2, 1>(G);
    case 22: return axpy_run_g<2, 2>(G);
    case 41: return axpy_run_g<4, 1>(G);
    case 42: return axpy_run_g<4, 2>(G);
    case 44: return axpy_run_g<4, 4>(G);
    case 81: return axpy_run_g<8, 1>(G);
    case 82: return axpy_run_g<8, 2>(G);
    case 84: return axpy_run_g<8, 4>(G);
    default: return nullptr;
  }
#elif defined(WUSHKV_AVX2)
  (void)nb;
  switch (bits) {
    case 1: return axpy_run_g<1>(G);
    case 2: return axpy_run_g<2>(G);
    case 3: return axpy_run_g<3>(G);
    case 4: return axpy_run_g<4>(G);
    default: return axpy_run_g<8>(G);
  }
#else
  (void)bits, (void)G, (void)nb;
  return nullptr;
#endif
}

#ifdef WUSHKV_ROWS
// axpy_rows_t and dot_rows_t take the same arguments: one dispatch serves both (rows_for<AxpyRows> / <DotRows>)
using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t);
template <int BITS, int GN>
struct AxpyRows {
  static constexpr RowsFn run = axpy_rows_t<BITS, GN>;
};
template <int BITS, int GN>
struct DotRows {
  static constexpr RowsFn run = dot_rows_t<BITS, GN>;
};
template <template <int, int> class K, int BITS>
static RowsFn rows_g(int64_t G) {
  switch (G) {
    case 1: return K<BITS, 1>::run;
    case 2: return K<BITS, 2>::run;
    case 3: return K<BITS, 3>::run;
    default: return K<BITS, 4>::run;
  }
}
// kernel K for (bits, G ≤ 4)
template <template <int, int> class K>
static RowsFn rows_for(int64_t bits, int64_t G) {
  switch (bits) {
    case 1: return rows_g<K, 1>(G);
    case 2: return rows_g<K, 2>(G);
    case 3: return rows_g<K, 3>(G);
    case 4: return rows_g<K, 4>(G);
    default: return rows_g<K, 8>(G);
  }
}
#endif

// Each (b, h) row's codes are read in the permuted order of dot_codes / axpy_codes: a query is permuted once per
// work item (channel i = m·PER + t, code t of unit m, goes to t·nb + m), a value sum back once at the end; no byte tables.
static inline void permute_query(const float* q, int64_t d, int64_t nb, int64_t per, float* qz) {
  for (int64_t i = 0; i < d; ++i) qz[(i % per) * nb + i / per] = q[i];  // channels d..D-1 stay 0 (padding codes)
}

// out[b, h, g, j] = Σ_i c_ji q[b, h, j / span, g, i]: token j against the query set of its span (span ≥ N: one set;
// KVarN's key tiles: one set of channel-scaled queries per tile of `span` tokens). Given a bias (B,H,Q,G) and a
// per-token scale (B,H,N) (both defined or neither): out = scale_j · (Σ_i c_ji q_i + bias[set, g]), the key tiles'
// q·zero and s_tok applied in the same pass
static torch::Tensor code_dot_spans(const torch::Tensor& codes, torch::Tensor q, int64_t bits, int64_t span,
                                    torch::Tensor bias = {}, torch::Tensor tscale = {}) {
  check(codes, bits);
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 5, "q: float32 (B,H,Q,G,d)");
  q = q.contiguous();
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), nb = codes.size(3) / unit_bytes(bits);
  const int64_t Q = q.size(2), G = q.size(3), d = q.size(4), per = unit_per(bits), D = nb * per;
  TORCH_CHECK(q.size(0) == B && q.size(1) == H && D >= d, "shapes of codes and q do not match");
  TORCH_CHECK(span >= 1 && Q * span >= N, "the query sets (", Q, " of ", span, " tokens) do not cover the ", N, " tokens");
  const bool affine = bias.defined();
  TORCH_CHECK(affine == tscale.defined(), "bias and per-token scale come together");
  if (affine) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.dim() == 4 && bias.size(0) == B && bias.size(1) == H &&
                bias.size(2) == Q && bias.size(3) == G, "bias: float32 (B,H,Q,G)");
    TORCH_CHECK(tscale.scalar_type() == torch::kFloat && tscale.dim() == 3 && tscale.size(0) == B && tscale.size(1) == H &&
                tscale.size(2) == N, "per-token scale: float32 (B,H,N)");
    bias = bias.contiguous();
    tscale = tscale.contiguous();
  }
  const float* biasp = affine ? bias.data_ptr<float>() : nullptr;
  const float* tsp = affine ? tscale.data_ptr<float>() : nullptr;
  auto out = torch::empty({B, H, G, N}, q.options());
  const int64_t nchunks = (N + CHUNK - 1) / CHUNK;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = codes.stride(0), sh = codes.stride(1), sn = codes.stride(2);
  at::parallel_for(0, B * H * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qz(G * D, 0.f), s(G);
    int64_t loaded = -1;  // bh·Q + the query set in qz
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nchunks, c = it % nchunks, b = bh / H, h = bh % H;
      const uint8_t* base = cp + b * sb + h * sh;
      float* ob = op + bh * G * N;
      const int64_t j1 = std::min(N, (c + 1) * CHUNK);
#ifdef WUSHKV_ROWS
      // the chunk's rows of each query set at once (dot_rows_t), then the set's bias and the tokens' scales
      for (int64_t j = c * CHUNK; j < j1;) {
        const int64_t set = bh * Q + j / span, e = std::min(j1, (j / span + 1) * span);
        if (set != loaded) {
          for (int64_t g = 0; g < G; ++g) permute_query(qp + (set * G + g) * d, d, nb, per, qz.data() + g * D);
          loaded = set;
        }
        for (int64_t g = 0; g < G; g += 4)
          rows_for<DotRows>(bits, std::min<int64_t>(4, G - g))(base + j * sn, sn, e - j, nb, qz.data() + g * D, D, ob + g * N + j, N);
        if (affine) {
          const float* bs = biasp + loaded * G;
          for (int64_t g = 0; g < G; ++g)
            for (int64_t k = j; k < e; ++k) ob[g * N + k] = tsp[bh * N + k] * (ob[g * N + k] + bs[g]);
        }
        j = e;
      }
      continue;
#endif
      for (int64_t j = c * CHUNK; j < j1; ++j) {
        const int64_t set = bh * Q + j / span;
        if (set != loaded) {
          for (int64_t g = 0; g < G; ++g) permute_query(qp + (set * G + g) * d, d, nb, per, qz.data() + g * D);
          loaded = set;
        }
        dot_codes(base + j * sn, nb, bits, qz.data(), D, G, s.data());
        if (affine) {
          const float* bs = biasp + loaded * G;
          const float t = tsp[bh * N + j];
          for (int64_t g = 0; g < G; ++g) ob[g * N + j] = t * (s[g] + bs[g]);
        } else {
          for (int64_t g = 0; g < G; ++g) ob[g * N + j] = s[g];
        }
      }
    }
  });
  return out;
}

torch::Tensor code_dot(torch::Tensor codes, torch::Tensor q, int64_t bits) {
  TORCH_CHECK(q.dim() == 4, "q: float32 (B,H,G,d)");
  return code_dot_spans(codes, q.unsqueeze(2), bits, std::max<int64_t>(codes.size(2), 1));
}

torch::Tensor code_dot_tiles(torch::Tensor codes, torch::Tensor q, int64_t bits, int64_t tile, torch::Tensor bias,
                             torch::Tensor tscale) {
  return code_dot_spans(codes, q, bits, tile, bias, tscale);
}

torch::Tensor code_weighted_sum(torch::Tensor codes, torch::Tensor w, int64_t bits, int64_t d) {
  check(codes, bits);
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 4, "w: float32 (B,H,G,N)");
  w = w.contiguous();
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), nb = codes.size(3) / unit_bytes(bits);
  const int64_t G = w.size(2), per = unit_per(bits), D = nb * per;
  TORCH_CHECK(w.size(0) == B && w.size(1) == H && w.size(3) == N && D >= d, "shapes of codes and w do not match");
  const int64_t nchunks = (N + CHUNK - 1) / CHUNK;
  auto partial = torch::zeros({B * H, nchunks, G, D}, w.options());  // sums in the permuted order
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* wp = w.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  const int64_t sb = codes.stride(0), sh = codes.stride(1), sn = codes.stride(2);
  at::parallel_for(0, B * H * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wj(G);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nchunks, c = it % nchunks, b = bh / H, h = bh % H;
      const uint8_t* base = cp + b * sb + h * sh;
      const float* wb = wp + bh * G * N;
      float* acc = pp + (bh * nchunks + c) * G * D;
      const int64_t j1 = std::min(N, (c + 1) * CHUNK);
#ifdef WUSHKV_ROWS
      // the chunk's rows at once, up to 4 queries' sums of 8 lanes in registers (axpy_rows_t)
      for (int64_t g = 0; g < G; g += 4)
        rows_for<AxpyRows>(bits, std::min<int64_t>(4, G - g))(base + c * CHUNK * sn, sn, j1 - c * CHUNK, nb,
                                                              wb + g * N + c * CHUNK, N, acc + g * D, D);
      continue;
#endif
      for (int64_t j = c * CHUNK; j < j1; ++j) {
        for (int64_t g = 0; g < G; ++g) wj[g] = wb[g * N + j];
        axpy_codes(base + j * sn, nb, bits, wj.data(), G, acc, D);
      }
    }
  });
  std::vector<int64_t> place(d);  // channel i's place in the permuted order
  for (int64_t i = 0; i < d; ++i) place[i] = (i % per) * nb + i / per;
  auto idx = torch::tensor(place, torch::kLong);
  return partial.sum(1).index_select(-1, idx).reshape({B, H, G, d});
}

#ifdef WUSHKV_ROWS
// 8 channels of a full-precision row as float32 lanes (float32, bfloat16; float16 where the CPU converts it: F16C)
template <typename T>
static inline __m256 load8f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}
template <typename T>
static constexpr bool LOAD8F = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>
#ifdef __F16C__
                               || std::is_same_v<T, c10::Half>
#endif
    ;

// out[g·ostride + j] = q_g · row_j for count full-precision rows `stride` elements apart (d a multiple of 8), GN ≤ 4
// queries: as dot_rows_t, TT rows at a time and one horizontal sum per TT rows (a dot per row and query, reduced
// alone, cost 60 ns a token-head at SmolLM2's shape, a latency chain and a scalar sum)
template <typename T, int GN>
static void fp_dot_rows_t(const T* rows, int64_t stride, int64_t count, int64_t d, const float* q, int64_t qstride,
                          float* out, int64_t ostride) {
  constexpr int TT = GN <= 3 ? 4 : 2;
  int64_t j = 0;
  for (; j + TT <= count; j += TT) {
    __m256 a[TT][GN];
    for (int r = 0; r < TT; ++r)
      for (int g = 0; g < GN; ++g) a[r][g] = _mm256_setzero_ps();
    const T* row = rows + j * stride;
    for (int64_t m = 0; m < d; m += 8) {
      __m256 k[TT];
#pragma GCC unroll 4
      for (int r = 0; r < TT; ++r) k[r] = load8f(row + r * stride + m);
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * qstride + m);
#pragma GCC unroll 4
        for (int r = 0; r < TT; ++r) a[r][g] = _mm256_fmadd_ps(k[r], qv, a[r][g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      float* o = out + g * ostride + j;
      if constexpr (TT == 4) {
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0][g], a[1][g]), _mm256_hadd_ps(a[2][g], a[3][g]));
        _mm_storeu_ps(o, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
      } else {
        const __m256 h = _mm256_hadd_ps(a[0][g], a[1][g]);
        const __m256 s = _mm256_hadd_ps(h, h);
        _mm_storel_pi(reinterpret_cast<__m64*>(o), _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
      }
    }
  }
  for (; j < count; ++j) {
    const T* row = rows + j * stride;
    __m256 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm256_setzero_ps();
    for (int64_t m = 0; m < d; m += 8) {
      const __m256 k = load8f(row + m);
      for (int g = 0; g < GN; ++g) a[g] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q + g * qstride + m), a[g]);
    }
    for (int g = 0; g < GN; ++g) out[g * ostride + j] = hsum8(a[g]);
  }
}

// acc[g·astride + i] += Σ_j w[g·wstride + j]·row_j[i] over count full-precision rows (d a multiple of 8), GN ≤ 4:
// 16 channels at a time, the GN × 2 sums in registers over the rows, added to acc once
template <typename T, int GN>
static void fp_axpy_rows_t(const T* rows, int64_t stride, int64_t count, int64_t d, const float* w, int64_t wstride,
                           float* acc, int64_t astride) {
  for (int64_t m = 0; m < d; m += 16) {
    const bool two = m + 16 <= d;
    __m256 a[GN][2];
    for (int g = 0; g < GN; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
    const T* row = rows + m;
    for (int64_t j = 0; j < count; ++j, row += stride) {
      const __m256 v0 = load8f(row), v1 = two ? load8f(row + 8) : _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int g = 0; g < GN; ++g) {
        const __m256 wg = _mm256_broadcast_ss(w + g * wstride + j);
        a[g][0] = _mm256_fmadd_ps(wg, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(wg, v1, a[g][1]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      float* dst = acc + g * astride + m;
      _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), a[g][0]));
      if (two) _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_loadu_ps(dst + 8), a[g][1]));
    }
  }
}

using FpRowsFn = void (*)(const void*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t);
template <typename T, int GN, bool DOT>
static void fp_rows_erased(const void* rows, int64_t stride, int64_t count, int64_t d, const float* x, int64_t xstride,
                           float* y, int64_t ystride) {
  if constexpr (DOT)
    fp_dot_rows_t<T, GN>(static_cast<const T*>(rows), stride, count, d, x, xstride, y, ystride);
  else
    fp_axpy_rows_t<T, GN>(static_cast<const T*>(rows), stride, count, d, x, xstride, y, ystride);
}
// the full-precision rows kernel for T, G ≤ 4 queries, dot products (DOT) or weighted sums; nullptr where T has no
// vector load here (float64; float16 without F16C)
template <typename T, bool DOT>
static FpRowsFn fp_rows_for(int64_t G) {
  if constexpr (!LOAD8F<T>) {
    (void)G;
    return nullptr;
  } else {
    switch (G) {
      case 1: return fp_rows_erased<T, 1, DOT>;
      case 2: return fp_rows_erased<T, 2, DOT>;
      case 3: return fp_rows_erased<T, 3, DOT>;
      default: return fp_rows_erased<T, 4, DOT>;
    }
  }
}
#endif

static constexpr int64_t PAGED_CHUNK = 512;  // tokens per split: a request's context is several work items
// token-heads below which a step runs on one thread (~50 µs of work, as PARTS_SERIAL). It was 16,384, which left
// SmolLM2's 4 requests × 1k tokens × 3 heads on one core in vLLM: its worker's threads are bound and awake, and a
// layer's cells and copies come cold from memory (0.6 ms a layer on one thread, 0.3 ms on two: session 77)
static constexpr int64_t PAGED_SERIAL = 2048;

template <typename scalar_t>
static void paged_decode_impl(const torch::Tensor& cache, const torch::Tensor& table, const torch::Tensor& lens,
                              const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& written,
                              const torch::Tensor& page_index, CellSide K, CellSide V, int64_t sink, int64_t recent,
                              int64_t flush, int64_t window, float scale, float softcap, const float* abp,
                              const float* rtp, torch::Tensor& out) {
  const int64_t H = cache.size(1), bs = cache.size(2);
  const int64_t s0 = cache.stride(0), s1 = cache.stride(1), s2 = cache.stride(2);
  const int64_t R = q.size(0), Hq = q.size(1), d = q.size(2), G = Hq / H, MB = table.size(1);
  TORCH_CHECK(K.tile == 0 || (bs % K.tile == 0 && K.tile * K.tmeta_w >= 4 * d), "key tiles must lie in blocks and hold ",
              "their scale and zero");
  TORCH_CHECK(V.tile == 0 || (bs % V.tile == 0 && V.tile * V.tmeta_w >= 2 * d && V.tmeta_w % 2 == 0 && V.offset >= 0),
              "value tiles must lie in blocks, hold their channel scales in whole f16s and each token's zero");
  const int64_t U = pool.size(1), ppb = bs / U, npages = page_index.size(0);
  // the pool's strides (elements) of a row, a slot and a head: (P, U, H, 2, d) stored token-major or head-major
  // (Windows(head_major=True): a head's rows of a page contiguous, which the prefetchers stream); K and V rows dense
  const int64_t ps0 = pool.stride(0), ps1 = pool.stride(1), ps2 = pool.stride(2);
  TORCH_CHECK((K.bits != 3 && V.bits != 3) || d % 8 == 0, "3-bit cells are read 8 codes (3 bytes) at a time: head_dim ",
              d, " must be a multiple of 8");
  const int64_t kper = unit_per(K.bits), vper = unit_per(V.bits);
  const int64_t knb = (d * K.bits + 7) / 8 / unit_bytes(K.bits), vnb = (d * V.bits + 7) / 8 / unit_bytes(V.bits);
  const int64_t KD = knb * kper, VD = vnb * vper;
  const uint8_t* cp = cache.data_ptr<uint8_t>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const scalar_t* pp = pool.data_ptr<scalar_t>();
  const bool* wp = written.data_ptr<bool>();
  const int32_t* ip = page_index.data_ptr<int32_t>();

  // work items: (request, KV head, token range); the splits of one (request, head) are consecutive
  std::vector<int64_t> item_r, item_a, item_b, first(R * H + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lp[r], lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    TORCH_CHECK(n >= 1 && (n + bs - 1) / bs <= MB, "seq_lens[", r, "] = ", n, " does not fit the block table");
    for (int64_t h = 0; h < H; ++h) {
      first[r * H + h] = item_r.size();
      for (int64_t a = lo; a < n; a += PAGED_CHUNK) {
        item_r.push_back(r * H + h);
        item_a.push_back(a);
        item_b.push_back(std::min(n, a + PAGED_CHUNK));
      }
    }
  }
  first[R * H] = item_r.size();
  const int64_t items = item_r.size(), W = 2 * G + G * d;  // per item: max, sum, unnormalized output, per query
  std::vector<float> part(items * W);

  // queries and value sums in the permuted order of dot_codes / axpy_codes
  // a small step runs on the calling thread: waking the pool's threads costs more than its work (and, on a machine
  // shared with other processes, a descheduled thread holds the whole step at the join)
  int64_t tokens = 0;
  for (int64_t it = 0; it < items; ++it) tokens += item_b[it] - item_a[it];
  const int64_t grain = tokens < PAGED_SERIAL ? std::max<int64_t>(items, 1) : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    // the closure's sizes as locals: the stores below would otherwise make the compiler reload them every token
    const int64_t H_ = H, G_ = G, d_ = d, bs_ = bs, U_ = U, KD_ = KD, VD_ = VD, knb_ = knb, vnb_ = vnb;
    const int64_t s0_ = s0, s1_ = s1, s2_ = s2, ps0_ = ps0, ps1_ = ps1, ps2_ = ps2;
    const CellSide K_ = K, V_ = V;
    const AxpyRun vrun = axpy_run_for(V_.bits, G_, vnb_);
    const DotRun krun = dot_run_for(K_.bits, G_, knb_, K_.tile > 0);
#ifdef WUSHKV_ROWS
    // the windows' copies in runs through the full-precision rows kernels (d a multiple of 8; a vector load for the pool's dtype)
    const bool fp_rows = d_ % 8 == 0 && fp_rows_for<scalar_t, true>(1) != nullptr;
#endif
    std::vector<int64_t> kperm(d_);  // channel i's place in the permuted order of dot_codes (no division per tile)
    for (int64_t i = 0; i < d_; ++i) kperm[i] = (i % kper) * knb_ + i / kper;
    std::vector<float> qz(G_ * d_), qk(G_ * KD_, 0.f), qsum(G_), dots(G_), s(G_ * PAGED_CHUNK), kf(d_);
    std::vector<float> acc(G_ * VD_), accf(G_ * d_), osum(G_);
    std::vector<int64_t> src(PAGED_CHUNK);  // per token: its copy's offset in the pool (head 0), or -1 (read the codes)
    // key tiles: the queries scaled by the current tile's channel scales (permuted), their dot with its zeros
    const int64_t KT = K_.tile;
    std::vector<float> qkt(KT ? G_ * KD_ : 0, 0.f), qzt(G_), tsc(KT ? 2 * d_ : 0), tscp(KT ? KD_ : 0, 0.f);
    std::vector<uint8_t> tmeta(KT ? KT * K_.tmeta_w : 0);
    // value tiles (KVarN's): v[t, i] = s_chan[i]·(scale_t·code + zero_t); a run of one tile's cells is summed per token
    // (acct, osumt: Σ p·scale·code, Σ p·zero), then times the tile's channel scales (vsc; vscp permuted as acc)
    const int64_t VT = V_.tile;
    std::vector<float> acct(VT ? G_ * VD_ : 0), osumt(G_), vsc(VT ? d_ : 0), vscp(VT ? VD_ : 0, 0.f);
    std::vector<int64_t> vperm(d_);  // channel i's place in the values' permuted order (no division per item)
    for (int64_t i = 0; i < d_; ++i) vperm[i] = (i % vper) * vnb_ + i / vper;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t rh = item_r[it], r = rh / H_, h = rh % H_, a = item_a[it], b = item_b[it], n = lp[r];
      const int64_t len = b - a;
      // wushkv's windows: the middle read from codes is [sink, sink + Qc(n)), Qc(n) = flush·⌊(n − sink − recent)⁺/flush⌋
      const int64_t mid_end = sink + flush * (std::max<int64_t>(0, n - sink - recent) / flush);
      int64_t tile_lo = 0, tile_hi = 0;  // the tile whose scales qkt/qzt hold, [tile_lo, tile_hi): none yet
      std::fill(qk.begin(), qk.end(), 0.f);
      for (int64_t g = 0; g < G_; ++g) {
        float sum = 0.f;
        for (int64_t i = 0; i < d_; ++i) {
          const float x = qp[(r * Hq + h * G_ + g) * d_ + i];
          qz[g * d_ + i] = x;
          qk[g * KD_ + kperm[i]] = x;
          sum += x;
        }
        qsum[g] = sum;
      }
      const int32_t* row = tp + r * MB;
      // 0. the window positions of this range (t < sink or t > n − 1 − recent) whose copy is held: read from the pool
      std::fill(src.begin(), src.begin() + len, -1);
      for (int64_t t = a; t < b; ++t) {
        if (t >= sink && t < mid_end) {  // the middle: jump to the tail
          t = mid_end - 1;
          continue;
        }
        const int64_t blk = row[t / bs_], off = t % bs_, page = blk * ppb + off / U_;
        if (page < npages) {
          const int32_t e = ip[page];
          if (e >= 0 && wp[e * U_ + off % U_]) {
            src[t - a] = e * ps0_ + (off % U_) * ps1_;
            // the copy's key and value rows, asked for now: a window's rows lie 2·H·d apart in pages scattered
            // over the pool, which the hardware's prefetchers do not follow (read cold, each token waited for them)
            const char* kr = reinterpret_cast<const char*>(pp + src[t - a] + h * ps2_);
            for (int64_t o = 0; o < 2 * d_ * static_cast<int64_t>(sizeof(scalar_t)); o += 64) __builtin_prefetch(kr + o);
          }
        }
      }
      // the scales of the tile holding position t (in block blk) folded into the queries: qkt, qzt
      auto load_tile = [&](int64_t t, int64_t blk) {
        tile_lo = t / KT * KT;
        tile_hi = tile_lo + KT;
        const int64_t off0 = (t % bs_) / KT * KT;  // the tile's first slot in this block
        const uint8_t* tb = cp + blk * s0_ + h * s1_ + off0 * s2_ + K_.tmeta;
        if (K_.tmeta_w == 2) {  // one f16 a cell (the plugin's spread tiles): a strided read, no inner loop
          for (int64_t i = 0; i < 2 * d_; ++i) tsc[i] = meta_at(tb + i * s2_, 0);
        } else if (K_.tmeta_w % 2 == 0) {  // no f16 straddles two cells: read them in place, scale (d) then zero (d)
          int64_t i = 0;
          for (int64_t o = 0; o < KT && i < 2 * d_; ++o)
            for (int64_t k = 0; k + 1 < K_.tmeta_w && i < 2 * d_; k += 2) tsc[i++] = meta_at(tb + o * s2_ + k, 0);
        } else {  // gather the slices, then read
          for (int64_t o = 0; o < KT; ++o)
            for (int64_t k = 0; k < K_.tmeta_w; ++k) tmeta[o * K_.tmeta_w + k] = tb[o * s2_ + k];
          for (int64_t i = 0; i < 2 * d_; ++i) tsc[i] = meta_at(tmeta.data() + 2 * i, 0);
        }
        // the queries' permuted copy qk times the scales in the same order: the products of a scatter through kperm
        // per query head, in a contiguous (vectorized) loop
        for (int64_t i = 0; i < d_; ++i) tscp[kperm[i]] = tsc[i];
        for (int64_t g = 0; g < G_; ++g) {
          const float* qg = qk.data() + g * KD_;
          float* og = qkt.data() + g * KD_;
          for (int64_t k = 0; k < KD_; ++k) og[k] = qg[k] * tscp[k];
          float z = 0.f;
          for (int64_t i = 0; i < d_; ++i) z += qz[g * d_ + i] * tsc[d_ + i];
          qzt[g] = z;
        }
      };
      int64_t vtile_lo = 0, vtile_hi = 0;  // the value tile whose channel scales vsc/vscp hold
      auto load_vtile = [&](int64_t t, int64_t blk) {
        vtile_lo = t / VT * VT;
        vtile_hi = vtile_lo + VT;
        const uint8_t* tb = cp + blk * s0_ + h * s1_ + ((t % bs_) / VT * VT) * s2_ + V_.tmeta;
        int64_t i = 0;  // whole f16s in each cell (V_.tmeta_w even)
        for (int64_t o = 0; o < VT && i < d_; ++o)
          for (int64_t k = 0; k + 1 < V_.tmeta_w && i < d_; k += 2) vsc[i++] = meta_at(tb + o * s2_ + k, 0);
        for (int64_t c = 0; c < d_; ++c) vscp[vperm[c]] = vsc[c];
      };
      // +rmean: the codes hold K' − c'_t; q'·c'_t = Σ_i ab_i · [cos tθ | sin tθ]_i
      auto add_rmean = [&](int64_t t, int64_t j) {
        const float* tr = rtp + t * d_;
        for (int64_t g = 0; g < G_; ++g) {
          const float* ag = abp + (r * Hq + h * G_ + g) * d_;
          float b_ = 0.f;
#pragma omp simd reduction(+ : b_)
          for (int64_t i = 0; i < d_; ++i) b_ += ag[i] * tr[i];
          s[g * PAGED_CHUNK + j] += b_;
        }
      };
      // 1. scores, block by block (one division per block, not per token)
      for (int64_t t = a; t < b;) {
        const int64_t bi = t / bs_, stop = std::min(b, (bi + 1) * bs_), blk = row[bi];
        const uint8_t* base = cp + blk * s0_ + h * s1_ + (t - bi * bs_) * s2_;
        for (; t < stop; ++t, base += s2_) {
          const int64_t j = t - a;
          if (krun != nullptr && src[j] < 0) {  // a run of cells read from their codes (within one tile), queries in registers
            if (KT && (t >= tile_hi || t < tile_lo)) load_tile(t, blk);
            const int64_t lim = KT ? std::min(stop, tile_hi) : stop;
            int64_t e = t + 1;
            while (e < lim && src[e - a] < 0) ++e;
            krun(base, s2_, e - t, K_, knb_, KT ? qkt.data() : qk.data(), KD_, KT ? qzt.data() : qsum.data(), s.data() + j,
                 PAGED_CHUNK);
            if (abp != nullptr)
              for (int64_t u = t; u < e; ++u) add_rmean(u, u - a);
            base += (e - t - 1) * s2_;
            t = e - 1;
            continue;
          }
#ifdef WUSHKV_ROWS
          if (src[j] >= 0 && fp_rows) {  // a run of copies in consecutive pool slots, ps1 apart, several at a time
            int64_t e = t + 1;
            while (e < stop && src[e - a] == src[e - 1 - a] + ps1_) ++e;
            const scalar_t* kr = pp + src[j] + h * ps2_;
            for (int64_t g = 0; g < G_; g += 4)
              fp_rows_for<scalar_t, true>(std::min<int64_t>(4, G_ - g))(kr, ps1_, e - t, d_, qz.data() + g * d_, d_,
                                                                       s.data() + g * PAGED_CHUNK + j, PAGED_CHUNK);
            base += (e - t - 1) * s2_;
            t = e - 1;
            continue;
          }
#endif
          if (src[j] >= 0) {
            const scalar_t* kr = pp + src[j] + h * ps2_;
            for (int64_t i = 0; i < d_; ++i) kf[i] = static_cast<float>(kr[i]);
            for (int64_t g = 0; g < G_; ++g) {
              const float* qg = qz.data() + g * d_;
              float acc_s = 0.f;
#pragma omp simd reduction(+ : acc_s)
              for (int64_t i = 0; i < d_; ++i) acc_s += kf[i] * qg[i];
              s[g * PAGED_CHUNK + j] = acc_s;
            }
          } else if (KT) {  // q·k = s_tok·(Σ_i (q_i·scale_i)·code_i + q·zero), the tile's terms computed once
            if (t >= tile_hi || t < tile_lo) load_tile(t, blk);  // a compare per token, not a 64-bit division
            dot_codes(base + K_.codes, knb_, K_.bits, qkt.data(), KD_, G_, dots.data());
            const float st = s_tok_at(base, K_.scale);
            for (int64_t g = 0; g < G_; ++g) s[g * PAGED_CHUNK + j] = st * (dots[g] + qzt[g]);
          } else {
            dot_codes(base + K_.codes, knb_, K_.bits, qk.data(), KD_, G_, dots.data());
            const float sc = meta_at(base + K_.scale, K_.meta);
            const float of = K_.offset >= 0 ? meta_at(base + K_.offset, K_.meta) : sc * K_.half;
            for (int64_t g = 0; g < G_; ++g) s[g * PAGED_CHUNK + j] = sc * dots[g] + of * qsum[g];
          }
          if (abp != nullptr && src[j] < 0) add_rmean(t, j);
        }
      }
      // 2. this split's softmax: max, weights, sum
      float* P = part.data() + it * W;
      for (int64_t g = 0; g < G_; ++g) {
        float* sg = s.data() + g * PAGED_CHUNK;
        float m = -INFINITY;
        if (softcap > 0.f) {
          for (int64_t j = 0; j < len; ++j) {
            const float x = softcap * std::tanh(sg[j] * scale / softcap);
            sg[j] = x;
            m = std::max(m, x);
          }
        } else {  // no call in the loop: it vectorizes
          for (int64_t j = 0; j < len; ++j) sg[j] *= scale;
          m = max_of(sg, len, m);
        }
        P[g] = m;
        P[G_ + g] = exp_shifted_sum(sg, len, m);
      }
      // 3. values, weighted
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(accf.begin(), accf.end(), 0.f);
      std::fill(osum.begin(), osum.end(), 0.f);
      for (int64_t t = a; t < b;) {
        const int64_t bi = t / bs_, stop = std::min(b, (bi + 1) * bs_), blk = row[bi];
        const uint8_t* base = cp + blk * s0_ + h * s1_ + (t - bi * bs_) * s2_;
        for (; t < stop; ++t, base += s2_) {
          const int64_t j = t - a;
          if (VT && src[j] < 0) {  // a run of one value tile's cells, summed per token, then times its channel scales
            if (t >= vtile_hi || t < vtile_lo) load_vtile(t, blk);
            const int64_t lim = std::min(stop, vtile_hi);
            int64_t e = t + 1;
            while (e < lim && src[e - a] < 0) ++e;
            std::fill(acct.begin(), acct.end(), 0.f);
            std::fill(osumt.begin(), osumt.end(), 0.f);
            if (vrun != nullptr) {
              vrun(base, s2_, e - t, V_, vnb_, s.data() + j, PAGED_CHUNK, acct.data(), VD_, osumt.data());
            } else {
              const uint8_t* cell = base;
              for (int64_t u = j; u < e - a; ++u, cell += s2_) {
                const float sc = meta_at(cell + V_.scale, 0), zr = meta_at(cell + V_.offset, 0);
                for (int64_t g = 0; g < G_; ++g) {
                  const float p = s[g * PAGED_CHUNK + u];
                  dots[g] = p * sc;
                  osumt[g] += p * zr;
                }
                axpy_codes(cell + V_.codes, vnb_, V_.bits, dots.data(), G_, acct.data(), VD_);
              }
            }
            for (int64_t g = 0; g < G_; ++g) {
              float* ag = acc.data() + g * VD_;
              const float* tg = acct.data() + g * VD_;
              for (int64_t k = 0; k < VD_; ++k) ag[k] += vscp[k] * tg[k];
              float* fg = accf.data() + g * d_;
              for (int64_t i = 0; i < d_; ++i) fg[i] += vsc[i] * osumt[g];
            }
            base += (e - t - 1) * s2_;
            t = e - 1;
            continue;
          }
          if (vrun != nullptr && src[j] < 0) {  // a run of cells read from their codes, accumulated in registers
            int64_t e = t + 1;
            while (e < stop && src[e - a] < 0) ++e;
            vrun(base, s2_, e - t, V_, vnb_, s.data() + j, PAGED_CHUNK, acc.data(), VD_, osum.data());
            base += (e - t - 1) * s2_;
            t = e - 1;
            continue;
          }
#ifdef WUSHKV_ROWS
          if (src[j] >= 0 && fp_rows) {
            int64_t e = t + 1;
            while (e < stop && src[e - a] == src[e - 1 - a] + ps1_) ++e;
            const scalar_t* vr = pp + src[j] + h * ps2_ + d_;
            for (int64_t g = 0; g < G_; g += 4)
              fp_rows_for<scalar_t, false>(std::min<int64_t>(4, G_ - g))(vr, ps1_, e - t, d_,
                                                                        s.data() + g * PAGED_CHUNK + j, PAGED_CHUNK,
                                                                        accf.data() + g * d_, d_);
            base += (e - t - 1) * s2_;
            t = e - 1;
            continue;
          }
#endif
          if (src[j] >= 0) {
            const scalar_t* vr = pp + src[j] + h * ps2_ + d_;
            for (int64_t i = 0; i < d_; ++i) kf[i] = static_cast<float>(vr[i]);
            for (int64_t g = 0; g < G_; ++g) {
              const float w = s[g * PAGED_CHUNK + j];
              float* ag = accf.data() + g * d_;
#pragma omp simd
              for (int64_t i = 0; i < d_; ++i) ag[i] += w * kf[i];
            }
          } else {
            const float sc = meta_at(base + V_.scale, V_.meta);
            const float of = V_.offset >= 0 ? meta_at(base + V_.offset, V_.meta) : sc * V_.half;
            for (int64_t g = 0; g < G_; ++g) {
              const float p = s[g * PAGED_CHUNK + j];
              dots[g] = p * sc;
              osum[g] += p * of;
            }
            axpy_codes(base + V_.codes, vnb_, V_.bits, dots.data(), G_, acc.data(), VD_);
          }
        }
      }
      for (int64_t g = 0; g < G_; ++g)
        for (int64_t i = 0; i < d_; ++i)
          P[2 * G_ + g * d_ + i] = acc[g * VD_ + vperm[i]] + accf[g * d_ + i] + osum[g];
    }
  });

  // merge the splits of each (request, KV head)
  float* op = out.data_ptr<float>();
  // serial: a few hundred (request, KV head) rows of d floats, less than waking the pool costs
  for (int64_t rh = 0; rh < R * H; ++rh) {
    const int64_t r = rh / H, h = rh % H;
    for (int64_t g = 0; g < G; ++g) {
      float m = -INFINITY;
      for (int64_t it = first[rh]; it < first[rh + 1]; ++it) m = std::max(m, part[it * W + g]);
      float l = 0.f;
      float* o = op + (r * Hq + h * G + g) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t it = first[rh]; it < first[rh + 1]; ++it) {
        const float c = std::exp(part[it * W + g] - m);
        l += c * part[it * W + G + g];
        const float* pa = part.data() + it * W + 2 * G + g * d;
        for (int64_t i = 0; i < d; ++i) o[i] += c * pa[i];
      }
      for (int64_t i = 0; i < d; ++i) o[i] /= l;
    }
  }
}

torch::Tensor paged_decode(torch::Tensor cache, torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor q,
                           torch::Tensor pool, torch::Tensor written, torch::Tensor page_index,
                           std::vector<int64_t> key_side, std::vector<int64_t> value_side, double key_half,
                           double value_half, int64_t sink, int64_t recent, int64_t flush, int64_t window, double scale,
                           double softcap, torch::Tensor rmean_ab, torch::Tensor rope_table) {
  TORCH_CHECK(cache.scalar_type() == torch::kUInt8 && cache.dim() == 4 && cache.stride(3) == 1,
              "cache: uint8 (num_blocks, H, block_size, C), dense last dim");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2, "block_table: int32 (R, max_blocks)");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.dim() == 1, "seq_lens: int64 (R,)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 3, "q: float32 (R, Hq, d)");
  TORCH_CHECK(pool.dim() == 5 && pool.size(3) == 2 && written.scalar_type() == torch::kBool && written.dim() == 2,
              "pool: (P, U, H, 2, d), written: bool (P, U)");
  TORCH_CHECK(page_index.scalar_type() == torch::kInt32 && page_index.dim() == 1, "page_index: int32 (pages,)");
  TORCH_CHECK(flush >= 1 && sink >= 0 && recent >= 0, "windows: sink, recent >= 0, flush >= 1");
  const int64_t H = cache.size(1), bs = cache.size(2), R = q.size(0), Hq = q.size(1), d = q.size(2);
  TORCH_CHECK(Hq % H == 0 && block_table.size(0) == R && seq_lens.size(0) == R, "shapes of q, cache, tables do not match");
  TORCH_CHECK(pool.size(2) == H && pool.size(4) == d && bs % pool.size(1) == 0 && written.size(1) == pool.size(1),
              "the window pool does not match the cache");
  const CellSide K = cell_side(key_side, key_half), V = cell_side(value_side, value_half);
  TORCH_CHECK(V.tile == 0 || V.tile == K.tile, "value tiles lie in the key tiles' grid (KVarN's +tiles)");
  const bool rm = rmean_ab.defined() && rmean_ab.numel() > 0;
  torch::Tensor abc, rtc;
  if (rm) {
    TORCH_CHECK(rmean_ab.scalar_type() == torch::kFloat && rmean_ab.dim() == 3 && rmean_ab.size(0) == R &&
                rmean_ab.size(1) == Hq && rmean_ab.size(2) == d, "rmean_ab: float32 (R, Hq, d)");
    TORCH_CHECK(rope_table.scalar_type() == torch::kFloat && rope_table.dim() == 2 && rope_table.size(1) == d &&
                rope_table.size(0) >= seq_lens.max().item<int64_t>(), "rope_table: float32 (>= max seq_len, d)");
    abc = rmean_ab.contiguous();
    rtc = rope_table.contiguous();
  }
  auto out = torch::empty({R, Hq, d}, q.options());
  if (R == 0) return out;
  auto tables = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  auto qc = q.contiguous();
  // read through its strides (either layout); only K and V rows must be dense and adjacent
  auto pc = pool.stride(4) == 1 && pool.stride(3) == d ? pool : pool.contiguous();
  auto wc = written.contiguous();
  auto ic = page_index.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pc.scalar_type(), "paged_decode", [&] {
    paged_decode_impl<scalar_t>(cache, tables, lens, qc, pc, wc, ic, K, V, sink, recent, flush, window, float(scale),
                                float(softcap), rm ? abc.data_ptr<float>() : nullptr, rm ? rtc.data_ptr<float>() : nullptr,
                                out);
  });
  return out;
}

// ---- decode over a layer's parts (the transformers cache) ----------------------------------------------------------
// One decode query per row over [sink, middle, recent] of wushkv.layer.WushKVLayer in one call, as the Triton decode
// reads them on a GPU: scores, softmax and the values' sum per work item (row, KV head, part, ≤ CHUNK tokens) with an
// online-softmax merge, the middle straight from its codes. The calls the PyTorch path makes instead (a product per
// part, a cat, a mask, a softmax, the codes' kernels, the metadata's conversions: about a hundred small operations)
// cost more than the arithmetic up to several thousand tokens (0.6 ms a layer at 512 tokens, SmolLM2's shape).

// per-token or per-tile metadata of the middle (f16, bf16, f32 or E5M3 bytes: meta_at's kinds), read in place
struct Meta {
  const uint8_t* p = nullptr;
  int64_t sb = 0, sh = 0, sn = 0, sc = 0, kind = 2;
  inline float at(int64_t b, int64_t h, int64_t n, int64_t c = 0) const {
    return meta_at(p + b * sb + h * sh + n * sn + c * sc, kind);
  }
};

// out[j] = the metadata of tokens a + j, j < len, of row b and head h, group c (one switch on the dtype, then a
// plain loop)
static void gather_meta(const Meta& m, int64_t b, int64_t h, int64_t a, int64_t len, float* out, int64_t c = 0) {
  const uint8_t* p = m.p + b * m.sb + h * m.sh + a * m.sn + c * m.sc;
  switch (m.kind) {
    case 0:
      for (int64_t j = 0; j < len; ++j, p += m.sn) out[j] = static_cast<float>(*reinterpret_cast<const c10::Half*>(p));
      break;
    case 1:
      for (int64_t j = 0; j < len; ++j, p += m.sn) out[j] = static_cast<float>(*reinterpret_cast<const c10::BFloat16*>(p));
      break;
    case 2:
      for (int64_t j = 0; j < len; ++j, p += m.sn) out[j] = *reinterpret_cast<const float*>(p);
      break;
    default:
      for (int64_t j = 0; j < len; ++j, p += m.sn) out[j] = meta_at(p, 3);
  }
}

static Meta meta_of(const torch::Tensor& t, const char* what) {
  Meta m;
  if (!t.defined() || t.numel() == 0) return m;
  const auto st = t.scalar_type();
  TORCH_CHECK(st == torch::kHalf || st == torch::kBFloat16 || st == torch::kFloat || st == torch::kByte, what,
              ": float16, bfloat16, float32 or E5M3 bytes (uint8), got ", st);
  TORCH_CHECK(t.dim() >= 3, what, ": (B, H, N, ...)");
  const int64_t es = t.element_size();
  m.p = static_cast<const uint8_t*>(t.data_ptr());
  m.sb = t.stride(0) * es, m.sh = t.stride(1) * es, m.sn = t.stride(2) * es;
  m.sc = t.dim() > 3 ? t.stride(3) * es : 0;
  m.kind = st == torch::kHalf ? 0 : (st == torch::kBFloat16 ? 1 : (st == torch::kFloat ? 2 : 3));
  return m;
}

// the packed middle of one side: codes (B, H, N, bytes) and per-token scale/offset (B, H, N, ng) (offset absent:
// scale·half, QuEST) for ng groups of d/ng channels a token, each group nbg whole units of the row (nb = ng·nbg units),
// or key tiles (tile > 0, one group; KVarN's, KIVI's with s_tok 1): k[t, i] = s_tok[t]·(tscale[t / tile, i]·code +
// tzero[t / tile, i]), or KVarN's value tiles (tile > 0, values; wushkv.quantizers.kvarn): v[t, i] =
// tscale[t / tile, i]·(scale[t]·code + offset[t]), a per-token affine row times its tile's channel scales
struct MidSide {
  const uint8_t* codes = nullptr;
  int64_t cb = 0, ch = 0, cn = 0, nb = 0, bits = 0, tile = 0, ng = 1, nbg = 0, ub = 1;
  float half = 0.f;
  Meta scale, offset, tscale, tzero;
};

static MidSide mid_side(const std::vector<torch::Tensor>& t, int64_t bits, int64_t tile, double half, int64_t B,
                        int64_t H, int64_t n, int64_t d, bool value) {
  const char* side = value ? "value" : "key";
  MidSide m;
  if (t.empty()) return m;  // a full-precision middle
  TORCH_CHECK(t.size() == (tile ? 4u : 3u), side, " middle: [codes, scale, offset]",
              value ? " or, tiles, [codes, scale, zero, channel scale]" : " or, tiles, [codes, s_tok, tile scale, tile zero]");
  const auto& c = t[0];
  check(c, bits);
  TORCH_CHECK(c.size(0) == B && c.size(1) == H && c.size(2) >= n && c.size(3) * 8 >= d * bits, side,
              " codes: (B, H, >= n, nb) uint8 with nb·8/bits >= head_dim");
  m.codes = c.data_ptr<uint8_t>();
  m.cb = c.stride(0), m.ch = c.stride(1), m.cn = c.stride(2), m.nb = c.size(3) / unit_bytes(bits), m.bits = bits;
  m.tile = tile, m.ub = unit_bytes(bits);
  m.half = float(half);
  m.scale = meta_of(t[1], "scale");
  TORCH_CHECK(m.scale.p != nullptr && t[1].size(0) == B && t[1].size(1) == H && t[1].size(2) >= n, side,
              " scale: (B, H, >= n[, groups])");
  m.ng = tile || t[1].dim() < 4 ? 1 : t[1].size(3);
  // groups within a token: each a whole number of units, so that a group's codes are a run of the row's units
  TORCH_CHECK(m.ng >= 1 && d % m.ng == 0 && ((d / m.ng) * bits) % (8 * m.ub) == 0 && m.nb * 8 * m.ub >= d * bits, side,
              ": ", m.ng, " groups of head_dim ", d, " at ", bits, " bits are not whole ", 8 * m.ub, "-bit units each");
  m.nbg = m.ng == 1 ? m.nb : (d / m.ng) * bits / (8 * m.ub);
  if (tile && value) {  // KVarN's value tiles: each token's scale and zero, each tile's channel scales
    m.offset = meta_of(t[2], "zero");
    m.tscale = meta_of(t[3], "channel scale");
    TORCH_CHECK(t[2].dim() == 3 && t[1].dim() == 3 && t[2].size(0) == B && t[2].size(1) == H && t[2].size(2) >= n &&
                m.offset.kind != 3, side, " tiles' scale and zero: (B, H, >= n) each, float16, bfloat16 or float32");
    TORCH_CHECK(t[3].dim() == 4 && t[3].size(0) == B && t[3].size(1) == H && t[3].size(2) * tile >= n &&
                t[3].size(3) == d, side, " tiles' channel scales: (B, H, tiles, head_dim)");
  } else if (tile) {
    m.tscale = meta_of(t[2], "tile scale");
    m.tzero = meta_of(t[3], "tile zero");
    for (int k = 2; k < 4; ++k)
      TORCH_CHECK(t[k].dim() == 4 && t[k].size(0) == B && t[k].size(1) == H && t[k].size(2) * tile >= n &&
                  t[k].size(3) == d, side, " tiles' scale and zero: (B, H, tiles, head_dim)");
  } else {
    m.offset = meta_of(t[2], "offset");
    TORCH_CHECK(m.offset.p == nullptr || (t[2].size(0) == B && t[2].size(1) == H && t[2].size(2) >= n &&
                                          (t[2].dim() < 4 ? 1 : t[2].size(3)) == m.ng),
                side, " offset: (B, H, >= n[, groups]) as the scale, or empty (symmetric)");
    TORCH_CHECK(m.offset.p == nullptr || m.offset.kind != 3, "E5M3 holds steps, not offsets");
  }
  return m;
}


template <typename T>
struct FpPart {
  const T* p = nullptr;
  int64_t sb = 0, sh = 0, st = 0;
};

static constexpr int64_t PARTS_SERIAL = 2048;

template <typename T>
static void parts_decode_impl(const float* qp, int64_t B, int64_t Hq, int64_t H, int64_t d, const int64_t* sp,
                              const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                              const MidSide& K, const MidSide& V, const int64_t* widths, const bool* vis, int64_t vis_sb,
                              int64_t S, float scaling, float softcap, const float* sinks, const float* terms,
                              const float* table, int64_t P, const int64_t* first, float* op) {
  const int64_t G = Hq / H, n_all = widths[0] + widths[1] + widths[2], lo = n_all - S;
  auto fp_part = [](const torch::Tensor& t) {
    FpPart<T> f;
    if (t.defined() && t.numel() > 0) f = {t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2)};
    return f;
  };
  const FpPart<T> kp[3] = {fp_part(keys[0]), fp_part(keys[1]), fp_part(keys[2])};
  const FpPart<T> vp[3] = {fp_part(values[0]), fp_part(values[1]), fp_part(values[2])};
  const int64_t off[3] = {0, widths[0], widths[0] + widths[1]};
  // work items: (row, KV head, part, tokens [a, b) of the part); a (row, head)'s items are consecutive
  std::vector<int64_t> item_rh, item_p, item_a, item_b, firsts(B * H + 1, 0);
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      firsts[b * H + h] = item_rh.size();
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t a = sp[(b * 3 + i) * 2]; a < sp[(b * 3 + i) * 2 + 1]; a += CHUNK) {
          item_rh.push_back(b * H + h), item_p.push_back(i), item_a.push_back(a);
          item_b.push_back(std::min(sp[(b * 3 + i) * 2 + 1], a + CHUNK));
          tokens += item_b.back() - a;
        }
    }
  firsts[B * H] = item_rh.size();
  const int64_t items = item_rh.size(), W = 2 * G + G * d;  // per item and query: max, sum, unnormalized output
  std::vector<float> part(items * W);
  const int64_t kper = K.codes ? unit_per(K.bits) : 1, vper = V.codes ? unit_per(V.bits) : 1;
  const int64_t KD = K.nb * kper, VD = V.nb * vper;
  // a small layer on the calling thread, where waking the pool costs more than its work: below PARTS_SERIAL
  // token-heads (~50 µs of work; the paged decode's threshold too, since session 77)
  const int64_t grain = tokens < PARTS_SERIAL ? std::max<int64_t>(items, 1) : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qk(G * std::max<int64_t>(KD, 1), 0.f), qt(K.tile ? G * KD : 0, 0.f), qsum(G), z(G), dots(G), kf(d);
    std::vector<float> s(G * CHUNK), w(G * CHUNK), acc(G * std::max<int64_t>(VD, 1)), accf(G * d), osum(G), msc(CHUNK), mof(CHUNK);
    // channel i's place in the permuted order: group i / gs's run of KDg places, code t of unit m at t·nbg + m
    const int64_t kgs = d / K.ng, vgs = d / V.ng, KDg = K.nbg * kper, VDg = V.nbg * vper;
    std::vector<int64_t> kperm(d), vperm(d);
    for (int64_t i = 0; i < d; ++i) {
      kperm[i] = (i / kgs) * KDg + (i % kgs % kper) * K.nbg + i % kgs / kper;
      vperm[i] = (i / vgs) * VDg + (i % vgs % vper) * V.nbg + i % vgs / vper;
    }
    std::vector<float> tmp(K.ng > 1 ? G * CHUNK : 0), gsum(V.ng > 1 ? G * V.ng : 0), tsum(V.tile ? G : 0);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t rh = item_rh[it], b = rh / H, h = rh % H, pi = item_p[it], a = item_a[it], len = item_b[it] - a;
      const float* qz = qp + (b * Hq + h * G) * d;  // the G queries of this KV head, (G, d)
      const bool coded_k = pi == 1 && K.codes != nullptr, coded_v = pi == 1 && V.codes != nullptr;
      // 1. scores s[g·CHUNK + j] of tokens a + j
      if (!coded_k) {
        const FpPart<T>& f = kp[pi];
#ifdef WUSHKV_ROWS
        if (d % 8 == 0 && fp_rows_for<T, true>(1) != nullptr) {
          for (int64_t g = 0; g < G; g += 4)
            fp_rows_for<T, true>(std::min<int64_t>(4, G - g))(f.p + b * f.sb + h * f.sh + a * f.st, f.st, len, d, qz + g * d,
                                                             d, s.data() + g * CHUNK, CHUNK);
        } else
#endif
        for (int64_t j = 0; j < len; ++j) {
          const T* kr = f.p + b * f.sb + h * f.sh + (a + j) * f.st;
          for (int64_t i = 0; i < d; ++i) kf[i] = static_cast<float>(kr[i]);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qz + g * d;
            float x = 0.f;
#pragma omp simd reduction(+ : x)
            for (int64_t i = 0; i < d; ++i) x += kf[i] * qg[i];
            s[g * CHUNK + j] = x;
          }
        }
      } else if (!K.tile) {  // per-token codes, group by group (one group: the whole row)
        const uint8_t* base = K.codes + b * K.cb + h * K.ch + a * K.cn;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < d; ++i) qk[g * KD + kperm[i]] = qz[g * d + i];
        for (int64_t j = 0; j < K.ng; ++j) {
          gather_meta(K.scale, b, h, a, len, msc.data(), j);  // the tokens' scales and offsets in group j
          if (K.offset.p)
            gather_meta(K.offset, b, h, a, len, mof.data(), j);
          else
            for (int64_t u = 0; u < len; ++u) mof[u] = msc[u] * K.half;
          for (int64_t g = 0; g < G; ++g) {
            float sum = 0.f;
            for (int64_t i = j * kgs; i < (j + 1) * kgs; ++i) sum += qz[g * d + i];
            qsum[g] = sum;
          }
          float* dot = K.ng == 1 ? s.data() : tmp.data();  // q·code of the group, (G, CHUNK)
          const uint8_t* gbase = base + j * K.nbg * K.ub;
#ifdef WUSHKV_ROWS
          for (int64_t g = 0; g < G; g += 4)
            rows_for<DotRows>(K.bits, std::min<int64_t>(4, G - g))(gbase, K.cn, len, K.nbg, qk.data() + g * KD + j * KDg, KD,
                                                                   dot + g * CHUNK, CHUNK);
#else
          for (int64_t u = 0; u < len; ++u) {
            dot_codes(gbase + u * K.cn, K.nbg, K.bits, qk.data() + j * KDg, KD, G, dots.data());
            for (int64_t g = 0; g < G; ++g) dot[g * CHUNK + u] = dots[g];
          }
#endif
          for (int64_t g = 0; g < G; ++g) {  // x̂ = scale·code + offset: q·x̂ = scale·(q·code) + offset·Σq, per group
            float* sg = s.data() + g * CHUNK;
            const float* dg = dot + g * CHUNK;
            const float qs_ = qsum[g];
            if (j == 0)
              for (int64_t u = 0; u < len; ++u) sg[u] = msc[u] * dg[u] + mof[u] * qs_;
            else
              for (int64_t u = 0; u < len; ++u) sg[u] += msc[u] * dg[u] + mof[u] * qs_;
          }
        }
      } else {  // key tiles (KVarN's; KIVI's per-channel keys, s_tok 1): per tile, its channel-scaled queries
        const uint8_t* base = K.codes + b * K.cb + h * K.ch;
        gather_meta(K.scale, b, h, a, len, msc.data());  // the tokens' s_tok
        for (int64_t j = 0; j < len;) {
          // a run of the tile's tokens, read against its channel-scaled queries
          const int64_t t = a + j, e = std::min(len, (t / K.tile + 1) * K.tile - a), ti = t / K.tile;
          for (int64_t g = 0; g < G; ++g) {
            float zz = 0.f;
            for (int64_t i = 0; i < d; ++i) {
              const float x = qz[g * d + i];
              qt[g * KD + kperm[i]] = x * K.tscale.at(b, h, ti, i);
              zz += x * K.tzero.at(b, h, ti, i);
            }
            z[g] = zz;
          }
#ifdef WUSHKV_ROWS
          for (int64_t g = 0; g < G; g += 4)
            rows_for<DotRows>(K.bits, std::min<int64_t>(4, G - g))(base + t * K.cn, K.cn, e - j, K.nb, qt.data() + g * KD, KD,
                                                                   s.data() + g * CHUNK + j, CHUNK);
#else
          for (int64_t u = j; u < e; ++u) {
            dot_codes(base + (a + u) * K.cn, K.nb, K.bits, qt.data(), KD, G, dots.data());
            for (int64_t g = 0; g < G; ++g) s[g * CHUNK + u] = dots[g];
          }
#endif
          for (int64_t g = 0; g < G; ++g) {
            float* sg = s.data() + g * CHUNK;
            const float zg = z[g];
            for (int64_t u = j; u < e; ++u) sg[u] = msc[u] * (sg[u] + zg);
          }
          j = e;
        }
      }
      if (coded_k) {
        if (terms != nullptr) {  // +rmean: the centers' share q·T c_p = Σ_i [A | B]_i·[cos pθ | sin pθ]_i
          for (int64_t j = 0; j < len; ++j) {
            const int64_t pos = first[b] + a + j;
            if (pos < 0 || pos >= P) continue;  // a row's padding (masked): no center
            const float* tr = table + pos * d;
            for (int64_t g = 0; g < G; ++g) {
              const float* ab = terms + (b * Hq + h * G + g) * d;
              float x = 0.f;
#pragma omp simd reduction(+ : x)
              for (int64_t i = 0; i < d; ++i) x += ab[i] * tr[i];
              s[g * CHUNK + j] += x;
            }
          }
        }
      }
      // 2. this item's softmax: scaled, capped, masked; its max and sum
      float* Pi = part.data() + it * W;
      const int64_t col = off[pi] + a;  // the item's first column among all the parts'
      const bool* vrow = vis ? vis + b * vis_sb : nullptr;
      const bool item_masked = vrow != nullptr || col < lo;
      auto hidden = [&](int64_t j) { return col + j < lo || (vrow && !vrow[col + j - lo]); };
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * CHUNK;
        if (softcap > 0.f) {
          for (int64_t j = 0; j < len; ++j) sg[j] = softcap * std::tanh(sg[j] * scaling / softcap);
        } else {  // no call in the loop: it vectorizes
          for (int64_t j = 0; j < len; ++j) sg[j] *= scaling;
        }
        if (item_masked)
          for (int64_t j = 0; j < len; ++j)
            if (hidden(j)) sg[j] = -INFINITY;
        float m = -INFINITY;
        for (int64_t j = 0; j < len; ++j) m = std::max(m, sg[j]);
        Pi[g] = m;
        if (m == -INFINITY) {  // nothing visible here: no weight
          std::fill(sg, sg + len, 0.f);
          Pi[G + g] = 0.f;
          continue;
        }
        Pi[G + g] = exp_shifted_sum(sg, len, m);
        if (item_masked)  // hidden columns: exactly zero (the vector exp clamps at e^-87)
          for (int64_t j = 0; j < len; ++j)
            if (hidden(j)) sg[j] = 0.f;
      }
      // 3. the values, weighted
      std::fill(accf.begin(), accf.end(), 0.f);
      std::fill(osum.begin(), osum.end(), 0.f);
      if (!coded_v) {
        const FpPart<T>& f = vp[pi];
#ifdef WUSHKV_ROWS
        if (d % 8 == 0 && fp_rows_for<T, false>(1) != nullptr) {
          for (int64_t g = 0; g < G; g += 4)
            fp_rows_for<T, false>(std::min<int64_t>(4, G - g))(f.p + b * f.sb + h * f.sh + a * f.st, f.st, len, d,
                                                              s.data() + g * CHUNK, CHUNK, accf.data() + g * d, d);
        } else
#endif
        for (int64_t j = 0; j < len; ++j) {
          const T* vr = f.p + b * f.sb + h * f.sh + (a + j) * f.st;
          for (int64_t i = 0; i < d; ++i) kf[i] = static_cast<float>(vr[i]);
          for (int64_t g = 0; g < G; ++g) {
            const float wg = s[g * CHUNK + j];
            float* ag = accf.data() + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += wg * kf[i];
          }
        }
      } else if (V.tile) {  // KVarN's value tiles: per run of one tile's tokens, the per-token sum as below, then
        // times the tile's channel scales: Σ_t p_t v̂_t = s_chan ⊙ (Σ_t p_t·scale_t·code_t + Σ_t p_t·zero_t)
        const uint8_t* base = V.codes + b * V.cb + h * V.ch;
        gather_meta(V.scale, b, h, a, len, msc.data());
        gather_meta(V.offset, b, h, a, len, mof.data());
        for (int64_t j = 0; j < len;) {
          const int64_t t = a + j, e = std::min(len, (t / V.tile + 1) * V.tile - a), ti = t / V.tile;
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t g = 0; g < G; ++g) {
            const float* sg = s.data() + g * CHUNK;
            float* wg = w.data() + g * CHUNK;
            float os = 0.f;
            for (int64_t u = j; u < e; ++u) {
              wg[u] = sg[u] * msc[u];
              os += sg[u] * mof[u];
            }
            tsum[g] = os;
          }
#ifdef WUSHKV_ROWS
          for (int64_t g = 0; g < G; g += 4)
            rows_for<AxpyRows>(V.bits, std::min<int64_t>(4, G - g))(base + t * V.cn, V.cn, e - j, V.nb, w.data() + g * CHUNK + j,
                                                                    CHUNK, acc.data() + g * VD, VD);
#else
          for (int64_t u = j; u < e; ++u) {
            for (int64_t g = 0; g < G; ++g) z[g] = w[g * CHUNK + u];
            axpy_codes(base + (a + u) * V.cn, V.nb, V.bits, z.data(), G, acc.data(), VD);
          }
#endif
          for (int64_t g = 0; g < G; ++g)
            for (int64_t i = 0; i < d; ++i)
              accf[g * d + i] += V.tscale.at(b, h, ti, i) * (acc[g * VD + vperm[i]] + tsum[g]);
          j = e;
        }
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        const uint8_t* base = V.codes + b * V.cb + h * V.ch + a * V.cn;
        for (int64_t k = 0; k < V.ng; ++k) {  // group by group (one group: the whole row)
          gather_meta(V.scale, b, h, a, len, msc.data(), k);
          if (V.offset.p)
            gather_meta(V.offset, b, h, a, len, mof.data(), k);
          else
            for (int64_t j = 0; j < len; ++j) mof[j] = msc[j] * V.half;
          for (int64_t g = 0; g < G; ++g) {  // each token's weights p·scale, and the offsets' share Σ p·offset
            const float* sg = s.data() + g * CHUNK;
            float* wg = w.data() + g * CHUNK;
            float os = 0.f;
#pragma omp simd reduction(+ : os)
            for (int64_t j = 0; j < len; ++j) {
              wg[j] = sg[j] * msc[j];
              os += sg[j] * mof[j];
            }
            if (V.ng == 1)
              osum[g] = os;
            else  // the group's channels only
              gsum[g * V.ng + k] = os;
          }
          const uint8_t* gbase = base + k * V.nbg * V.ub;
#ifdef WUSHKV_ROWS
          for (int64_t g = 0; g < G; g += 4)
            rows_for<AxpyRows>(V.bits, std::min<int64_t>(4, G - g))(gbase, V.cn, len, V.nbg, w.data() + g * CHUNK, CHUNK,
                                                                    acc.data() + g * VD + k * VDg, VD);
#else
          for (int64_t j = 0; j < len; ++j) {
            for (int64_t g = 0; g < G; ++g) z[g] = w[g * CHUNK + j];
            axpy_codes(gbase + j * V.cn, V.nbg, V.bits, z.data(), G, acc.data() + k * VDg, VD);
          }
#endif
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < d; ++i)
            accf[g * d + i] += acc[g * VD + vperm[i]] + (V.ng == 1 ? 0.f : gsum[g * V.ng + i / vgs]);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < d; ++i) Pi[2 * G + g * d + i] = accf[g * d + i] + osum[g];
    }
  });
  // merge each (row, KV head)'s items, and the learned sink logit (one more column, zero value)
  for (int64_t rh = 0; rh < B * H; ++rh) {
    const int64_t b = rh / H, h = rh % H;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t hq = h * G + g;
      float m = sinks ? sinks[hq] : -INFINITY;
      for (int64_t it = firsts[rh]; it < firsts[rh + 1]; ++it) m = std::max(m, part[it * W + g]);
      float* o = op + (b * Hq + hq) * d;
      std::fill(o, o + d, 0.f);
      if (m == -INFINITY) continue;  // nothing visible (a row of padding, never read): zeros, no NaN
      float l = sinks ? std::exp(sinks[hq] - m) : 0.f;
      for (int64_t it = firsts[rh]; it < firsts[rh + 1]; ++it) {
        if (part[it * W + G + g] == 0.f) continue;
        const float c = std::exp(part[it * W + g] - m);
        l += c * part[it * W + G + g];
        const float* pa = part.data() + it * W + 2 * G + g * d;
        for (int64_t i = 0; i < d; ++i) o[i] += c * pa[i];
      }
      for (int64_t i = 0; i < d; ++i) o[i] /= l;
    }
  }
}

torch::Tensor parts_decode(torch::Tensor q, torch::Tensor spans, std::vector<int64_t> widths, std::vector<torch::Tensor> keys,
                           std::vector<torch::Tensor> values, std::vector<torch::Tensor> kmid, int64_t kbits, int64_t tile,
                           double khalf, std::vector<torch::Tensor> vmid, int64_t vbits, int64_t vtile, double vhalf,
                           torch::Tensor visible,
                           double scaling, double softcap, torch::Tensor sinks, torch::Tensor terms, torch::Tensor table,
                           torch::Tensor first) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 3, "q: float32 (B, Hq, d)");
  TORCH_CHECK(keys.size() == 3 && values.size() == 3 && widths.size() == 3, "parts: [sink, middle, recent] of keys and values");
  q = q.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), H = keys[0].size(1);
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads (", Hq, ") must be a multiple of the KV heads (", H, ")");
  const auto dtype = keys[0].scalar_type();
  for (auto* side : {&keys, &values})
    for (int i = 0; i < 3; ++i) {
      auto& t = (*side)[i];
      const bool coded = i == 1 && !(side == &keys ? kmid : vmid).empty();
      if (coded) continue;
      TORCH_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(2) == widths[i] && t.size(3) == d &&
                  t.scalar_type() == dtype, "full-precision part ", i, ": (B, H, width, head_dim), one dtype");
      if (t.stride(3) != 1) t = t.contiguous();
    }
  const MidSide K = mid_side(kmid, kbits, tile, khalf, B, H, widths[1], d, false);
  const MidSide V = mid_side(vmid, vbits, vtile, vhalf, B, H, widths[1], d, true);
  if (spans.numel() == 0)  // every row reads all of each part
    spans = torch::tensor({int64_t(0), widths[0], int64_t(0), widths[1], int64_t(0), widths[2]}).view({1, 3, 2}).expand({B, 3, 2});
  spans = spans.contiguous();
  TORCH_CHECK(spans.scalar_type() == torch::kLong && spans.dim() == 3 && spans.size(0) == B && spans.size(1) == 3 &&
              spans.size(2) == 2, "spans: int64 (B, 3, 2), or empty (every row reads all of each part)");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t k = 0; k < B * 3; ++k)
    TORCH_CHECK(0 <= sp[2 * k] && sp[2 * k] <= sp[2 * k + 1] && sp[2 * k + 1] <= widths[k % 3], "spans[", k / 3, ", ",
                k % 3, "] = [", sp[2 * k], ", ", sp[2 * k + 1], ") is not within the part's ", widths[k % 3], " columns");
  const int64_t n_all = widths[0] + widths[1] + widths[2];
  const bool masked = visible.defined() && visible.numel() > 0;
  int64_t S = n_all, vis_sb = 0;
  if (masked) {
    visible = visible.contiguous();
    TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.dim() == 2 && (visible.size(0) == B || visible.size(0) == 1)
                && visible.size(1) <= n_all, "visible: bool (B or 1, S <= ", n_all, " columns)");
    S = visible.size(1);
    vis_sb = visible.size(0) == 1 ? 0 : S;
  }
  const bool has_sinks = sinks.defined() && sinks.numel() > 0;
  if (has_sinks) {
    sinks = sinks.contiguous();
    TORCH_CHECK(sinks.scalar_type() == torch::kFloat && sinks.numel() == Hq, "sinks: float32 (Hq,)");
  }
  const bool rm = terms.defined() && terms.numel() > 0;
  if (rm) {
    TORCH_CHECK(K.codes != nullptr, "centers (+rmean) are the coded keys'");
    terms = terms.contiguous(), table = table.contiguous(), first = first.contiguous();
    TORCH_CHECK(terms.scalar_type() == torch::kFloat && terms.dim() == 3 && terms.size(0) == B && terms.size(1) == Hq &&
                terms.size(2) == d, "terms: float32 (B, Hq, head_dim)");
    TORCH_CHECK(table.scalar_type() == torch::kFloat && table.dim() == 2 && table.size(1) == d, "table: float32 (P, head_dim)");
    TORCH_CHECK(first.scalar_type() == torch::kLong && first.numel() == B, "first: int64 (B,)");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(first.data_ptr<int64_t>()[b] + widths[1] <= table.size(0), "the RoPE table holds ", table.size(0),
                  " positions; row ", b, " reaches ", first.data_ptr<int64_t>()[b] + widths[1]);
  }
  auto out = torch::empty({B, Hq, d}, q.options());
  if (B == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "parts_decode", [&] {
    parts_decode_impl<scalar_t>(q.data_ptr<float>(), B, Hq, H, d, sp, keys, values, K, V, widths.data(),
                                masked ? visible.data_ptr<bool>() : nullptr, vis_sb, S, float(scaling), float(softcap),
                                has_sinks ? sinks.data_ptr<float>() : nullptr, rm ? terms.data_ptr<float>() : nullptr,
                                rm ? table.data_ptr<float>() : nullptr, rm ? table.size(0) : 0,
                                rm ? first.data_ptr<int64_t>() : nullptr, out.data_ptr<float>());
  });
  return out;
}

// keys and values (H, stop − start, d) float32 of positions start..stop−1 of one request, decoded from its cells
// through its block table row: x = scale·code + offset per token (the codecs' formula); the prefill path's input
std::vector<torch::Tensor> paged_dequantize(torch::Tensor cache, torch::Tensor block_ids, int64_t start, int64_t stop,
                                            std::vector<int64_t> key_side, std::vector<int64_t> value_side,
                                            double key_half, double value_half, int64_t d) {
  TORCH_CHECK(cache.scalar_type() == torch::kUInt8 && cache.dim() == 4 && cache.stride(3) == 1,
              "cache: uint8 (num_blocks, H, block_size, C), dense last dim");
  TORCH_CHECK(block_ids.scalar_type() == torch::kInt32 && block_ids.dim() == 1, "block_ids: int32 (blocks,)");
  const int64_t NB = cache.size(0), H = cache.size(1), bs = cache.size(2), m = stop - start;
  TORCH_CHECK(0 <= start && start <= stop && (stop + bs - 1) / bs <= block_ids.size(0), "positions ", start, "..", stop,
              " do not fit ", block_ids.size(0), " blocks");
  const CellSide sides[2] = {cell_side(key_side, key_half), cell_side(value_side, value_half)};
  TORCH_CHECK(sides[0].tile == 0 && sides[1].tile == 0, "paged_dequantize reads per-token sides (key tiles: in torch)");
  TORCH_CHECK((sides[0].bits != 3 && sides[1].bits != 3) || d % 8 == 0, "3-bit cells are read 8 codes (3 bytes) at a ",
              "time: head_dim ", d, " must be a multiple of 8");
  auto ids = block_ids.contiguous();
  const int32_t* ip = ids.data_ptr<int32_t>();
  for (int64_t i = start / bs; i < (stop + bs - 1) / bs; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < NB, "block id ", ip[i], " out of range");
  auto opts = torch::TensorOptions().dtype(torch::kFloat);
  std::vector<torch::Tensor> out = {torch::empty({H, m, d}, opts), torch::empty({H, m, d}, opts)};
  const uint8_t* cp = cache.data_ptr<uint8_t>();
  const int64_t s0 = cache.stride(0), s1 = cache.stride(1), s2 = cache.stride(2);
  const std::vector<float> tabs[2] = {byte_table(sides[0].bits), byte_table(sides[1].bits)};
  const int64_t nchunks = (m + CHUNK - 1) / CHUNK;
  at::parallel_for(0, 2 * H * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cf(8 * d + 8);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t side = it / (H * nchunks), h = (it / nchunks) % H, c = it % nchunks;
      const CellSide& S = sides[side];
      const int64_t per = unit_per(S.bits), nb = (d * S.bits + 7) / 8;
      float* o = out[side].data_ptr<float>() + h * m * d;
      for (int64_t t = start + c * CHUNK; t < std::min(stop, start + (c + 1) * CHUNK); ++t) {
        const uint8_t* cell = cp + ip[t / bs] * s0 + h * s1 + (t % bs) * s2;
        if (S.bits == 3)  // code i is code i % 8 of unit i / 8 (the units of a row past d: never read)
          for (int64_t i = 0; i < d; ++i) cf[i] = float(code_at(cell + S.codes, i / 8, i % 8, 3));
        else
          unpack_any(cell + S.codes, nb, per, tabs[side].data(), cf.data());
        const float sc = meta_at(cell + S.scale, S.meta);
        const float of = S.offset >= 0 ? meta_at(cell + S.offset, S.meta) : sc * S.half;
        float* row = o + (t - start) * d;
        for (int64_t i = 0; i < d; ++i) row[i] = sc * cf[i] + of;
      }
    }
  });
  return out;
}

// ---- paged store ------------------------------------------------------------------------------------------------
// Write the cells of T new tokens at vLLM's slots (slot < 0: padding, skipped): per side, the step (and offset) as the
// quantizer computed them (float32, (T,H)) are stored in the metadata dtype, the codes are rounded on that grid and
// packed (wushkv.quantizers.pack's layout). Codes: with error feedback F (H,d,d) on the grid as stored (the
// feedback_round loop above, wushkv.quantizers.feedback); without, QuEST's floor(x/Δ) + 2^(b-1) on the float32 step
// (wushkv.quantizers.quest), so the bytes are the ones wushkv_vllm.paged.SlotCodec.encode writes. A key-tile side
// (tile > 0) is skipped, its fields left as they are: they are written when the tile is complete (SlotCodec.store_tiles).
static inline void put_meta(uint8_t* p, int64_t kind, float v) {
  if (kind == 3) {  // E5M3: float16's bits rounded half up to their top 8 (sign dropped), as wushkv.codecs.e5m3_round
    const int32_t h = int32_t(int16_t(c10::Half(v).x));  // sign-extended, as view(torch.int16)
    p[0] = uint8_t(std::min<int32_t>(std::max<int32_t>((h + 64) >> 7, 0), 0xF7));
  } else if (kind == 0) { c10::Half h(v); std::memcpy(p, &h, 2); }
  else if (kind == 1) { c10::BFloat16 b(v); std::memcpy(p, &b, 2); }
  else std::memcpy(p, &v, 4);
}

static inline void pack_codes(const uint8_t* c, int64_t d, int64_t bits, uint8_t* out) {
  const int64_t nb = (d * bits + 7) / 8;
  if (bits == 3) {  // 8 codes a 24-bit word, its bytes low first (the row's last word: only its ⌈3d/8⌉ bytes)
    for (int64_t u = 0; u * 8 < d; ++u) {
      uint32_t word = 0;
      for (int64_t t = 0; t < 8 && u * 8 + t < d; ++t) word |= uint32_t(c[u * 8 + t]) << (3 * t);
      for (int64_t k = 0; k < 3 && 3 * u + k < nb; ++k) out[3 * u + k] = uint8_t(word >> (8 * k));
    }
    return;
  }
  const int64_t per = 8 / bits;
  for (int64_t m = 0; m < nb; ++m) {
    uint8_t byte = 0;
    for (int64_t t = 0; t < per && m * per + t < d; ++t) byte |= uint8_t(c[m * per + t] << (t * bits));
    out[m] = byte;
  }
}

// QuEST's step of one token's d values, the float32 operations of wushkv.quantizers.quest's _step in PyTorch's order
// (its vectorized norm over the last dim: `lanes` partial sums of x·x, each product rounded before its add, the partial
// sums added in lane order; sqrt; ÷ float(√d); × float(coef); at least float32's tiny), so the step and
// every code on it are PyTorch's bit for bit. mode 1: clipped, coef·RMS; mode 2: unclipped, coef·max|x|. PyTorch's
// order is checked, not assumed: wushkv_vllm.paged.kernel_grid_lanes compares this against torch on a probe at first
// use and keeps torch's grid where no `lanes` matches. Products and sums must not fuse into FMAs (-march=native lets
// the compiler contract them): the pragma and the attribute below forbid it for this function.
// Never inlined: the probe (quest_steps) and paged_store then run the same compiled function, whose no-contract
// option an inlining into another function might not keep.
#if defined(__clang__)
#define WUSHKV_NO_CONTRACT __attribute__((noinline))
#elif defined(__GNUC__)
#define WUSHKV_NO_CONTRACT __attribute__((noinline, optimize("fp-contract=off")))
#else
#define WUSHKV_NO_CONTRACT
#endif
WUSHKV_NO_CONTRACT static float quest_step(const float* x, int64_t d, int64_t mode, float coef, int64_t lanes) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  float v;
  if (mode == 2) {
    v = 0.f;
    for (int64_t j = 0; j < d; ++j) v = std::isnan(x[j]) || std::isnan(v) ? NAN : std::max(v, std::abs(x[j]));  // amax's NaN
  } else {
    float acc[64] = {0.f};  // d a multiple of lanes: PyTorch's scalar tail is left out (its order is its compiler's)
    for (int64_t j = 0; j < d; j += lanes)
      for (int64_t l = 0; l < lanes; ++l) {
        const float p = x[j + l] * x[j + l];
        acc[l] = acc[l] + p;
      }
    float sum = acc[0];
    for (int64_t l = 1; l < lanes; ++l) sum = sum + acc[l];
    v = std::sqrt(sum) / float(std::sqrt(double(d)));
  }
  return std::max(coef * v, std::numeric_limits<float>::min());
}

// E5M3's value of a step (wushkv.codecs.e5m3_round: float16's bits rounded half up, or up, to their top 8; as float32)
static inline float e5m3_value(float v, bool up) {
  const int32_t h = int32_t(int16_t(c10::Half(v).x));  // sign-extended, as view(torch.int16): a negative rounds to 0
  const int32_t b = std::min<int32_t>(std::max<int32_t>((h + (up ? 127 : 64)) >> 7, 0), 0xF7);
  return float(c10::Half(uint16_t(b << 7), c10::Half::from_bits()));
}

// QuEST's steps (N,) of tokens x (N, d) float32, as paged_store computes them where it is given no steps (quest_step)
torch::Tensor quest_steps(torch::Tensor x, int64_t mode, double coef, int64_t lanes) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x: float32 (N, d), got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK((mode == 1 || mode == 2) && 1 <= lanes && lanes <= 64, "mode 1 (RMS) or 2 (max |x|) and lanes 1..64, got mode ",
              mode, ", lanes ", lanes);
  auto xc = x.contiguous();
  const int64_t N = xc.size(0), d = xc.size(1);
  TORCH_CHECK(d % lanes == 0, "d ", d, " must be a multiple of lanes ", lanes);
  auto out = torch::empty({N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) op[n] = quest_step(xp + n * d, d, mode, float(coef), lanes);
  return out;
}

void paged_store(torch::Tensor cache, torch::Tensor slots, std::vector<torch::Tensor> x, std::vector<torch::Tensor> step,
                 std::vector<torch::Tensor> offset, std::vector<torch::Tensor> feedback,
                 std::vector<int64_t> key_side, std::vector<int64_t> value_side, double key_half, double value_half,
                 int64_t payload, int64_t slot_bytes, std::vector<int64_t> grid_mode, std::vector<double> grid_coef,
                 int64_t lanes) {
  TORCH_CHECK(cache.scalar_type() == torch::kUInt8 && cache.dim() == 4 && cache.stride(3) == 1,
              "cache: uint8 (num_blocks, H, block_size, C), dense last dim");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1, "slots: int64 (T,)");
  TORCH_CHECK(x.size() == 2 && step.size() == 2 && offset.size() == 2 && feedback.size() == 2, "two sides: keys, values");
  TORCH_CHECK(grid_mode.size() == 2 && grid_coef.size() == 2 && 1 <= lanes && lanes <= 64,
              "grid: a mode and a coefficient per side and lanes 1..64, got ", grid_mode.size(), " modes, ", grid_coef.size(),
              " coefficients, lanes ", lanes);
  for (int s = 0; s < 2; ++s)
    TORCH_CHECK(grid_mode[s] == 0 || grid_mode[s] == 1 || grid_mode[s] == 2 || grid_mode[s] == 5 || grid_mode[s] == 6,
                "grid mode of side ", s, ": 0 (steps given), 1 (QuEST's RMS), 2 (its max |x|), +4 with E5M3 steps rounded "
                "up; got ", grid_mode[s]);
  const int64_t NB = cache.size(0), H = cache.size(1), bs = cache.size(2), T = slots.size(0);
  const CellSide sides[2] = {cell_side(key_side, key_half), cell_side(value_side, value_half)};
  TORCH_CHECK(sides[1].tile == 0, "values are per token");
  int64_t d = 0;
  for (int s = 1; s >= 0; --s) {
    if (sides[s].tile) continue;
    TORCH_CHECK((x[s].scalar_type() == torch::kFloat || x[s].scalar_type() == torch::kHalf ||
                 x[s].scalar_type() == torch::kBFloat16) && x[s].dim() == 3 && x[s].size(0) == T && x[s].size(1) == H &&
                (x[s].size(2) == 0 || x[s].stride(2) == 1),
                "x: float32/16 (T, H, d) per side, dense rows; got ", x[s].scalar_type(), " ", x[s].sizes());
    d = x[s].size(2);
    TORCH_CHECK((grid_mode[s] & 3) ? sides[s].offset < 0 && !(step[s].defined() && step[s].numel())
                                   : step[s].scalar_type() == torch::kFloat && step[s].numel() == T * H,
                "step: float32 (T, H) per side, or none where the kernel computes QuEST's (grid mode 1 or 2)");
    TORCH_CHECK(!offset[s].defined() || offset[s].numel() == 0 || (sides[s].offset >= 0 && offset[s].numel() == T * H),
                "offset: float32 (T, H) for an asymmetric side, empty otherwise");
    TORCH_CHECK(!feedback[s].defined() || feedback[s].numel() == 0 ||
                (feedback[s].dim() == 3 && feedback[s].size(0) == H && feedback[s].size(1) == d), "feedback: (H, d, d)");
  }
  TORCH_CHECK(!((grid_mode[0] | grid_mode[1]) & 3) || d % lanes == 0, "QuEST's steps in the kernel: d ", d,
              " must be a multiple of lanes ", lanes);
  TORCH_CHECK((sides[0].tile || x[0].size(2) == d) &&
              (!feedback[0].defined() || feedback[0].numel() == 0 || feedback[0].size(2) == d) &&
              (!feedback[1].defined() || feedback[1].numel() == 0 || feedback[1].size(2) == d),
              "keys, values and feedback must share head_dim ", d);
  for (int s = 0; s < 2; ++s)
    TORCH_CHECK(sides[s].codes + (d * sides[s].bits + 7) / 8 <= payload && sides[s].scale + (sides[s].meta == 3 ? 1 : 2) <= payload,
                "the cell layout does not fit its payload of ", payload, " bytes");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < NB * bs, "slot ", sp[t], " out of range");
  torch::Tensor xs[2], st[2], of[2], fb[2];
  for (int s = 0; s < 2; ++s) {
    if (sides[s].tile) continue;
    xs[s] = x[s];  // in place: rows read through their strides, 16-bit ones widened (exactly) per row
    if (!(grid_mode[s] & 3)) st[s] = step[s].contiguous();
    of[s] = offset[s].defined() && offset[s].numel() ? offset[s].to(torch::kFloat).contiguous() : torch::Tensor();
    fb[s] = feedback[s].defined() && feedback[s].numel() ? feedback[s].to(torch::kFloat).contiguous() : torch::Tensor();
  }
  for (int s = 0; s < 2; ++s)
    TORCH_CHECK(sides[s].tile || fb[s].defined() || sides[s].offset < 0, "codes without feedback are written for QuEST sides only");
  TORCH_CHECK(0 <= payload && payload <= slot_bytes && slot_bytes <= cache.size(3), "cell of ", slot_bytes, " bytes");
  uint8_t* cp = cache.data_ptr<uint8_t>();
  const int64_t s0 = cache.stride(0), s1 = cache.stride(1), s2 = cache.stride(2);
  // a side's row (t, h) as float32: in place, or widened into buf (a bfloat16 or float16 value is exact in float32)
  auto row = [&](int s, int64_t t, int64_t h, float* buf) -> const float* {
    const torch::Tensor& X = xs[s];
    const int64_t off = t * X.stride(0) + h * X.stride(1);
    if (X.scalar_type() == torch::kFloat) return X.data_ptr<float>() + off;
    if (X.scalar_type() == torch::kHalf) {
      const c10::Half* p = X.data_ptr<c10::Half>() + off;
      for (int64_t j = 0; j < d; ++j) buf[j] = static_cast<float>(p[j]);
    } else {
      const c10::BFloat16* p = X.data_ptr<c10::BFloat16>() + off;
      for (int64_t j = 0; j < d; ++j) buf[j] = static_cast<float>(p[j]);
    }
    return buf;
  };
  at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> w(d), xb(d);
    std::vector<uint8_t> c(d);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t t = it / H, h = it % H;
      if (sp[t] < 0) continue;
      uint8_t* cell = cp + (sp[t] / bs) * s0 + h * s1 + (sp[t] % bs) * s2;
      std::memset(cell + payload, 0, slot_bytes - payload);  // the padding, as SlotCodec.encode leaves it
      for (int s = 0; s < 2; ++s) {
        const CellSide& S = sides[s];
        if (S.tile) continue;
        const float* xr = row(s, t, h, xb.data());
        float delta;
        if (grid_mode[s] & 3) {  // QuEST's step here, as SlotCodec.store's torch would give it (one-byte: rounded first)
          delta = quest_step(xr, d, grid_mode[s] & 3, float(grid_coef[s]), lanes);
          if (S.meta == 3) delta = std::max(e5m3_value(delta, grid_mode[s] & 4), std::numeric_limits<float>::min());
        } else {
          delta = st[s].data_ptr<float>()[it];
        }
        put_meta(cell + S.scale, S.meta, delta);
        const float qmax = float((1 << S.bits) - 1);
        if (fb[s].defined()) {  // the grid as stored, then feedback_round's loop
          const float sc = meta_at(cell + S.scale, S.meta);
          float o = sc * S.half;
          if (S.offset >= 0) {
            put_meta(cell + S.offset, S.meta, of[s].data_ptr<float>()[it]);
            o = meta_at(cell + S.offset, S.meta);
          }
          for (int64_t k = 0; k < d; ++k) w[k] = xr[k];
          feedback_row(w.data(), &sc, &o, d, fb[s].data_ptr<float>() + h * d * d, d, qmax, c.data());
        } else {  // QuEST: clamp(floor(x/Δ), -2^(b-1), 2^(b-1) - 1) + 2^(b-1) on the float32 step
          const float half = float(1 << (S.bits - 1));
          for (int64_t j = 0; j < d; ++j) {
            float q = std::floor(xr[j] / delta);
            q = q < -half ? -half : (q > half - 1.f ? half - 1.f : q);
            c[j] = static_cast<uint8_t>(q + half);
          }
        }
        pack_codes(c.data(), d, S.bits, cell + S.codes);
      }
    }
  });
}

// ---- the per-head transforms (wushkv_vllm.backend: K' = (K − key_mean)·key, Q' = Q·query) -----------------------
// y[t, j] = (x[t, j] − mean[j / G])·A[j / G] for the heads j of x (T, Hx, d), G = Hx / H heads per transform (a
// query group), float32. Each row on its own and in one order (A's rows added in turn, acc += x_i·A[i], vectorized
// over the output's channels), so a token's result does not depend on the tokens transformed with it. torch's bmm's
// does: its kernel changes with T, so a key transformed at a decode step and the same key in a recompute's prefill
// differed in last bits, and a code on a rounding boundary with them.
template <typename T>
static void head_transform_impl(const T* x, int64_t xs0, int64_t xs1, int64_t n, int64_t Hx, int64_t G, int64_t d,
                                const float* mean, const float* A, float* y) {
  // work items: up to RB rows (token, head of the group) of one transform, sharing its rows' loads; the output's
  // channels in blocks of CB held in registers across the sum over i. A row's sums are the same whatever rows share
  // its item: the path taken depends on d only.
  constexpr int64_t RB = 4, CB = 64;
  const int64_t H = Hx / G, rows = n * G, per = (rows + RB - 1) / RB;
  const int64_t grain = n * Hx * d * d < (int64_t(1) << 20) ? std::max<int64_t>(H * per, 1) : 1;  // a decode step: this thread
  at::parallel_for(0, H * per, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xr(RB * d);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / per, r0 = (it % per) * RB, nr = std::min(RB, rows - r0);
      std::fill(xr.begin(), xr.end(), 0.f);
      for (int64_t rr = 0; rr < nr; ++rr) {
        const int64_t r = r0 + rr, t = r / G, j = h * G + r % G;
        const T* xp = x + t * xs0 + j * xs1;
        for (int64_t i = 0; i < d; ++i)  // rounded, as torch's k.float() − key_mean
          xr[rr * d + i] = mean ? static_cast<float>(xp[i]) - mean[h * d + i] : static_cast<float>(xp[i]);
      }
      const float* a = A + h * d * d;
      for (int64_t c0 = 0; c0 < d; c0 += CB) {
        float acc[RB][CB] = {};
        if (d - c0 >= CB) {  // constant bounds: the accumulators stay in vector registers
          for (int64_t i = 0; i < d; ++i) {
            const float* __restrict ar = a + i * d + c0;
            for (int64_t rr = 0; rr < RB; ++rr) {
              const float xi = xr[rr * d + i];
              for (int64_t c = 0; c < CB; ++c) acc[rr][c] += xi * ar[c];
            }
          }
        } else {
          for (int64_t i = 0; i < d; ++i) {
            const float* __restrict ar = a + i * d + c0;
            for (int64_t rr = 0; rr < RB; ++rr) {
              const float xi = xr[rr * d + i];
              for (int64_t c = 0; c < d - c0; ++c) acc[rr][c] += xi * ar[c];
            }
          }
        }
        for (int64_t rr = 0; rr < nr; ++rr) {
          const int64_t r = r0 + rr, t = r / G, j = h * G + r % G;
          std::memcpy(y + (t * Hx + j) * d + c0, acc[rr], std::min(CB, d - c0) * sizeof(float));
        }
      }
    }
  });
}

torch::Tensor head_transform(torch::Tensor x, torch::Tensor mean, torch::Tensor A) {
  const bool centered = mean.defined() && mean.numel() > 0;
  TORCH_CHECK(x.is_cpu() && A.is_cpu() && (!centered || mean.is_cpu()), "head_transform: CPU tensors, got x on ",
              x.device(), ", A on ", A.device());
  TORCH_CHECK(x.dim() == 3 && (x.size(2) == 0 || x.stride(2) == 1) &&
              (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16),
              "x: float32/16 (T, Hx, d) with dense rows, got ", x.scalar_type(), " ", x.sizes());
  const int64_t n = x.size(0), Hx = x.size(1), d = x.size(2);
  TORCH_CHECK(A.dim() == 3 && A.size(0) >= 1 && Hx % A.size(0) == 0 && A.size(1) == d && A.size(2) == d,
              "A: (H, d, d) with H dividing x's ", Hx, " heads and d = ", d, ", got ", A.sizes());
  const int64_t H = A.size(0);
  TORCH_CHECK(!centered || (mean.dim() == 2 && mean.size(0) == H && mean.size(1) == d), "mean: (H, d) = (", H, ", ", d,
              ") or empty, got ", mean.sizes());
  auto Ac = A.to(torch::kFloat).contiguous();
  auto mc = centered ? mean.to(torch::kFloat).contiguous() : torch::Tensor();
  auto y = torch::empty({n, Hx, d}, x.options().dtype(torch::kFloat));
  if (y.numel() == 0) return y;
  const float* mp = centered ? mc.data_ptr<float>() : nullptr;
  if (x.scalar_type() == torch::kFloat)
    head_transform_impl(x.data_ptr<float>(), x.stride(0), x.stride(1), n, Hx, Hx / H, d, mp, Ac.data_ptr<float>(), y.data_ptr<float>());
  else if (x.scalar_type() == torch::kHalf)
    head_transform_impl(x.data_ptr<c10::Half>(), x.stride(0), x.stride(1), n, Hx, Hx / H, d, mp, Ac.data_ptr<float>(), y.data_ptr<float>());
  else
    head_transform_impl(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), n, Hx, Hx / H, d, mp, Ac.data_ptr<float>(), y.data_ptr<float>());
  return y;
}

// ---- the windows' copies (wushkv_vllm.paged.Windows.write) ------------------------------------------------------
// Token i's keys and values (rows keep[i] of k (T,H,d) float32 and v (T,H,d) float32, float16 or bfloat16, as the
// model gave them; i itself where keep is empty) into the pool's cell
// cells[i] = row·U + slot of pool (P,U,H,2,d) float32/float16/bfloat16, converted as Tensor.to does (round to nearest
// even), and written (P,U) bool set there: one call where torch took five operations (stack, convert, two indexed
// writes, the index's copy), each of which costs more than its work at a decode step's few tokens.
template <typename T, typename V>
static void windows_write_impl(T* pool, bool* written, const int64_t* cells, const int64_t* keep, int64_t n, int64_t H,
                               int64_t d, const float* kp, const V* vp, const int64_t ks[2], const int64_t vs[2],
                               const int64_t ps[3], int64_t U) {
  at::parallel_for(0, n, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = keep ? keep[i] : i;
      T* dst = pool + (cells[i] / U) * ps[0] + (cells[i] % U) * ps[1];  // row, slot
      for (int64_t h = 0; h < H; ++h) {
        const float* kr = kp + t * ks[0] + h * ks[1];
        const V* vr = vp + t * vs[0] + h * vs[1];
        T* o = dst + h * ps[2];
        for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(kr[j]);
        for (int64_t j = 0; j < d; ++j) o[d + j] = static_cast<T>(static_cast<float>(vr[j]));  // exact widening first
      }
      written[cells[i]] = true;
    }
  });
}

void windows_write(torch::Tensor pool, torch::Tensor written, torch::Tensor cells, torch::Tensor keep, torch::Tensor k,
                   torch::Tensor v) {
  TORCH_CHECK(pool.is_cpu() && k.is_cpu() && v.is_cpu() && written.is_cpu() && cells.is_cpu() && keep.is_cpu(),
              "windows_write: CPU tensors, got pool on ", pool.device(), ", k on ", k.device(), ", v on ", v.device());
  TORCH_CHECK(pool.dim() == 5 && pool.size(3) == 2 && pool.stride(4) == 1 && pool.stride(3) == pool.size(4),
              "pool: (P, U, H, 2, d) with dense (2, d) rows (token- or head-major), got ", pool.sizes(), " strides ",
              pool.strides());
  TORCH_CHECK(written.scalar_type() == torch::kBool && written.is_contiguous() &&
              written.numel() == pool.size(0) * pool.size(1), "written: contiguous bool (P, U)");
  TORCH_CHECK(cells.scalar_type() == torch::kInt64 && cells.dim() == 1 && cells.is_contiguous(), "cells: int64 (n,)");
  const int64_t n = cells.size(0), H = pool.size(2), d = pool.size(4), PU = written.numel();
  TORCH_CHECK(k.scalar_type() == torch::kFloat &&
              (v.scalar_type() == torch::kFloat || v.scalar_type() == torch::kHalf || v.scalar_type() == torch::kBFloat16) &&
              k.dim() == 3 && v.dim() == 3 &&
              k.size(1) == H && v.size(1) == H && k.size(2) == d && v.size(2) == d && k.size(0) == v.size(0) &&
              k.stride(2) == 1 && v.stride(2) == 1, "k float32, v float32/16 (T, H, d) with the pool's H ", H, " and d ", d,
              ", dense rows; got ", k.scalar_type(), " ", k.sizes(), " and ", v.scalar_type(), " ", v.sizes());
  const bool sel = keep.numel() > 0;
  TORCH_CHECK(!sel || (keep.scalar_type() == torch::kInt64 && keep.is_contiguous() && keep.numel() == n),
              "keep: int64 (n,) or empty");
  const int64_t* cp = cells.data_ptr<int64_t>();
  const int64_t* kp = sel ? keep.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= cp[i] && cp[i] < PU, "cell ", cp[i], " out of the pool's ", PU);
    TORCH_CHECK(0 <= (sel ? kp[i] : i) && (sel ? kp[i] : i) < k.size(0), "token ", (sel ? kp[i] : i), " out of the ",
                k.size(0), " given");
  }
  const int64_t ks[2] = {k.stride(0), k.stride(1)}, vs[2] = {v.stride(0), v.stride(1)};
  const int64_t ps[3] = {pool.stride(0), pool.stride(1), pool.stride(2)}, U = pool.size(1);
  const float* kd = k.data_ptr<float>();
  bool* wp = written.data_ptr<bool>();
  auto by_values = [&](auto* pp) {
    if (v.scalar_type() == torch::kFloat) windows_write_impl(pp, wp, cp, kp, n, H, d, kd, v.data_ptr<float>(), ks, vs, ps, U);
    else if (v.scalar_type() == torch::kHalf) windows_write_impl(pp, wp, cp, kp, n, H, d, kd, v.data_ptr<c10::Half>(), ks, vs, ps, U);
    else windows_write_impl(pp, wp, cp, kp, n, H, d, kd, v.data_ptr<c10::BFloat16>(), ks, vs, ps, U);
  };
  if (pool.scalar_type() == torch::kFloat) by_values(pool.data_ptr<float>());
  else if (pool.scalar_type() == torch::kHalf) by_values(pool.data_ptr<c10::Half>());
  else if (pool.scalar_type() == torch::kBFloat16) by_values(pool.data_ptr<c10::BFloat16>());
  else TORCH_CHECK(false, "pool: float32, float16 or bfloat16, got ", pool.scalar_type());
}

// ---- KVarN tiles (wushkv.quantizers.kvarn) -----------------------------------------------------------------------
// A tile is one R x C matrix in L1; every loop below runs over a contiguous row, and the row reductions keep 16
// independent partial sums so they vectorize without reassociating (no -ffast-math). Two-pass mean/variance in
// float32, as exact as PyTorch's reductions though not bit-equal to them.
static inline float row_sum(const float* __restrict x, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += x[i + k];
  float s = 0.f;
  for (; i < n; ++i) s += x[i];
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

static inline float row_sq_dev(const float* __restrict x, int64_t n, float m) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) { const float t = x[i + k] - m; acc[k] += t * t; }
  float s = 0.f;
  for (; i < n; ++i) { const float t = x[i] - m; s += t * t; }
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

// unbiased std of each row (R) and each column (C) of B (R, C); mean: C floats of scratch
static void tile_stds(const float* __restrict B, int64_t R, int64_t C, float* __restrict std_r, float* __restrict std_c,
                      float* __restrict mean) {
  if (std_r)
    for (int64_t r = 0; r < R; ++r) {
      const float* b = B + r * C;
      const float m = row_sum(b, C) / float(C);
      std_r[r] = std::sqrt(row_sq_dev(b, C, m) / float(C - 1));
    }
  if (std_c) {
    std::fill(mean, mean + C, 0.f);
    std::fill(std_c, std_c + C, 0.f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) mean[c] += B[r * C + c];
    for (int64_t c = 0; c < C; ++c) mean[c] /= float(R);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) { const float t = B[r * C + c] - mean[c]; std_c[c] += t * t; }
    for (int64_t c = 0; c < C; ++c) std_c[c] = std::sqrt(std_c[c] / float(R - 1));
  }
}

// max std / max(min std, 1e-8) over columns plus over rows (kvarn.imbalance)
static float tile_imbalance(const float* B, int64_t R, int64_t C, float* std_r, float* std_c, float* mean) {
  tile_stds(B, R, C, std_r, std_c, mean);
  auto ratio = [](const float* s, int64_t n) {
    float hi = s[0], lo = s[0];
    for (int64_t i = 1; i < n; ++i) { hi = std::max(hi, s[i]); lo = std::min(lo, s[i]); }
    // NaN propagates as torch's amax/amin do: a NaN std makes the ratio NaN
    for (int64_t i = 0; i < n; ++i) if (std::isnan(s[i])) return NAN;
    return hi / std::max(lo, 1e-8f);
  };
  return ratio(std_c, C) + ratio(std_r, R);
}

// B = A / (exp(log_r) exp(log_c)^T)
static inline void divide_out(const float* __restrict A, const float* __restrict er, const float* __restrict ec, int64_t R,
                              int64_t C, float* __restrict B) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) B[r * C + c] = A[r * C + c] / (er[r] * ec[c]);
}

std::vector<torch::Tensor> kvarn_balance(torch::Tensor A, int64_t iters) {
  TORCH_CHECK(A.dim() == 3 && A.scalar_type() == torch::kFloat32, "A must be (N,R,C) float32");
  TORCH_CHECK(A.size(1) >= 2 && A.size(2) >= 2 && iters >= 0, "tiles need R, C >= 2 and iters >= 0");
  A = A.contiguous();
  const int64_t N = A.size(0), R = A.size(1), C = A.size(2);
  auto Bout = torch::empty_like(A);
  auto LR = torch::zeros({N, R}, A.options()), LC = torch::zeros({N, C}, A.options());
  const float* ap = A.data_ptr<float>();
  float *bp = Bout.data_ptr<float>(), *lrp = LR.data_ptr<float>(), *lcp = LC.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> B(R * C), lr(R), lc(C), er(R), ec(C), sr(R), sc(C), mean(C), br(R), bc(C);
    for (int64_t n = n0; n < n1; ++n) {
      const float* a = ap + n * R * C;
      std::fill(lr.begin(), lr.end(), 0.f);
      std::fill(lc.begin(), lc.end(), 0.f);
      std::fill(br.begin(), br.end(), 0.f);
      std::fill(bc.begin(), bc.end(), 0.f);
      float best = tile_imbalance(a, R, C, sr.data(), sc.data(), mean.data());
      std::copy(a, a + R * C, B.begin());
      for (int64_t it = 0; it < iters; ++it) {
        tile_stds(B.data(), R, C, nullptr, sc.data(), mean.data());
        for (int64_t c = 0; c < C; ++c) {
          lc[c] = std::min(std::max(lc[c] + std::log(std::min(std::max(sc[c], 1e-3f), 1e3f)), -0.3f), 10.f);
          ec[c] = std::exp(lc[c]);
        }
        for (int64_t r = 0; r < R; ++r) er[r] = std::exp(lr[r]);
        divide_out(a, er.data(), ec.data(), R, C, B.data());
        tile_stds(B.data(), R, C, sr.data(), nullptr, mean.data());
        for (int64_t r = 0; r < R; ++r) {
          lr[r] = std::min(std::max(lr[r] + std::log(std::min(std::max(sr[r], 1e-3f), 1e3f)), -0.3f), 10.f);
          er[r] = std::exp(lr[r]);
        }
        divide_out(a, er.data(), ec.data(), R, C, B.data());
        const float imb = tile_imbalance(B.data(), R, C, sr.data(), sc.data(), mean.data());
        if (imb < best) {  // strictly better only: a NaN never replaces the incumbent
          best = imb;
          br = lr;
          bc = lc;
        }
      }
      for (int64_t r = 0; r < R; ++r) er[r] = std::exp(br[r]);
      for (int64_t c = 0; c < C; ++c) ec[c] = std::exp(bc[c]);
      divide_out(a, er.data(), ec.data(), R, C, bp + n * R * C);
      std::copy(br.begin(), br.end(), lrp + n * R);
      std::copy(bc.begin(), bc.end(), lcp + n * C);
    }
  });
  return {Bout, LR, LC};
}

// Each row's grid (min-max, or clipped to mean ± clip·alpha·σ) and its codes (round half to even, as torch.round), rows
// in order; with feedback F (R, R), row r's error as the decoder reads it (float16 metadata) is pushed onto the later
// rows, W[r'] -= F[r, r'] e (kvarn._feedback_rows).
std::vector<torch::Tensor> kvarn_rows(torch::Tensor A, torch::Tensor log_r, torch::Tensor log_c, torch::Tensor F, int64_t bits,
                                      double clip, double alpha) {
  TORCH_CHECK(A.dim() == 3 && A.scalar_type() == torch::kFloat32, "A must be (N,R,C) float32");
  const int64_t N = A.size(0), R = A.size(1), C = A.size(2);
  TORCH_CHECK(log_r.sizes() == torch::IntArrayRef({N, R}) && log_c.sizes() == torch::IntArrayRef({N, C}), "log_r (N,R), log_c (N,C)");
  const bool fb = F.numel() > 0;
  TORCH_CHECK(!fb || (F.scalar_type() == torch::kFloat32 && F.sizes() == torch::IntArrayRef({N, R, R})), "F must be (N,R,R) float32");
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits in 1..8");
  A = A.contiguous(); log_r = log_r.contiguous(); log_c = log_c.contiguous();
  if (fb) F = F.contiguous();
  auto Q = torch::empty({N, R, C}, A.options().dtype(torch::kUInt8));
  auto LO = torch::empty({N, R}, A.options()), ST = torch::empty({N, R}, A.options());
  const float *ap = A.data_ptr<float>(), *lrp = log_r.data_ptr<float>(), *lcp = log_c.data_ptr<float>();
  const float* fp = fb ? F.data_ptr<float>() : nullptr;
  uint8_t* qp = Q.data_ptr<uint8_t>();
  float *lop = LO.data_ptr<float>(), *stp = ST.data_ptr<float>();
  const float qmax = float((1 << bits) - 1), c_alpha = float(clip * alpha);
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> W(R * C), b(C), fold(C), fold16(C), q(C);
    for (int64_t n = n0; n < n1; ++n) {
      std::copy(ap + n * R * C, ap + (n + 1) * R * C, W.begin());
      for (int64_t c = 0; c < C; ++c) {
        fold[c] = std::exp(lcp[n * C + c]);
        fold16[c] = float(c10::Half(fold[c]));
      }
      for (int64_t r = 0; r < R; ++r) {
        const float re = std::exp(lrp[n * R + r]);
        float* w = W.data() + r * C;
        for (int64_t c = 0; c < C; ++c) b[c] = w[c] / (re * fold[c]);
        float lo = b[0], hi = b[0];
        for (int64_t c = 1; c < C; ++c) { lo = std::min(lo, b[c]); hi = std::max(hi, b[c]); }
        if (clip > 0) {
          const float m = row_sum(b.data(), C) / float(C);
          const float half = c_alpha * std::sqrt(row_sq_dev(b.data(), C, m) / float(C));
          lo = std::max(lo, m - half);
          hi = std::min(hi, m + half);
        }
        const float step = std::max((hi - lo) / qmax, 1e-10f);
        lop[n * R + r] = lo;
        stp[n * R + r] = step;
        uint8_t* qr = qp + (n * R + r) * C;
        for (int64_t c = 0; c < C; ++c) {
          const float v = std::min(std::max(std::nearbyint((b[c] - lo) / step), 0.f), qmax);
          q[c] = v;
          qr[c] = uint8_t(v);
        }
        if (fb && r + 1 < R) {
          const float s16 = float(c10::Half(re * step)), z16 = float(c10::Half(re * lo));
          for (int64_t c = 0; c < C; ++c) b[c] = w[c] - fold16[c] * (s16 * q[c] + z16);  // the error e, reusing b
          const float* frow = fp + (n * R + r) * R;
          for (int64_t r2 = r + 1; r2 < R; ++r2) {
            const float f = frow[r2];
            float* w2 = W.data() + r2 * C;
            for (int64_t c = 0; c < C; ++c) w2[c] -= f * b[c];
          }
        }
      }
    }
  });
  return {Q, LO, ST};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("simd_path", &simd_path, "the vector instructions this build's kernels use: avx512, avx2 or scalar");
  m.def("feedback_round", &feedback_round, "codes rounded with error feedback");
  m.def("code_dot", &code_dot, "Σ_i c_ji q_gi over packed codes");
  m.def("code_dot_tiles", &code_dot_tiles, "Σ_i c_ji q_gi over packed codes, one query set per tile of tokens");
  m.def("paged_decode", &paged_decode, "decode attention over paged cells");
  m.def("parts_decode", &parts_decode, "decode attention over a layer's [sink, packed middle, recent]");
  m.def("paged_dequantize", &paged_dequantize, "keys and values of a request's cells");
  m.def("paged_store", &paged_store, "write the cells of new tokens at their slots");
  m.def("windows_write", &windows_write, "the windows' full-precision copies of new tokens into their pool");
  m.def("head_transform", &head_transform, "per-head transforms of tokens, each token on its own");
  m.def("quest_steps", &quest_steps, "QuEST's steps of tokens, in PyTorch's order of operations");
  m.def("kvarn_balance", &kvarn_balance, "KVarN dual-axis balance of tiles");
  m.def("kvarn_rows", &kvarn_rows, "KVarN row grids and codes, with error feedback");
  m.def("code_weighted_sum", &code_weighted_sum, "Σ_j w_gj c_j over packed codes");
}
