// The rollout engine's float32 linears at decode shapes: y = x·Wᵀ (+ b) (+ residual) for x (M, K) with M from 1 to a
// few hundred rows, against a weight packed once per weight change.
//
// Packed layout: W (N, K) as P = ⌈N / NR⌉ panels of NR output columns, each (K, NR) contiguous, zero-padded past N:
// a panel is one sequential stream, read once from memory per call and then from cache by every row block.
// Micro-kernel: MR = 6 rows × NR = 2 vectors (16 floats with AVX2, 32 with AVX-512): 12 accumulators, 2 panel
// vectors and 1 broadcast row value in registers (15 of AVX2's 16), 12 FMAs per 2 vector loads + 6 broadcasts.
// While a panel is in use, the next one is prefetched a few lines per k step (decode is also a weight stream).
// Threads split the panels; rows go in chunks of MC so a chunk of x stays in cache across the panels.
//
// Every output is  y[m][n] = ((Σ_{k=0..K-1} x[m][k]·W[n][k]) + b[n]) + r[m][n]  with the sum a chain of float32 FMAs
// in k order from 0: the same for any M, any row block, any thread count (batch-invariant), and within fp32's
// summation bound of any other order.
//
// Measured (AMD EPYC Zen 3, 2 threads, SmolLM2-135M's 121 linears in decode order, weights from memory):
// 32 rows 153-164 GFLOP/s against oneDNN's packed linear at 105-107, 64 rows 175-180 against 123-128 (the
// 2048³ peak there: ~186); 8 rows 97-104 against 49-58.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"

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
constexpr int64_t MC = 384;  // rows per chunk: 384 × K floats of x stay in L2/L3 while every panel passes

struct Tile {       // one micro-kernel call
  const float* a;   // x rows (R, K), row stride lda
  int64_t lda;
  const float* b;   // the panel (K, NR)
  int64_t K;
  float* c;         // output rows, stride ldc, `cols` valid columns
  int64_t ldc, cols;
  const float* bias;  // the panel's `cols` bias values, or null
  const float* res;   // residual rows, stride ldc, or null
  const char* pf;     // lines of the next panel to prefetch, or null
  int64_t pf_lines;
};

// R rows (1..MR) of a tile: acc = Σ_k x[:, k] ⊗ panel[k, :], then + bias, + residual, stored (only `cols` columns).
template <int R>
void micro(const Tile& t) {
  V acc[R][NV];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = vzero();
  const int64_t every = t.pf_lines > 0 ? std::max<int64_t>(1, t.K / t.pf_lines) : t.K + 1;
  int64_t due = 0, done = 0;
  for (int64_t k = 0; k < t.K; ++k) {
    if (k == due && done < t.pf_lines) {  // the next panel, spread over the k steps (two lines a step when short)
      _mm_prefetch(t.pf + 64 * done++, _MM_HINT_T0);
      if (every == 1 && done < t.pf_lines) _mm_prefetch(t.pf + 64 * done++, _MM_HINT_T0);
      due += every;
    }
    V b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = vload(t.b + k * NR + j * VL);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const V a = vbcast(t.a + i * t.lda + k);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(a, b[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    alignas(64) float row[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vstore(row + j * VL, acc[i][j]);
    if (t.bias)
      for (int64_t c = 0; c < t.cols; ++c) row[c] += t.bias[c];
    if (t.res)
      for (int64_t c = 0; c < t.cols; ++c) row[c] += t.res[i * t.ldc + c];
    std::memcpy(t.c + i * t.ldc, row, t.cols * sizeof(float));
  }
}

void run_tile(const Tile& t, int64_t rows) {
  switch (rows) {
    case 6: micro<6>(t); break;
    case 5: micro<5>(t); break;
    case 4: micro<4>(t); break;
    case 3: micro<3>(t); break;
    case 2: micro<2>(t); break;
    default: micro<1>(t); break;
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

}  // namespace

bool gemm_kernel_available() { return true; }
int64_t gemm_panel_width() { return NR; }

// w (N, K) float32 or bf16 (widened exactly) -> (P, K, NR) float32 panels, written into `into` when it is given
// and fits (a weight change re-packs in place: no fresh pages to fault in)
torch::Tensor gemm_pack(torch::Tensor w, c10::optional<torch::Tensor> into) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, "gemm_pack: a 2-d CPU weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const std::vector<int64_t> shape{(N + NR - 1) / NR, K, NR};
  const bool reuse = into.has_value() && into->sizes() == c10::IntArrayRef(shape) && into->is_contiguous() &&
                     into->scalar_type() == torch::kFloat32 && into->device().is_cpu();
  auto out = reuse ? *into : torch::empty(shape, w.options().dtype(torch::kFloat32));
  if (w.scalar_type() == torch::kFloat32) {
    pack_panels(w.data_ptr<float>(), N, K, out.data_ptr<float>());
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "gemm_pack: float32 or bfloat16 weights");
    pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K, out.data_ptr<float>());
  }
  return out;
}

// x (M, K) float32, packed from gemm_pack of an (N, K) weight, bias (N,) or None, residual (M, N) or None -> (M, N)
torch::Tensor gemm_packed(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "gemm_packed: x (M, K) float32 CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.size(1) == x.size(1) && packed.size(0) * NR >= N &&
              (packed.size(0) - 1) * NR < N && packed.is_contiguous(), "gemm_packed: packed weight does not match x or N");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  auto out = torch::empty({M, N}, x.options());
  torch::Tensor b, r;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "gemm_packed: bias of ", bias->numel(), " values for ", N, " outputs");
    b = bias->to(torch::kFloat32).contiguous();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == out.sizes(), "gemm_packed: residual must be (M, N)");
    r = residual->to(torch::kFloat32).contiguous();
  }
  if (M == 0 || N == 0) return out;
  const float* A = x.data_ptr<float>();
  const float* B = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = r.defined() ? r.data_ptr<float>() : nullptr;
  float* C = out.data_ptr<float>();
  const int64_t panel = K * NR, lines = panel * int64_t(sizeof(float)) / 64;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t mc = std::min(MC, M - m0), tiles = (mc + MR - 1) / MR;
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        Tile t{nullptr, K, B + p * panel, K, nullptr, N, std::min<int64_t>(NR, N - p * NR),
               bp ? bp + p * NR : nullptr, nullptr, nullptr, 0};
        const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(B + (p + 1) * panel) : nullptr;
        for (int64_t i = 0; i < tiles; ++i) {
          const int64_t row = m0 + i * MR, first = lines * i / tiles, last = lines * (i + 1) / tiles;
          t.a = A + row * K;
          t.c = C + row * N + p * NR;
          t.res = rp ? rp + row * N + p * NR : nullptr;
          t.pf = next ? next + 64 * first : nullptr;
          t.pf_lines = next ? last - first : 0;
          run_tile(t, std::min<int64_t>(MR, m0 + mc - row));
        }
      }
    });
  }
  return out;
}

#else  // no AVX2/FMA: the engine keeps oneDNN's packed linear

bool gemm_kernel_available() { return false; }
int64_t gemm_panel_width() { return 0; }
torch::Tensor gemm_pack(torch::Tensor, c10::optional<torch::Tensor>) { TORCH_CHECK(false, "gemm_pack needs an x86-64 CPU with AVX2 and FMA"); }
torch::Tensor gemm_packed(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "gemm_packed needs an x86-64 CPU with AVX2 and FMA");
}

#endif
