// AMX tile registers, as both AMX kernels take them (packed_gemv.cpp's bf16 tiles, kquant_amx.h's
// int8 tiles): the configuration ldtilecfg loads, loading and releasing it, and Linux's
// permission to use the tile data (asked once per process). The instructions go through inline
// assembly, so no function here needs an AMX target attribute.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// ldtilecfg's 64-byte operand, palette 1: each tile register's rows and bytes per row
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and the stores filling
// cfg were dropped (a #GP on ldtilecfg)
inline void load_config(const TileConfig& cfg) {
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

inline void release() { asm volatile("tilerelease" : : : "memory"); }

// whether Linux lets this process use the tile registers (arch_prctl's XTILEDATA request)
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // arch_prctl, asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

}  // namespace amx
