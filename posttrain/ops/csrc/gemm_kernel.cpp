// The rollout engine's linears at decode shapes: y = x·Wᵀ (+ b) (+ residual) for x (M, K) with M from 1 to a
// few hundred rows, against a weight packed once per weight change.
//
// Packed layout: W (N, K) as P = ⌈N / NR⌉ panels of NR output columns, each (K, NR) contiguous, zero-padded past N:
// a panel is one sequential stream, read once from memory per call and then from cache by every row block.
// Micro-kernel: MR = 6 rows × NR = 2 vectors (16 floats with AVX2, 32 with AVX-512): 12 accumulators, 2 panel
// vectors and 1 broadcast row value in registers (15 of AVX2's 16), 12 FMAs per 2 vector loads + 6 broadcasts.
// While a panel is in use, the next one is prefetched a few lines per k step (decode is also a weight stream).
// Threads claim runs of panels (claimed.h); rows go in chunks of MC so a chunk of x stays in cache across the
// panels, and a chunk's rows are spread evenly over its ⌈rows / MR⌉ tiles (64 rows: 9 x 6 + 2 x 5, not 10 x 6 + 4).
//
// Every output is  y[m][n] = ((Σ_{k=0..K-1} x[m][k]·W[n][k]) + b[n]) + r[m][n]  with the sum a chain of float32 FMAs
// in k order from 0: the same for any M, any row block, any thread count (batch-invariant), and within fp32's
// summation bound of any other order.
//
// bf16 variant (CPUs with AVX-512 BF16): x, W, residual and y in bf16. A panel holds k in pairs, (K/2, NR, 2): one
// 64-byte vector is 16 columns × (W[n][2j], W[n][2j+1]); x's pair (x[m][2j], x[m][2j+1]) is broadcast as one
// 32-bit value and vdpbf16ps adds both exact products to each float32 lane: same tiles, half the bytes and steps.
// Bias and residual are added to the float32 sum, then each output is rounded once to bf16 (nearest even).
// Widened bf16 (CPUs without bf16 dot products): float32 panels of bf16 values, bf16 x (widened per call, exactly),
// residual and y: the float32 kernel's sums, rounded once to bf16 in the epilogue.
//
// SwiGLU epilogue (glu): a SiLU MLP's [gate; up] packed with its rows interleaved (each panel: VL gate columns, then
// the same VL up columns), so a tile holds matching gate and up sums and stores h = silu(gate) * up (M, N/2)
// with `silu_mul`'s bf16 roundings and exp, bit for bit; the (M, N) gate|up output is never written.
//
// Training's fp32 linears use it too where ops/linear.py's rule says (AMD Zen 2): y = x·Wᵀ as above, ∂x = ∂y·W with W
// packed from its transposed view (panel rows are rows of Wᵀ: plain copies), ∂W = ∂yᵀ·x with x packed the same way and
// ∂yᵀ given as a transposed view (each chunk of MC rows transposed into a buffer by 8 x 8 register transposes).
//
// Measured (2 threads, SmolLM2-135M's 121 linears in decode order, weights from memory), against oneDNN's packed
// linear: AMD EPYC Zen 3 (float32): 32 rows 153-164 GFLOP/s against 105-107, 64 rows 175-180 against 123-128 (the
// 2048³ peak there: ~186); 8 rows 97-104 against 49-58. AMD EPYC Zen 4: float32 64 rows 208 against 195; bf16 64
// rows 410 against 330, 32 rows 366 against 302, 8 rows 175 against 152. AMD EPYC Zen 2 (float32): 64 rows 142
// against 100, 32 rows 127 against 80, 8 rows 70 against 38 (82 at 64 rows while the epilogue spilled `acc`: see micro).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "claimed.h"
#include "transpose.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
constexpr int VL = 16;
typedef __m512 V;
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vzero() { return _mm512_setzero_ps(); }
#else
constexpr int VL = 8;
typedef __m256 V;
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vzero() { return _mm256_setzero_ps(); }
#endif
constexpr int NV = 2, NR = NV * VL, MR = 6;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// bf16 x over float32 panels (the engine's widened weights): x is widened into a buffer anyway, so it is laid out
// tile by tile, k-major (element (i, k) of a tile of R rows at k*R + i): R broadcasts from one pointer, and tiles of up
// to 12 rows (24 accumulators of AVX-512's 32 registers; 6 rows read each panel line twice as often)
constexpr bool PACK_X = true;
constexpr int MRW = 12;
#else
constexpr bool PACK_X = false;  // AVX2 (16 registers): 6-row tiles read in place from the widened rows
constexpr int MRW = MR;
#endif
constexpr int64_t MC = 384;  // rows per chunk: 384 × K floats of x stay in L2/L3 while every panel passes

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool BF16_KERNEL = true;  // vdpbf16ps: the bf16 variant below is built
#else
constexpr bool BF16_KERNEL = false;
#endif

