// Fused CPU kernels over packed b-bit codes (b in {1, 2, 4, 8}; layout of wushkv.quantizers.pack:
// code t of byte m sits at bits [t*b, (t+1)*b), low bits first). They read the packed bytes once and
// never expand them into a float copy: each token's codes are unpacked into registers/L1 through a
// byte table (8/b codes per load) and used at once by vectorized dot products / accumulations.
//
//   code_dot(codes (B,H,N,nb) uint8, q (B,H,G,d) f32, bits)           -> (B,H,G,N): Σ_i c_ji q_gi
//   code_weighted_sum(codes (B,H,N,nb) uint8, w (B,H,G,N) f32, bits, d) -> (B,H,G,d): Σ_j w_gj c_j
//   feedback_round(x (B,H,N,d) f32, scale/offset (B,H,N,g) f32, F (H,d,d) f32, bits) -> (B,H,N,d) uint8:
//       codes on each group's grid, rounded coordinate by coordinate with error feedback
//       (wushkv.quantizers.feedback; the PyTorch loop there is the reference)
//
// The codes tensor may be a strided view (the cache's growable buffer); the last dim must be dense.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

static constexpr int64_t CHUNK = 1024;  // tokens per parallel work item

// tab[v*per + t] = code t of byte v, as float
static std::vector<float> byte_table(int64_t bits) {
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

static void check(const torch::Tensor& codes, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 4 && codes.stride(3) == 1, "codes: uint8 (B,H,N,nb), dense last dim");
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "bits must be 1, 2, 4 or 8");
}

torch::Tensor code_dot(torch::Tensor codes, torch::Tensor q, int64_t bits) {
  check(codes, bits);
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.dim() == 4, "q: float32 (B,H,G,d)");
  q = q.contiguous();
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), nb = codes.size(3);
  const int64_t G = q.size(2), d = q.size(3), per = 8 / bits;
  TORCH_CHECK(q.size(0) == B && q.size(1) == H && nb * per >= d, "shapes of codes and q do not match");
  auto out = torch::empty({B, H, G, N}, q.options());
  const int64_t nchunks = (N + CHUNK - 1) / CHUNK;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = codes.stride(0), sh = codes.stride(1), sn = codes.stride(2);
  const std::vector<float> tab = byte_table(bits);
  at::parallel_for(0, B * H * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cf(nb * per), qz(G * nb * per, 0.f);  // queries zero-padded to nb*per
    const int64_t D = nb * per;
    int64_t loaded = -1;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nchunks, c = it % nchunks, b = bh / H, h = bh % H;
      if (loaded != bh) {
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < d; ++i) qz[g * D + i] = qp[(bh * G + g) * d + i];
        loaded = bh;
      }
      const uint8_t* base = cp + b * sb + h * sh;
      float* ob = op + bh * G * N;
      const int64_t j1 = std::min(N, (c + 1) * CHUNK);
      for (int64_t j = c * CHUNK; j < j1; ++j) {
        unpack_any(base + j * sn, nb, per, tab.data(), cf.data());
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qz.data() + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < D; ++i) acc += cf[i] * qg[i];
          ob[g * N + j] = acc;
        }
      }
    }
  });
  return out;
}

torch::Tensor code_weighted_sum(torch::Tensor codes, torch::Tensor w, int64_t bits, int64_t d) {
  check(codes, bits);
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 4, "w: float32 (B,H,G,N)");
  w = w.contiguous();
  const int64_t B = codes.size(0), H = codes.size(1), N = codes.size(2), nb = codes.size(3);
  const int64_t G = w.size(2), per = 8 / bits, D = nb * per;
  TORCH_CHECK(w.size(0) == B && w.size(1) == H && w.size(3) == N && D >= d, "shapes of codes and w do not match");
  const int64_t nchunks = (N + CHUNK - 1) / CHUNK;
  auto partial = torch::zeros({B * H, nchunks, G, D}, w.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* wp = w.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  const int64_t sb = codes.stride(0), sh = codes.stride(1), sn = codes.stride(2);
  const std::vector<float> tab = byte_table(bits);
  at::parallel_for(0, B * H * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cf(D);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t bh = it / nchunks, c = it % nchunks, b = bh / H, h = bh % H;
      const uint8_t* base = cp + b * sb + h * sh;
      const float* wb = wp + bh * G * N;
      float* acc = pp + (bh * nchunks + c) * G * D;
      const int64_t j1 = std::min(N, (c + 1) * CHUNK);
      for (int64_t j = c * CHUNK; j < j1; ++j) {
        unpack_any(base + j * sn, nb, per, tab.data(), cf.data());
        for (int64_t g = 0; g < G; ++g) {
          const float wj = wb[g * N + j];
          float* ag = acc + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) ag[i] += wj * cf[i];
        }
      }
    }
  });
  return partial.sum(1).narrow(-1, 0, d).reshape({B, H, G, d});
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
      const float* Fh = fp + h * d * d;
      for (int64_t k = 0; k < d; ++k) w[k] = xp[r * d + k];
      for (int64_t j = 0; j < d; ++j) {
        const float s = sp[r * ng + j / gs], o = op[r * ng + j / gs];
        float c = std::floor((w[j] - o) / s + 0.5f);
        c = c < 0.f ? 0.f : (c > qmax ? qmax : c);
        cp[r * d + j] = static_cast<uint8_t>(c);
        const float e = w[j] - (c * s + o);
        const float* row = Fh + j * d;
        for (int64_t k = j + 1; k < d; ++k) w[k] -= e * row[k];
      }
    }
  });
  return codes;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("feedback_round", &feedback_round, "codes rounded with error feedback");
  m.def("code_dot", &code_dot, "Σ_i c_ji q_gi over packed codes");
  m.def("code_weighted_sum", &code_weighted_sum, "Σ_j w_gj c_j over packed codes");
}
