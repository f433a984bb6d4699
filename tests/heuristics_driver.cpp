// heuristics_driver.cpp -- prints the launch decisions of kernels/heuristics_*.cuh
// for the named cases that tests/test_heuristics.py asserts, one line a case:
// `name key=value ...`.  Built with a plain C++ compiler (g++ -I kernels): the
// headers hold no CUDA runtime calls.  The SM counts are the devices' (H100 /
// H200: 132); the k-blocks are the kernels' BLOCK_K (sm_90a GEMMs: 64).
#include <cstdio>

#include "heuristics_common.cuh"
#include "heuristics_sm80.cuh"
#include "heuristics_sm90.cuh"

namespace fgb = fused_gemm_bn;

namespace {

constexpr int kH100Sms = 132;  // H100 SXM and H200
constexpr int kSm90BlockK = 64;

void stream_k(const char* name, int M, int N, int K, int num_sms) {
  const fgb::sm90::StreamKPlan p = fgb::sm90::stream_k_plan(M, N, K, kSm90BlockK, num_sms);
  std::printf("%s sk_tiles=%d pieces=%d piece_blocks=%d tails_per_cta=%d sk_ctas=%d dp_tiles=%d\n", name, p.sk_tiles,
              p.pieces, p.piece_blocks, p.tails_per_cta, p.sk_ctas, p.dp_tiles);
}

void persistent(const char* name, int K) {
  std::printf("%s persistent=%d\n", name, fgb::sm90::persistent_grid_pays(K, kSm90BlockK) ? 1 : 0);
}

void lowp_grid(const char* name, int M, int N, int K, int num_sms) {
  const fgb::sm90::LowpGridPlan g = fgb::sm90::lowp_grid_plan(M, N, K, kSm90BlockK, num_sms);
  std::printf("%s block_m=%d sk_tiles=%d pieces=%d dp_tiles=%d\n", name, g.block_m, g.plan.sk_tiles, g.plan.pieces,
              g.plan.dp_tiles);
}

void sm80(const char* name, int M, int N, int K, int num_sms) {
  const fgb::Sm80TileDims d = fgb::sm80_tile_dims(M);
  const fgb::Sm80SplitPlan p = fgb::sm80_split_plan(M, N, K, num_sms);
  std::printf("%s block_m=%d block_n=%d pieces=%d piece_k=%d\n", name, d.block_m, d.block_n, p.pieces,
              p.k_tiles_per_piece * fgb::kSm80BlockK);
}

void resident(const char* name, int M, int N) {
  std::printf("%s resident=%d\n", name, fgb::resident_strip_pays(M, N) ? 1 : 0);
}

}  // namespace

int main() {
  // Names give the product's M (batch rows), N (features) and K (the reduced length).
  // sm90: the split of the output tiles.
  stream_k("sk_kernelbench_M1024_N8192_K8192", 1024, 8192, 8192, kH100Sms);
  stream_k("sk_whole_waves_M1024_N8448_K8192", 1024, 8448, 8192, kH100Sms);
  stream_k("sk_split_k_M128_N8192_K8192", 128, 8192, 8192, kH100Sms);
  stream_k("sk_split_k_M128_N8192_K448", 128, 8192, 448, kH100Sms);
  stream_k("sk_split_k_M128_N8192_K512", 128, 8192, 512, kH100Sms);
  stream_k("sk_no_sms_M1024_N8192_K8192", 1024, 8192, 8192, 0);
  // sm90: persistent grid, by K (the product's k).
  persistent("persist_kernelbench_forward_K8192", 8192);
  persistent("persist_grad_w_batch256_K256", 256);
  persistent("persist_grad_w_batch1024_K1024", 1024);
  persistent("persist_short_k_forward_K512", 512);
  persistent("persist_K2048", 2048);
  persistent("persist_K2049", 2049);
  persistent("persist_K4096", 4096);
  // lowp_sm90: batch tile.
  lowp_grid("lowp_M512_N8192_K8192", 512, 8192, 8192, kH100Sms);
  lowp_grid("lowp_M256_N8192_K8192", 256, 8192, 8192, kH100Sms);
  lowp_grid("lowp_M256_N8192_K8192_128sms", 256, 8192, 8192, 128);
  lowp_grid("lowp_M256_N8192_K8192_129sms", 256, 8192, 8192, 129);
  // sm80: tile and split K (108 SMs: A100; 132: H100 / H200).
  sm80("sm80_M15_N8192_K8192", 15, 8192, 8192, kH100Sms);
  sm80("sm80_M16_N8192_K8192", 16, 8192, 8192, kH100Sms);
  sm80("sm80_M64_N8192_K8192", 64, 8192, 8192, kH100Sms);
  sm80("sm80_M65_N8192_K8192", 65, 8192, 8192, kH100Sms);
  sm80("sm80_M128_N1024_K8192", 128, 1024, 8192, kH100Sms);
  sm80("sm80_M1024_N8192_K8192", 1024, 8192, 8192, kH100Sms);
  sm80("sm80_max_pieces_M16_N128_K65536", 16, 128, 65536, kH100Sms);
  sm80("sm80_M128_N1024_K32", 128, 1024, 32, kH100Sms);
  // bn_backward: resident strip (M rows, N features).
  resident("res_M1024_N8192", 1024, 8192);
  resident("res_M768_N8192", 768, 8192);
  resident("res_M767_N8192", 767, 8192);
  resident("res_M640_N8192", 640, 8192);
  resident("res_M128_N8192", 128, 8192);
  resident("res_M1024_N130", 1024, 130);
  resident("res_M256_N2048", 256, 2048);
  resident("res_M255_N2048", 255, 2048);
  resident("res_M256_N2049", 256, 2049);
  resident("res_M1025_N130", 1025, 130);
  resident("res_M1024_N2097152", 1024, 2097152);
  return 0;
}