// One micro-kernel call. T = float: the float32 kernel (panels of (K, NR) floats, K steps of one k). T = uint16_t
// (bf16 bits, AVX-512 BF16 only): panels of (K/2, NR) pairs (W[n][2j], W[n][2j+1]), K/2 steps of two k each.
// O: the output and residual element, T's own, or bf16 bits over float32 panels (widened bf16: one rounding).
template <typename T, typename O = T>
struct Tile {
  const T* a;       // x rows (R, K), row stride lda
  int64_t lda;
  const T* b;       // the panel: (steps, NR) floats, or (steps, NR, 2) bf16
  int64_t steps;    // k steps: K (float32) or K/2 (bf16 pairs)
  O* c;             // output rows, stride ldc, `cols` valid columns
  int64_t ldc, cols;
  const float* bias;  // the panel's `cols` bias values (float32), or null
  const O* res;       // residual rows, stride ldc, or null
  const char* pf;     // lines of the next panel to prefetch, or null
  int64_t pf_lines;
  int64_t glu_exp;    // SwiGLU epilogue: columns of h below this take the vector exp (-1: no SwiGLU)
  int64_t col0;       // the tile's first column of h
};

// acc[i][j] += x[i, step] ⊗ panel[step, j-th vector], i < R: one k (float32: broadcast x, FMA) or two
// (bf16: broadcast the pair x[2s], x[2s+1] as one 32-bit value; vdpbf16ps adds both products to each lane)
template <int R, typename O>
inline void step(const Tile<float, O>& t, int64_t k, V (&acc)[R][NV]) {
  V b[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) b[j] = vload(t.b + k * NR + j * VL);
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    const V a = PACK_X && !std::is_same_v<O, float> ? vbcast(t.a + k * R + i) : vbcast(t.a + i * t.lda + k);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = vfma(a, b[j], acc[i][j]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <int R, typename O>
inline void step(const Tile<uint16_t, O>& t, int64_t s, V (&acc)[R][NV]) {
  __m512bh b[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) b[j] = (__m512bh)_mm512_loadu_si512(t.b + (s * NR + j * VL) * 2);
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    int32_t pair;
    std::memcpy(&pair, t.a + i * t.lda + 2 * s, 4);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
  }
}
#endif

// SwiGLU epilogue of a tile's R rows: the panel's first vector holds VL gate columns, its second the same VL up columns
// (`glu_rows` order). h = bf16(float(bf16(silu(g))) * float(u)) with g, u the bf16 roundings of the sums (+ bias):
// what the engine's gate|up linear (bf16 out) then `silu_mul` compute, bit for bit, including which columns take
// SLEEF's vector exp (col < glu_exp; the R rows' exps interleaved) and which std::exp (a row's tail in torch's
// vectorized loop). O = float (the widened-bf16 path with float32 x: float32 panels of bf16 values) stores those bf16
// values as float32.
template <int R, typename T, typename O>
inline void glu_store(const Tile<T, O>& t, V (&acc)[R][NV]) {
  using posttrain_vec::round_bf;
  using posttrain_vec::vec;
  vec g[R], u[R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    g[i] = (vec)acc[i][0];
    u[i] = (vec)acc[i][1];
    if (t.bias) {
      g[i] += posttrain_vec::loadv(t.bias);
      u[i] += posttrain_vec::loadv(t.bias + VL);
    }
    g[i] = round_bf(g[i]);
  }
  if (t.col0 + VL <= t.glu_exp)
    posttrain_vec::silu<R>(g);
  else
    for (int i = 0; i < R; ++i)
      for (int l = 0; l < VL; ++l) g[i][l] = posttrain_bf16::silu(g[i][l]);
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    const vec h = round_bf(g[i]) * round_bf(u[i]);
    if constexpr (std::is_same_v<O, uint16_t>)
      posttrain_vec::store_bf16(t.c + i * t.ldc, h);  // rounded once, to nearest even
    else
      posttrain_vec::storev(t.c + i * t.ldc, round_bf(h));
  }
}

