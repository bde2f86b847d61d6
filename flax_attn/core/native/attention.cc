// A fused attention kernel for x86-64 CPUs, called from JAX through XLA's FFI. One source, built
// twice: with AVX-512 (-march=x86-64-v4: 16 floats a vector) and with AVX2 and FMA (8 floats);
// only the vector layer below differs.
//
//   out = softmax(scale * Q K^T [masked]) V          queries (B, T, N, H), keys (B, S, K, H),
//   lse = log sum exp(scale * Q K^T [masked])        values (B, S, K, Hv), out (B, T, N, Hv),
//                                                    lse (B, N, T); G = N / K query heads a key head;
//                                                    lengths q_len, kv_len (B,) int32; heads_major:
//                                                    keys (B K, S, H), values (B K, S, Hv)
//
// The backward pass takes the cotangents of both out and lse: with P the weights,
//   dS = P (dO V^T - rowsum(dO O) + dlse),  dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO.
//
// Every row sees a prefix of the keys: query t of batch row b sees keys s < kv_len[b] (and, causal,
// s <= t + S - T: aligned at the end); queries t >= q_len[b] see none. A row that sees no key
// gets zeros and lse = -inf. H and Hv are multiples of 16; everything else is float32.
// With positions (forward only, where the queries are few: see forward_few), the causal and window
// rules compare q_pos (B, T) and k_pos (B, S) int32 instead: query t sees key s < kv_len[b] where
// -upper <= q_pos[b, t] - k_pos[b, s] <= lower.
//
// Work is split into (batch row, key/value head) units over OpenMP threads (a unit's query heads and
// blocks dealt to several tasks where there are too few units for the threads). A task packs its keys
// (and, backward, its values) transposed into panels of 64 keys once, copies the rows its products
// read as their B operand (values; backward, keys and each block's queries and output gradients)
// into consecutive memory, then visits its G query heads' query blocks: the block's logits
// against all the keys it may see (one product), the softmax over each row at once (no online rescaling), then the values' product. The backward
// pass recomputes the weights from the saved lse and accumulates dK and dV in the task (in rows
// of its own where a unit has several tasks, summed at the end), so no two threads write the
// same rows.
//
// The products are one register-blocked micro-kernel: C[R x W*NV] += A(r, kk) * B[kk, :] with
// A read through two strides (so A and its transpose are both served without copies) and B's
// rows W*NV contiguous floats; the kk axis runs in chunks of KC so a chunk of B stays in L1.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t KC = 128;  // kk chunk of a product
constexpr int64_t PANEL = 64;  // columns of a packed key panel

// ------------------------------------------------------------------ the vector layer
// Everything below it is written once against these: W floats a vector, a lane mask, and e^x.
#if defined(__AVX512F__) && defined(__AVX512DQ__)
constexpr int W = 16;
constexpr int NVMAX = 4;  // vectors across a micro-kernel tile: 6 x 64 accumulators of the 32 registers
using vf = __m512;
using vmask = __mmask16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
// The lanes of a step starting at column j that lie below lim.
inline vmask below(int64_t j, int64_t lim) {
  if (j + W <= lim) return 0xffff;
  if (j >= lim) return 0;
  return vmask((1u << (lim - j)) - 1);
}
inline vf max_where(vf m, vmask k, vf x) { return _mm512_mask_max_ps(m, k, m, x); }
inline vf keep(vmask k, vf x) { return _mm512_maskz_mov_ps(k, x); }

