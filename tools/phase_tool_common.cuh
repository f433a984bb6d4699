// phase_tool_common.cuh -- the host helpers of the phase-timing tools (tools/lowp_phase_times.cu,
// tools/small_m_phase_times.cu): CHECK (exit status 2 on a CUDA error), seeded uniform inputs,
// uploads, a median and an FNV-1a hash of results (equal hashes of two builds: bit-identical).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    cudaError_t err_ = (call);                                                                       \
    if (err_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)

// v uniform in [lo, hi) from a linear congruential sequence of `seed`, each value converted to T
// from float (float, or __half rounded to nearest).
template <class T>
static void fill_uniform(std::vector<T>& v, uint32_t seed, float lo, float hi) {
  uint32_t s = seed * 2654435761u + 12345u;
  for (auto& e : v) {
    s = s * 1664525u + 1013904223u;
    e = T(lo + (hi - lo) * static_cast<float>(s >> 8) / 16777216.f);
  }
}

template <class T>
static T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

static double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static uint64_t fnv1a(const void* p, size_t bytes, uint64_t h = 14695981039346656037ull) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}