// R rows (1..MR) of a tile: acc = Σ_k x[:, k] ⊗ panel[k, :], then + bias, + residual (in float32), stored (only
// `cols` columns; bf16 outputs rounded once, to nearest even), or the SwiGLU epilogue (glu_exp >= 0).
template <int R, typename T, typename O>
__attribute__((noinline)) void micro(const Tile<T, O>& t) {  // inlined into a caller, GCC spills accumulators
  V acc[R][NV];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = vzero();
  const int64_t every = t.pf_lines > 0 ? std::max<int64_t>(1, t.steps / t.pf_lines) : t.steps + 1;
  int64_t due = 0, done = 0;
  for (int64_t k = 0; k < t.steps; ++k) {
    if (k == due && done < t.pf_lines) {  // the next panel, spread over the k steps (two lines a step when short)
      _mm_prefetch(t.pf + 64 * done++, _MM_HINT_T0);
      if (every == 1 && done < t.pf_lines) _mm_prefetch(t.pf + 64 * done++, _MM_HINT_T0);
      due += every;
    }
    step<R>(t, k, acc);
  }
  if (t.glu_exp >= 0) {
    glu_store<R>(t, acc);
    return;
  }
  if (t.cols == NR) {  // a whole panel: the same adds and rounding as below, a vector at a time
    using posttrain_vec::loadv;
    using posttrain_vec::vec;
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        vec y = (vec)acc[i][j];
        if (t.bias) y += loadv(t.bias + j * VL);
        if (t.res) y += loadv(t.res + i * t.ldc + j * VL);
        posttrain_vec::storev(t.c + i * t.ldc + j * VL, y);  // bf16: rounded once, to nearest even
      }
    return;
  }
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    alignas(64) float row[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vstore(row + j * VL, acc[i][j]);
    if (t.bias)
      for (int64_t c = 0; c < t.cols; ++c) row[c] += t.bias[c];
    if (t.res)
      for (int64_t c = 0; c < t.cols; ++c) row[c] += posttrain_bf16::to_f(t.res[i * t.ldc + c]);
    for (int64_t c = 0; c < t.cols; ++c) posttrain_bf16::put(t.c + i * t.ldc + c, row[c]);
  }
}

template <typename T, typename O>
void run_tile(const Tile<T, O>& t, int64_t rows) {
  switch (rows) {
#if defined(__AVX512F__)
    case 12: micro<12>(t); break;
    case 11: micro<11>(t); break;
    case 10: micro<10>(t); break;
    case 9: micro<9>(t); break;
    case 8: micro<8>(t); break;
    case 7: micro<7>(t); break;
#endif
    case 6: micro<6>(t); break;
    case 5: micro<5>(t); break;
    case 4: micro<4>(t); break;
    case 3: micro<3>(t); break;
    case 2: micro<2>(t); break;
    default: micro<1>(t); break;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using posttrain_simd::transpose16;

// rows (<= 16) bf16 rows of x (row stride K) -> out (K, rows) float32, k-major (exact widening); writes up to 16 - rows
// floats past the end (the next tile's start, packed after it, or the buffer's slack)
inline void pack_tile(const uint16_t* x, int64_t rows, int64_t K, float* out) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t nk = std::min<int64_t>(16, K - k0);
    const __mmask16 m = static_cast<__mmask16>((1u << nk) - 1u);
    __m512 in[16], tr[16];
    for (int64_t r = 0; r < 16; ++r)
      in[r] = r < rows ? _mm512_castsi512_ps(_mm512_slli_epi32(
                             _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + r * K + k0)), 16))
                       : _mm512_setzero_ps();
    transpose16(in, tr);
    for (int64_t j = 0; j < nk; ++j) _mm512_storeu_ps(out + (k0 + j) * rows, tr[j]);  // in k order: overlaps are rewritten
  }
}
#else
inline void pack_tile(const uint16_t*, int64_t, int64_t, float*) {}  // PACK_X is false here
#endif

