// Intel AMX tiles, shared by the bf16 GEMM (cpu_gemm_amx.cpp) and the bf16 prefill attention
// (cpu_prefill_amx.h). Built where the compiler targets AMX (-mamx-tile -mamx-bf16, which pagedq_kernels/cpu.py
// passes only on a CPU with amx_tile and amx_bf16); used where Linux grants the tiles' register state
// (once per process) and PAGEDQ_CPU_AMX is not 0 (an A/B switch).
#pragma once

#include "cpu_avx512.h"

#if defined(PAGEDQ_GEMM_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDQ_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace pagedq_amx {

// Every kernel here uses the same shapes: tiles 0-7 of 16 rows of 64 bytes (16 fp32 sums, 32 bf16 values, or
// 16 pairs of bf16).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return config;
}

// Loaded at the start of every task: another library's tiles may have run on this thread since.
inline void load_tile_config() { _tile_loadconfig(&tile_config()); }

inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    const char* env = std::getenv("PAGEDQ_CPU_AMX");
    if (env && std::strcmp(env, "0") == 0) return false;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

}  // namespace pagedq_amx
#endif