// e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to degree 7 (relative
// error below 2e-7), 2^n by vscalefps. Inputs below -104 give 0 (denormal floor); NaN stays NaN
// (vmaxps returns its second operand where either is NaN).
inline vf clamp_low(vf x) { return _mm512_max_ps(vset(-104.f), x); }
inline vf round_int(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf times_pow2(vf p, vf n, vf) { return _mm512_scalef_ps(p, n); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr int NVMAX = 2;  // 6 x 16 accumulators of the 16 registers
using vf = __m256;
using vmask = __m256;  // lanes of all ones or all zeros
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float hsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vmask below(int64_t j, int64_t lim) {
  const int left = int(std::clamp<int64_t>(lim - j, 0, W));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline vf max_where(vf m, vmask k, vf x) { return _mm256_blendv_ps(m, _mm256_max_ps(m, x), k); }
inline vf keep(vmask k, vf x) { return _mm256_and_ps(k, x); }

// e^x as above, 2^n built in the exponent field, so the floor is the smallest normal float:
// inputs below ln 2^-126 give 0 (masked after the fact; NaN compares unordered and is kept).
constexpr float LOWEST = -87.33f;  // above ln 2^-126 = -87.3365: n >= -126
inline vf clamp_low(vf x) { return _mm256_max_ps(vset(LOWEST), x); }
inline vf round_int(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf times_pow2(vf p, vf n, vf x) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_cmp_ps(x, vset(LOWEST), _CMP_NLT_UQ), _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
#error "the kernel needs AVX-512 (F, DQ) or AVX2 with FMA"
#endif

inline vf vexp(vf x) {
  const vf xc = clamp_low(x);
  const vf n = round_int(vmul(xc, vset(1.44269504088896341f)));
  vf r = vfnma(n, vset(0.693145751953125f), xc);  // ln2, high part
  r = vfnma(n, vset(1.428606765330187045e-06f), r);  // ln2, low part
  vf p = vset(1.f / 5040);
  p = vfma(p, r, vset(1.f / 720));
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
  return times_pow2(p, n, x);
}

// C[R x W NV] (= or +=) alpha * sum_kk A(r, kk) B[kk, :], A(r, kk) = a[r ai + kk ak], B's row kk at b + kk bs.
template <int R, int NV>
inline void micro(int64_t kd, const float* a, int64_t ai, int64_t ak, const float* b, int64_t bs, float alpha,
                  bool acc, float* c, int64_t cs) {
  vf s[R][NV];
  for (int r = 0; r < R; ++r)
    for (int z = 0; z < NV; ++z) s[r][z] = vzero();
  for (int64_t kk = 0; kk < kd; ++kk) {
    vf bv[NV];
    for (int z = 0; z < NV; ++z) bv[z] = vload(b + kk * bs + W * z);
    for (int r = 0; r < R; ++r) {
      const vf av = vset(a[r * ai + kk * ak]);
      for (int z = 0; z < NV; ++z) s[r][z] = vfma(av, bv[z], s[r][z]);
    }
  }
  const vf al = vset(alpha);
  for (int r = 0; r < R; ++r)
    for (int z = 0; z < NV; ++z) {
      vf v = vmul(s[r][z], al);
      if (acc) v = vadd(v, vload(c + r * cs + W * z));
      vstore(c + r * cs + W * z, v);
    }
}

// Every row of C in tiles of RM rows (fewer for the last): RM * NV accumulators, NV rows of B
// and A's broadcast fit the registers (32 with AVX-512, 16 with AVX2).
template <int NV>
void rows(int64_t m, int64_t kd, const float* a, int64_t ai, int64_t ak, const float* b, int64_t bs, float alpha,
          bool acc, float* c, int64_t cs) {
  constexpr int RM = NV == NVMAX ? 6 : 8;
  int64_t i = 0;
  for (; i + RM <= m; i += RM) micro<RM, NV>(kd, a + i * ai, ai, ak, b, bs, alpha, acc, c + i * cs, cs);
  const float* ar = a + i * ai;
  float* cr = c + i * cs;
  switch (m - i) {
    case 7: micro<7, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    case 6: micro<6, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    case 5: micro<5, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    case 4: micro<4, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    case 3: micro<3, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    case 2: micro<2, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    case 1: micro<1, NV>(kd, ar, ai, ak, b, bs, alpha, acc, cr, cs); break;
    default: break;
  }
}

// rows<nv> for a run-time nv in 1..NV.
template <int NV = NVMAX>
void rows_of(int nv, int64_t m, int64_t kd, const float* a, int64_t ai, int64_t ak, const float* b, int64_t bs,
             float alpha, bool acc, float* c, int64_t cs) {
  if constexpr (NV > 0) {
    if (nv == NV) return rows<NV>(m, kd, a, ai, ak, b, bs, alpha, acc, c, cs);
    rows_of<NV - 1>(nv, m, kd, a, ai, ak, b, bs, alpha, acc, c, cs);
  }
}

// C[m x n] (= or +=) alpha * A B with n % 16 == 0; A(i, kk) = a[i ai + kk ak]; B in panels of 64
// columns, panel p's row kk at b + p ps + kk bs. A panel is covered in tiles of W NVMAX columns.
void gemm(int64_t m, int64_t n, int64_t kd, const float* a, int64_t ai, int64_t ak, const float* b, int64_t bs,
          int64_t ps, float alpha, bool acc, float* c, int64_t cs) {
  constexpr int64_t STEP = W * NVMAX;
  for (int64_t k0 = 0; k0 < kd; k0 += KC) {
    const int64_t kn = std::min(KC, kd - k0);
    const bool ac = acc || k0 > 0;
    const float* a0 = a + k0 * ak;
    for (int64_t j = 0, p = 0; j < n; j += PANEL, ++p) {
      const float* bp = b + p * ps + k0 * bs;
      const int64_t w = std::min(PANEL, n - j);
      for (int64_t c0 = 0; c0 < w; c0 += STEP)
        rows_of(int(std::min(STEP, w - c0) / W), m, kn, a0, ai, ak, bp + c0, bs, alpha, ac, c + j + c0, cs);
    }
  }
}

inline int64_t up16(int64_t x) { return (x + 15) & ~int64_t(15); }

// x[j, d] (n rows at stride xs, D columns) packed transposed in panels of 64 rows: panel p holds
// x[64 p + jj, d] at bt[p 64 D + d 64 + jj], zeros from row n up to n16 = up16(n).
void pack_t(const float* x, int64_t xs, int64_t n, int64_t D, float* bt) {
  const int64_t n16 = up16(n);
  for (int64_t j0 = 0, p = 0; j0 < n16; j0 += PANEL, ++p) {
    float* pp = bt + p * PANEL * D;
    const int64_t w = std::min(PANEL, n16 - j0);
    for (int64_t jj = 0; jj < w; ++jj) {
      const int64_t j = j0 + jj;
      if (j < n) {
        for (int64_t d = 0; d < D; ++d) pp[d * PANEL + jj] = x[j * xs + d];
      } else {
        for (int64_t d = 0; d < D; ++d) pp[d * PANEL + jj] = 0.f;
      }
    }
  }
}

inline int64_t packed_floats(int64_t n, int64_t D) { return (up16(n) + PANEL) * D; }

// x[j, d] (n rows at stride xs, D columns) copied to y's rows of D floats: a product reading
// rows of keys, values or queries as its B operand then walks consecutive memory (rows of a
// head N H or K H floats apart would use a few sets of the L1 cache only).
void pack_rows(const float* x, int64_t xs, int64_t n, int64_t D, float* y) {
  for (int64_t j = 0; j < n; ++j) std::memcpy(y + j * D, x + j * xs, D * sizeof(float));
}

struct Shape {
  int64_t B, T, S, N, K, H, Hv;
  bool causal;
  float scale;
  int64_t bq;
  const int32_t *q_len, *kv_len;  // (B,)
  bool heads_major;  // keys and values (B K, S, .) instead of (B, S, K, .)
  const int32_t *q_pos = nullptr, *k_pos = nullptr;  // (B, T), (B, S): the rules' positions, or none
  int64_t lower = 0, upper = 0;  // with positions: key s seen where -upper <= q_pos - k_pos <= lower
  int64_t G() const { return N / K; }
  // Key or value j (D floats) of unit (b, kh) at kv_offset(b, kh, D) + j kv_stride(D).
  int64_t kv_stride(int64_t D) const { return heads_major ? D : K * D; }
  int64_t kv_offset(int64_t b, int64_t kh, int64_t D) const {
    return heads_major ? (b * K + kh) * S * D : b * S * K * D + kh * D;
  }
  // keys query t of batch row b may see: [0, limit(b, t)) (with positions, a superset: the
  // positions' rule is applied to each logit)
  int64_t limit(int64_t b, int64_t t) const {
    if (t >= q_len[b]) return 0;
    const int64_t keys = std::clamp<int64_t>(kv_len[b], 0, S);
    return std::max<int64_t>(0, causal && !q_pos ? std::min(keys, t + (S - T) + 1) : keys);
  }
  // With positions: -inf for the first k1 logits s (of query t of batch row b) the rules block.
  void block_by_positions(int64_t b, int64_t t, int64_t k1, float* s) const {
    const int64_t p = q_pos[b * T + t];
    const int32_t* kp = k_pos + b * S;
    for (int64_t j = 0; j < k1; ++j) {
      const int64_t d = p - kp[j];
      if (d > lower || d < -upper) s[j] = -INFINITY;
    }
  }
  // keys some query of the block [q0, q0 + qn) of batch row b may see: [0, reach(b, q0, qn)),
  // the limit of its last query that has any (limit grows with t up to q_len[b], then is 0)
  int64_t reach(int64_t b, int64_t q0, int64_t qn) const {
    const int64_t last = std::min<int64_t>(q0 + qn, q_len[b]) - 1;
    return last < q0 ? 0 : limit(b, last);
  }
  int64_t blocks() const { return (T + bq - 1) / bq; }
  // Each (batch row, key/value head) unit's G x blocks() pieces (query head, query block) are
  // dealt round-robin to parts() tasks: one a unit where the units alone give every thread two
  // tasks, more where they do not (a batch of one with few key/value heads).
  int64_t parts() const {
    const int64_t threads = omp_get_max_threads(), units = B * K;
    return std::max<int64_t>(1, std::min(G() * blocks(), (2 * threads + units - 1) / units));
  }
  // The most query rows a forward task has where the queries fit one block: its query heads' T each.
  int64_t task_rows() const { return T * ((G() + parts() - 1) / parts()); }
};

// The forward pass reads the keys and values where they lie (forward_few) for tasks of at most
// this many query rows: a decoding step's. Packing them first costs a pass over every key that
// so few rows do not repay.
constexpr int64_t FEW_ROWS = 16;

// Row `row`'s weights in place: the softmax over its first lim of kp logits, zeros after them;
// returns the log-sum-exp, -inf (and all zeros) where the row sees no key.
float softmax_row(float* row, int64_t kp, int64_t lim) {
  vf mv = vset(-INFINITY);
  for (int64_t j = 0; j < kp; j += W) mv = max_where(mv, below(j, lim), vload(row + j));
  const float m = hmax(mv);
  if (lim == 0 || m == -INFINITY) {
    std::memset(row, 0, kp * sizeof(float));
    return -INFINITY;
  }
  const vf mm = vset(m);
  vf lv = vzero();
  for (int64_t j = 0; j < kp; j += W) {
    const vf e = keep(below(j, lim), vexp(vsub(vload(row + j), mm)));
    vstore(row + j, e);
    lv = vadd(lv, e);
  }
  const float l = hsum(lv);
  const vf inv = vset(1.f / l);
  for (int64_t j = 0; j < lim; j += W) vstore(row + j, vmul(vload(row + j), inv));
  return m + std::log(l);
}

// s[r ss + j] = scale q_r . k_j for n query rows (row r at q + r H) and the first k1 keys where
// they lie (key j at k + j ks); the keys in chunks that stay in L1 while every row takes them.
void dot_logits(int64_t n, int64_t k1, int64_t H, const float* q, const float* k, int64_t ks, float scale, float* s,
                int64_t ss) {
  const int64_t chunk = std::max<int64_t>(16, 4096 / H);
  for (int64_t j0 = 0; j0 < k1; j0 += chunk) {
    const int64_t j1 = std::min(k1, j0 + chunk);
    for (int64_t r = 0; r < n; ++r) {
      const float* qr = q + r * H;
      float* sr = s + r * ss;
      int64_t j = j0;
      for (; j + 4 <= j1; j += 4) {
        const float* kj = k + j * ks;
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int64_t c = 0; c < H; c += W) {
          const vf x = vload(qr + c);
          a0 = vfma(x, vload(kj + c), a0);
          a1 = vfma(x, vload(kj + ks + c), a1);
          a2 = vfma(x, vload(kj + 2 * ks + c), a2);
          a3 = vfma(x, vload(kj + 3 * ks + c), a3);
        }
        sr[j] = scale * hsum(a0);
        sr[j + 1] = scale * hsum(a1);
        sr[j + 2] = scale * hsum(a2);
        sr[j + 3] = scale * hsum(a3);
      }
      for (; j < j1; ++j) {
        vf a = vzero();
        for (int64_t c = 0; c < H; c += W) a = vfma(vload(qr + c), vload(k + j * ks + c), a);
        sr[j] = scale * hsum(a);
      }
    }
  }
}

// The forward pass where the queries fit one block and a task has few rows (T <= bq,
// task_rows() <= FEW_ROWS), and every call with positions: a task's rows (its query heads' T
// queries each) take their logits against the keys where they lie, one row of weights each, and
// one product with the values where they lie.
void forward_few(const Shape& z, const float* q, const float* k, const float* v, float* o, float* lse) {
  const int64_t qs = z.N * z.H, ks = z.kv_stride(z.H), vs = z.kv_stride(z.Hv), os = z.N * z.Hv;
  const int64_t parts = z.parts(), tasks = z.B * z.K * parts, G = z.G(), rows = z.task_rows();
#pragma omp parallel
  {
    std::vector<float> logits(rows * up16(z.S)), qb(rows * z.H), ob(rows * z.Hv);
    std::vector<int64_t> heads(rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t part = task % parts, kh = task / parts % z.K, b = task / parts / z.K;
      const int64_t k1 = z.reach(b, 0, z.T), kp = up16(k1);
      int64_t n = 0;  // the task's rows: (query head, query) in qb
      for (int64_t g = part; g < G; g += parts)
        for (int64_t t = 0; t < z.T; ++t, ++n) {
          heads[n] = kh * G + g;
          std::memcpy(qb.data() + n * z.H, q + (b * z.T + t) * qs + heads[n] * z.H, z.H * sizeof(float));
        }
      float* s = logits.data();
      if (k1 > 0) dot_logits(n, k1, z.H, qb.data(), k + z.kv_offset(b, kh, z.H), ks, z.scale, s, kp);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = r % z.T;
        if (z.q_pos && k1 > 0) z.block_by_positions(b, t, k1, s + r * kp);
        lse[(b * z.N + heads[r]) * z.T + t] = k1 > 0 ? softmax_row(s + r * kp, kp, z.limit(b, t)) : -INFINITY;
      }
      if (k1 > 0) gemm(n, z.Hv, k1, s, kp, 1, v + z.kv_offset(b, kh, z.Hv), vs, PANEL, 1.f, false, ob.data(), z.Hv);
      else std::fill(ob.begin(), ob.end(), 0.f);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(o + (b * z.T + r % z.T) * os + heads[r] * z.Hv, ob.data() + r * z.Hv, z.Hv * sizeof(float));
    }
  }
}

void forward(const Shape& z, const float* q, const float* k, const float* v, float* o, float* lse) {
  if (z.q_pos || (z.T <= z.bq && z.task_rows() <= FEW_ROWS)) return forward_few(z, q, k, v, o, lse);
  const int64_t qs = z.N * z.H, ks = z.kv_stride(z.H), vs = z.kv_stride(z.Hv), os = z.N * z.Hv;
  const int64_t nqb = z.blocks(), parts = z.parts(), tasks = z.B * z.K * parts, G = z.G();
#pragma omp parallel
  {
    std::vector<float> logits(z.bq * up16(z.S)), kt(packed_floats(z.S, z.H)), vr(z.S * z.Hv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t part = task % parts, kh = task / parts % z.K, b = task / parts / z.K;
      const int64_t kb = z.reach(b, 0, z.T);  // keys any query of the row sees: only they are packed
      pack_t(k + z.kv_offset(b, kh, z.H), ks, kb, z.H, kt.data());
      pack_rows(v + z.kv_offset(b, kh, z.Hv), vs, kb, z.Hv, vr.data());
      for (int64_t piece = part; piece < G * nqb; piece += parts) {
        const int64_t h = kh * G + piece / nqb, i = nqb - 1 - piece % nqb;  // longest blocks first
        {
          const int64_t q0 = i * z.bq, qn = std::min(z.bq, z.T - q0);
          const int64_t k1 = z.reach(b, q0, qn), kp = up16(k1);
          float* op = o + (b * z.T + q0) * os + h * z.Hv;
          float* lp = lse + (b * z.N + h) * z.T + q0;
          if (k1 == 0) {
            for (int64_t r = 0; r < qn; ++r) {
              std::memset(op + r * os, 0, z.Hv * sizeof(float));
              lp[r] = -INFINITY;
            }
            continue;
          }
          float* s = logits.data();
          gemm(qn, kp, z.H, q + (b * z.T + q0) * qs + h * z.H, qs, 1, kt.data(), PANEL, PANEL * z.H, z.scale, false,
               s, kp);
          for (int64_t r = 0; r < qn; ++r) lp[r] = softmax_row(s + r * kp, kp, z.limit(b, q0 + r));
          gemm(qn, z.Hv, k1, s, kp, 1, vr.data(), z.Hv, PANEL, 1.f, false, op, os);
        }
      }
    }
  }
}

void backward(const Shape& z, const float* q, const float* k, const float* v, const float* o, const float* lse,
              const float* dout, const float* dlse, float* dq, float* dk, float* dv) {
  const int64_t qs = z.N * z.H, ks = z.kv_stride(z.H), vs = z.kv_stride(z.Hv), os = z.N * z.Hv;
  const int64_t nqb = z.blocks(), parts = z.parts(), tasks = z.B * z.K * parts, G = z.G();
  // With several parts a unit, each part sums its dK and dV into rows of its own (S x (H + Hv)
  // floats), added into dk and dv once every part is done; with one, straight into dk and dv.
  std::vector<float> partial(parts > 1 ? tasks * z.S * (z.H + z.Hv) : 0);
#pragma omp parallel
  {
    const int64_t Sp = up16(z.S);
    std::vector<float> sbuf(z.bq * Sp), dpbuf(z.bq * Sp), dsum(z.bq), kt(packed_floats(z.S, z.H)),
        vt(packed_floats(z.S, z.Hv)), kr(z.S * z.H), qb(z.bq * z.H), gb(z.bq * z.Hv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t part = task % parts, kh = task / parts % z.K, b = task / parts / z.K;
      const float* kp0 = k + z.kv_offset(b, kh, z.H);
      float* dkp = parts > 1 ? partial.data() + task * z.S * (z.H + z.Hv) : dk + z.kv_offset(b, kh, z.H);
      float* dvp = parts > 1 ? dkp + z.S * z.H : dv + z.kv_offset(b, kh, z.Hv);
      const int64_t dks = parts > 1 ? z.H : ks, dvs = parts > 1 ? z.Hv : vs;
      for (int64_t j = 0; j < z.S; ++j) {
        std::memset(dkp + j * dks, 0, z.H * sizeof(float));
        std::memset(dvp + j * dvs, 0, z.Hv * sizeof(float));
      }
      const int64_t kb = z.reach(b, 0, z.T);  // keys any query of the row sees: only they are packed
      pack_t(kp0, ks, kb, z.H, kt.data());
      pack_rows(kp0, ks, kb, z.H, kr.data());
      pack_t(v + z.kv_offset(b, kh, z.Hv), vs, kb, z.Hv, vt.data());
      for (int64_t piece = part; piece < G * nqb; piece += parts) {
        const int64_t h = kh * G + piece / nqb, i = nqb - 1 - piece % nqb;
        {
          const int64_t q0 = i * z.bq, qn = std::min(z.bq, z.T - q0);
          const int64_t k1 = z.reach(b, q0, qn), kp = up16(k1);
          const float* qp = q + (b * z.T + q0) * qs + h * z.H;
          const float* op = o + (b * z.T + q0) * os + h * z.Hv;
          const float* gp = dout + (b * z.T + q0) * os + h * z.Hv;
          float* dqp = dq + (b * z.T + q0) * qs + h * z.H;
          const float* lp = lse + (b * z.N + h) * z.T + q0;
          const float* dlp = dlse + (b * z.N + h) * z.T + q0;
          if (k1 == 0) {
            for (int64_t r = 0; r < qn; ++r) std::memset(dqp + r * qs, 0, z.H * sizeof(float));
            continue;
          }
          float *s = sbuf.data(), *dp = dpbuf.data();
          for (int64_t r = 0; r < qn; ++r) {  // D_r = dO_r . O_r - dlse_r
            vf d = vzero();
            for (int64_t c = 0; c < z.Hv; c += W) d = vfma(vload(op + r * os + c), vload(gp + r * os + c), d);
            dsum[r] = hsum(d) - dlp[r];
          }
          pack_rows(qp, qs, qn, z.H, qb.data());
          pack_rows(gp, os, qn, z.Hv, gb.data());
          gemm(qn, kp, z.H, qb.data(), z.H, 1, kt.data(), PANEL, PANEL * z.H, z.scale, false, s, kp);   // logits
          gemm(qn, kp, z.Hv, gb.data(), z.Hv, 1, vt.data(), PANEL, PANEL * z.Hv, 1.f, false, dp, kp);  // dP = dO V^T
          for (int64_t r = 0; r < qn; ++r) {  // P, and dS = P (dP - D) in dP's place
            float *row = s + r * kp, *drow = dp + r * kp;
            const int64_t lim = z.limit(b, q0 + r);
            if (lim == 0 || lp[r] == -INFINITY) {
              std::memset(row, 0, kp * sizeof(float));
              std::memset(drow, 0, kp * sizeof(float));
              continue;
            }
            const vf mm = vset(lp[r]), dd = vset(dsum[r]);
            for (int64_t j = 0; j < kp; j += W) {
              const vf p = keep(below(j, lim), vexp(vsub(vload(row + j), mm)));
              vstore(row + j, p);
              vstore(drow + j, vmul(p, vsub(vload(drow + j), dd)));
            }
          }
          gemm(k1, z.Hv, qn, s, 1, kp, gb.data(), z.Hv, PANEL, 1.f, true, dvp, dvs);         // dV += P^T dO
          gemm(qn, z.H, k1, dp, kp, 1, kr.data(), z.H, PANEL, z.scale, false, dqp, qs);      // dQ = scale dS K
          gemm(k1, z.H, qn, dp, 1, kp, qb.data(), z.H, PANEL, z.scale, true, dkp, dks);      // dK += scale dS^T Q
        }
      }
    }
    if (parts > 1) {
#pragma omp for schedule(static)
      for (int64_t unit = 0; unit < z.B * z.K; ++unit) {
        const int64_t kh = unit % z.K, b = unit / z.K;
        for (int64_t j = 0; j < z.S; ++j) {
          float* dkr = dk + z.kv_offset(b, kh, z.H) + j * ks;
          float* dvr = dv + z.kv_offset(b, kh, z.Hv) + j * vs;
          std::memset(dkr, 0, z.H * sizeof(float));
          std::memset(dvr, 0, z.Hv * sizeof(float));
          for (int64_t part = 0; part < parts; ++part) {
            const float* src = partial.data() + (unit * parts + part) * z.S * (z.H + z.Hv);
            for (int64_t c = 0; c < z.H; ++c) dkr[c] += src[j * z.H + c];
            for (int64_t c = 0; c < z.Hv; ++c) dvr[c] += src[z.S * z.H + j * z.Hv + c];
          }
        }
      }
    }
  }
}

ffi::Error shape_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                    ffi::Buffer<ffi::S32>& q_len, ffi::Buffer<ffi::S32>& kv_len, int64_t causal, float scale,
                    int64_t block_q, int64_t heads_major, Shape* z) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t kv_rank = heads_major ? 3 : 4;  // heads_major: (B K, S, .), as a KV cache stores them
  if (qd.size() != 4 || kd.size() != kv_rank || vd.size() != kv_rank)
    return ffi::Error::InvalidArgument("query must be 4-dimensional, key and value 4 (3 with heads_major)");
  const int64_t B = qd[0], S = kd[1], K = heads_major ? (B > 0 ? kd[0] / B : 0) : kd[2];
  *z = Shape{B, qd[1], S, qd[2], K, qd[3], vd[kv_rank - 1], causal != 0, scale, block_q, q_len.typed_data(),
             kv_len.typed_data(), heads_major != 0};
  const bool kv_lead = heads_major ? kd[0] == B * K && vd[0] == B * K : kd[0] == B && vd[0] == B && vd[2] == K;
  if (!kv_lead || vd[1] != S || kd[kv_rank - 1] != z->H || K == 0 || z->N % K != 0 || z->H % 16 != 0 ||
      z->Hv % 16 != 0 || block_q <= 0 || q_len.element_count() != size_t(B) || kv_len.element_count() != size_t(B))
    return ffi::Error::InvalidArgument("shapes outside the kernel's contract");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> q_pos,
                   ffi::Buffer<ffi::S32> k_pos, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                   int64_t causal, float scale, int64_t block_q, int64_t heads_major, int64_t positions,
                   int64_t lower, int64_t upper) {
  Shape z;
  ffi::Error e = shape_of(q, k, v, q_len, kv_len, causal, scale, block_q, heads_major, &z);
  if (e.failure()) return e;
  if (positions) {
    if (q_pos.element_count() != size_t(z.B * z.T) || k_pos.element_count() != size_t(z.B * z.S) || lower < 0 ||
        upper < 0)
      return ffi::Error::InvalidArgument("positions outside the kernel's contract");
    z.q_pos = q_pos.typed_data();
    z.k_pos = k_pos.typed_data();
    z.lower = lower;
    z.upper = upper;
  }
  forward(z, q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(), lse->typed_data());
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::F32> out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> dlse,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                    int64_t causal, float scale, int64_t block_q, int64_t heads_major) {
  Shape z;
  ffi::Error e = shape_of(q, k, v, q_len, kv_len, causal, scale, block_q, heads_major, &z);
  if (e.failure()) return e;
  backward(z, q.typed_data(), k.typed_data(), v.typed_data(), out.typed_data(), lse.typed_data(), dout.typed_data(),
           dlse.typed_data(), dq->typed_data(), dk->typed_data(), dv->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxAttnCpuForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("heads_major")
                                  .Attr<int64_t>("positions")
                                  .Attr<int64_t>("lower")
                                  .Attr<int64_t>("upper"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxAttnCpuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("heads_major"));