// The chunk's mc rows spread evenly over its `tiles` row tiles: tile i's first row (in the chunk) and row count.
// 64 rows: 6 and 5, or 11 and 10 for packed x; never a short tail (a 4-row tile keeps only 8 FMAs in flight, under
// Zen 2's 10 = 2 a cycle x 5 cycles of latency; 64 rows as 10 x 6 + 4 ran 7% slower than 60 or 66 rows). `drive`
// runs these tiles and `rows_as` packs x by them, so both call this, and `tiles_of` for the count (tiles of at most
// mr rows).
struct Span {
  int64_t row, rows;
};
inline int64_t tiles_of(int64_t mc, int64_t mr) { return (mc + mr - 1) / mr; }
inline Span tile_span(int64_t i, int64_t mc, int64_t tiles) {
  return {i * (mc / tiles) + std::min(i, mc % tiles), mc / tiles + (i < mc % tiles)};
}

// Rows [m0, m0 + mc) of x (M, K) as the panels' type T: x itself, or bf16 x over float32 panels widened (exactly)
// into this thread's buffer, once per call and chunk: each thread reads the whole chunk at every panel.
template <typename T, typename O>
const T* rows_as(const O* A, int64_t m0, int64_t mc, int64_t K, int64_t lda) {
  if constexpr (std::is_same_v<T, O>) {
    return A + m0 * lda;
  } else {
    thread_local std::vector<float> wide;
    if (static_cast<int64_t>(wide.size()) < mc * K + VL) wide.resize(mc * K + VL);  // + VL: pack_tile's last store
    const O* a = A + m0 * K;
    float* w = wide.data();
    if constexpr (PACK_X) {
      const int64_t tiles = tiles_of(mc, MRW);
      for (int64_t i = 0; i < tiles; ++i) {  // the tiles `drive` makes of this chunk
        const Span s = tile_span(i, mc, tiles);
        pack_tile(a + s.row * K, s.rows, K, w + s.row * K);
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < mc * K; ++i) w[i] = posttrain_bf16::to_f(a[i]);
    }
    return w;
  }
}

// Eight rows r[0..8) of 8 values each -> out + i*ld holds column i of them (an 8 x 8 transpose in registers).
inline void transpose8(const __m256 r[8], float* out, int64_t ld) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  // u[i], i < 4: column i of rows 0-3 in the low lanes and column i + 4 in the high ones; u[4 + i]: rows 4-7
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ld, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ld, _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
  }
}

// Rows [m0, m0 + mc) of A (M, K) given as Aᵀ (K, M) contiguous (training's ∂W = ∂yᵀ·x), written row-major into
// buf (mc, K) by 8 x 8 register transposes, the threads splitting K: then the chunk is read as any x is.
void transpose_rows(const float* At, int64_t M, int64_t K, int64_t m0, int64_t mc, float* buf) {
  const int64_t m8 = mc / 8 * 8;
  at::parallel_for(0, (K + 7) / 8, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t k0 = b0 * 8; k0 < std::min(K, b1 * 8); k0 += 8) {
      const int64_t kn = std::min<int64_t>(8, K - k0);
      for (int64_t i0 = 0; i0 < m8 && kn == 8; i0 += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(At + (k0 + j) * M + m0 + i0);
        transpose8(r, buf + i0 * K + k0, K);
      }
      for (int64_t i = kn == 8 ? m8 : 0; i < mc; ++i)
        for (int64_t k = k0; k < k0 + kn; ++k) buf[i * K + k] = At[k * M + m0 + i];
    }
  });
}

// C (M, N) = A (M, K)·Wᵀ (+ bias) (+ residual) over P packed panels of `steps` k steps each (`panel` elements of T
// per panel). Rows in chunks of MC; threads claim the panels; each row tile prefetches its share of the next panel.
// O: x, residual and C's element (T, or bf16 over float32 panels). TA: A is given as Aᵀ (K, M) contiguous (float32;
// each chunk transposed into a buffer first). lda: A's row stride where it is read in place (O = T, not TA), else K.
template <bool TA = false, typename T, typename O = T>
void drive(const O* A, int64_t M, int64_t K, const T* B, int64_t P, int64_t steps, int64_t panel, int64_t N,
           const float* bp, const O* rp, O* C, int64_t glu_exp = -1, int64_t lda = 0) {
  const int64_t ld = (std::is_same_v<T, O> && !TA && lda > 0) ? lda : K;  // x's row stride as the tiles read it
  const int64_t lines = panel * int64_t(sizeof(T)) / 64;
  const bool glu = glu_exp >= 0;  // C is h (M, N/2): panel p gives its columns [p*VL, (p+1)*VL)
  const int64_t ldc = glu ? N / 2 : N, width = glu ? VL : NR;
  std::vector<float> chunk(TA ? std::min(MC, M) * K : 0);
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    constexpr int mr = std::is_same_v<T, O> ? MR : MRW;
    const int64_t mc = std::min(MC, M - m0), tiles = tiles_of(mc, mr);
    if constexpr (TA) transpose_rows(A, M, K, m0, mc, chunk.data());
    posttrain_par::claimed_for(P, [&](int64_t) {  // threads claim runs of panels
      const T* a;
      if constexpr (TA)
        a = chunk.data();
      else
        a = rows_as<T>(A, m0, mc, K, ld);
      return [&, a](int64_t p, int64_t q) {  // panel p; q: this thread's next panel (P if none), prefetched
        Tile<T, O> t{nullptr, ld, B + p * panel, steps, nullptr, ldc, std::min<int64_t>(NR, N - p * NR),
                     bp ? bp + p * NR : nullptr, nullptr, nullptr, 0, glu_exp, p * VL};
        const char* next = q < P ? reinterpret_cast<const char*>(B + q * panel) : nullptr;
        for (int64_t i = 0; i < tiles; ++i) {
          const Span s = tile_span(i, mc, tiles);
          const int64_t row = m0 + s.row, rows = s.rows;
          const int64_t first = lines * i / tiles, last = lines * (i + 1) / tiles;
          t.a = a + (row - m0) * ld;
          t.c = C + row * ldc + p * width;
          t.res = rp ? rp + row * N + p * NR : nullptr;
          t.pf = next ? next + 64 * first : nullptr;
          t.pf_lines = next ? last - first : 0;
          run_tile(t, rows);
        }
      };
    });
  }
}

// W (N, K) -> panels: panel p's element (k, c) = W[p*NR + c][k], zero past N. Whole 8 x 8 blocks in registers,
// the k tail and a partial last panel element by element.
template <typename T>
void pack_panels(const T* w, int64_t N, int64_t K, float* out) {
  const int64_t P = (N + NR - 1) / NR, K8 = K / 8 * 8;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* o = out + p * K * NR;
      const int64_t cols = std::min<int64_t>(NR, N - p * NR);
      const T* src = w + p * NR * K;
      for (int64_t c0 = 0; c0 + 8 <= cols; c0 += 8)
        for (int64_t k = 0; k < K8; k += 8) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) r[i] = posttrain_vec::load8(src + (c0 + i) * K + k);
          transpose8(r, o + k * NR + c0, NR);
        }
      const int64_t full = cols / 8 * 8;
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t c = k < K8 ? full : 0; c < cols; ++c) o[k * NR + c] = posttrain_bf16::to_f(src[c * K + k]);
        for (int64_t c = cols; c < NR; ++c) o[k * NR + c] = 0.f;
      }
    }
  });
}

// The same panels from Wᵀ (K, N) contiguous, W given as its transposed view (training's ∂x = ∂y·W): panel p's row k
// is Wᵀ[k][p*NR, p*NR + NR), a plain copy.
void pack_panels_t(const float* wt, int64_t N, int64_t K, float* out) {
  const int64_t P = (N + NR - 1) / NR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(NR, N - p * NR);
      for (int64_t k = 0; k < K; ++k) {
        float* o = out + (p * K + k) * NR;
        std::memcpy(o, wt + k * N + p * NR, cols * sizeof(float));
        std::fill(o + cols, o + NR, 0.f);
      }
    }
  });
}

// x is the transposed view of a contiguous (K, M) tensor, and not contiguous itself
bool transposed(const torch::Tensor& x) {
  return x.dim() == 2 && x.size(0) > 1 && x.size(1) > 1 && x.stride(0) == 1 && x.stride(1) == x.size(0);
}

}  // namespace

bool gemm_kernel_available() { return true; }
bool gemm_bf16_kernel_available() { return BF16_KERNEL; }
int64_t gemm_panel_width() { return NR; }

namespace {

// `into` when it is given and is a contiguous CPU tensor of this shape and dtype (a weight change re-packs in
// place: no fresh pages to fault in), else a new one
torch::Tensor panels(const torch::Tensor& w, const std::vector<int64_t>& shape, torch::ScalarType dtype,
                     const c10::optional<torch::Tensor>& into) {
  const bool reuse = into.has_value() && into->sizes() == c10::IntArrayRef(shape) && into->is_contiguous() &&
                     into->scalar_type() == dtype && into->device().is_cpu();
  return reuse ? *into : torch::empty(shape, w.options().dtype(dtype));
}

}  // namespace

// w (N, K) float32 or bf16 (widened exactly) -> (P, K, NR) float32 panels, into `into` when it fits
torch::Tensor gemm_pack(torch::Tensor w, c10::optional<torch::Tensor> into) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, "gemm_pack: a 2-d CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = panels(w, {(N + NR - 1) / NR, K, NR}, torch::kFloat32, into);
  if (w.scalar_type() == torch::kFloat32 && transposed(w)) {  // w = Wᵀ's view: rows of Wᵀ are the panels' rows
    pack_panels_t(w.data_ptr<float>(), N, K, out.data_ptr<float>());
    return out;
  }
  w = w.contiguous();
  if (w.scalar_type() == torch::kFloat32) {
    pack_panels(w.data_ptr<float>(), N, K, out.data_ptr<float>());
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "gemm_pack: float32 or bfloat16 weights");
    pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K, out.data_ptr<float>());
  }
  return out;
}

// w (N, K) bf16, K even -> (P, K/2, NR, 2) bf16 panels of pairs (W[n][2j], W[n][2j+1]) for vdpbf16ps, into `into`
// when it fits. A pair is 32 bits: the float32 packing's 32-bit transposes move them unchanged (no arithmetic).
torch::Tensor gemm_pack_bf16(torch::Tensor w, c10::optional<torch::Tensor> into) {
  TORCH_CHECK(BF16_KERNEL, "gemm_pack_bf16 needs a CPU with AVX-512 BF16");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0,
              "gemm_pack_bf16: a 2-d bf16 CPU weight with an even number of columns");
  w = w.contiguous();
  const int64_t N = w.size(0), K2 = w.size(1) / 2;
  auto out = panels(w, {(N + NR - 1) / NR, K2, NR, 2}, torch::kBFloat16, into);
  pack_panels(reinterpret_cast<const float*>(w.data_ptr()), N, K2, reinterpret_cast<float*>(out.data_ptr()));
  return out;
}

// x (M, K), packed from gemm_pack (x float32, or bf16: widened exactly, the float32 sum rounded once to bf16) or
// gemm_pack_bf16 (x bf16) of an (N, K) weight, bias (N,) or None, residual (M, N) or None -> (M, N) in x's dtype
// (written into `out_` when given). A float32 x may be the transposed view of a contiguous (K, M) tensor, or rows with
// a stride (read in place).
torch::Tensor gemm_packed(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual, bool glu, c10::optional<torch::Tensor> out_) {
  const bool bf = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(!glu || (N % NR == 0 && !residual.has_value()),
              "gemm_packed: the SwiGLU epilogue needs panels of glu_rows order, N a multiple of ", NR, ", no residual");
  const auto dtype = x.scalar_type();  // of x, the residual and the output
  const bool wide = !bf && dtype == torch::kBFloat16;  // bf16 x over float32 panels (of widened bf16 values)
  TORCH_CHECK(!bf || BF16_KERNEL, "gemm_packed: bf16 panels need a CPU with AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && (dtype == torch::kBFloat16 || (!bf && dtype == torch::kFloat32)) && x.device().is_cpu(),
              "gemm_packed: x (M, K) on the CPU, float32 or bf16 over float32 panels, bf16 over gemm_pack_bf16's");
  const int64_t steps = bf ? x.size(1) / 2 : x.size(1);
  TORCH_CHECK(packed.dim() == (bf ? 4 : 3) && packed.size(2) == NR && packed.size(1) == steps &&
              (!bf || (x.size(1) % 2 == 0 && packed.size(3) == 2)) && packed.size(0) * NR >= N &&
              (packed.size(0) - 1) * NR < N && packed.is_contiguous(), "gemm_packed: packed weight does not match x or N");
  const bool ta = dtype == torch::kFloat32 && !glu && !residual.has_value() && transposed(x);  // x = Aᵀ, A (K, M)
  // float32 rows with a stride (a slice of columns of a wider tensor: the LM head's ∂x by k slices) read in place
  const bool strided = !ta && !bf && dtype == torch::kFloat32 && x.stride(1) == 1 && x.stride(0) >= x.size(1);
  if (!ta && !strided) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const std::vector<int64_t> shape{M, glu ? N / 2 : N};
  TORCH_CHECK(!out_.has_value() || (out_->sizes() == c10::IntArrayRef(shape) && out_->scalar_type() == dtype &&
                                    out_->is_contiguous() && out_->device().is_cpu()),
              "gemm_packed: out must be a contiguous (M, N) CPU tensor of x's dtype");
  auto out = out_.has_value() ? *out_ : torch::empty(shape, x.options());
  torch::Tensor b, r;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "gemm_packed: bias of ", bias->numel(), " values for ", N, " outputs");
    b = bias->to(torch::kFloat32).contiguous();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == out.sizes(), "gemm_packed: residual must be (M, N)");
    r = residual->to(dtype).contiguous();
  }
  if (M == 0 || N == 0) return out;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t panel = steps * NR * (bf ? 2 : 1);  // elements per panel
  const int64_t glu_exp = glu ? N / 2 / posttrain_vec::SILU_STEP * posttrain_vec::SILU_STEP : -1;
  if (bf) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)  // the bf16 micro-kernel exists only there (refused above elsewhere)
    using H = uint16_t;
    drive(reinterpret_cast<const H*>(x.data_ptr()), M, K, reinterpret_cast<const H*>(packed.data_ptr()), P, steps,
          panel, N, bp, r.defined() ? reinterpret_cast<const H*>(r.data_ptr()) : nullptr,
          reinterpret_cast<H*>(out.data_ptr()), glu_exp);
#endif
  } else if (wide) {
    using H = uint16_t;
    drive(reinterpret_cast<const H*>(x.data_ptr()), M, K, packed.data_ptr<float>(), P, steps, panel, N, bp,
          r.defined() ? reinterpret_cast<const H*>(r.data_ptr()) : nullptr, reinterpret_cast<H*>(out.data_ptr()), glu_exp);
  } else if (ta) {
    drive<true>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), P, steps, panel, N, bp,
                static_cast<const float*>(nullptr), out.data_ptr<float>());
  } else {
    drive(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), P, steps, panel, N, bp,
          r.defined() ? r.data_ptr<float>() : nullptr, out.data_ptr<float>(), glu_exp, strided ? x.stride(0) : K);
  }
  return out;
}

// x·wᵀ (+ bias) for a float32 weight that changes between calls (training): w packed into this thread's scratch
// buffer (grown to the largest weight packed so far and kept: fresh pages at every call would cost more than the pack),
// outside torch's allocator as a BLAS keeps its packing buffers, so a memory probe of small passes sees the same
// tensors as with torch.matmul
torch::Tensor gemm_once(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                        c10::optional<torch::Tensor> out) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == torch::kFloat32, "gemm_once: a 2-d float32 CPU weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < P * K * NR) scratch.resize(P * K * NR);
  torch::Tensor packed = torch::from_blob(scratch.data(), {P, K, NR}, torch::kFloat32);
  gemm_pack(w, packed);  // fits: packed in place
  return gemm_packed(x, packed, N, bias, c10::nullopt, false, out);
}

#else  // no AVX2/FMA: the engine keeps oneDNN's packed linear

torch::Tensor gemm_once(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "gemm_once needs an x86-64 CPU with AVX2 and FMA");
}
bool gemm_kernel_available() { return false; }
bool gemm_bf16_kernel_available() { return false; }
int64_t gemm_panel_width() { return 0; }
torch::Tensor gemm_pack_bf16(torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "gemm_pack_bf16 needs an x86-64 CPU with AVX-512 BF16");
}
torch::Tensor gemm_pack(torch::Tensor, c10::optional<torch::Tensor>) { TORCH_CHECK(false, "gemm_pack needs an x86-64 CPU with AVX2 and FMA"); }
torch::Tensor gemm_packed(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, bool,
                          c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "gemm_packed needs an x86-64 CPU with AVX2 and FMA");
}

#endif
