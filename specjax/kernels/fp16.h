// IEEE binary16 -> binary32, exact, in portable C++ (no F16C): the scalar paths' reading of the
// fp16 scales GGUF blocks store. Every fp16 value, subnormals, infinities and NaNs included, has
// an fp32 of the same value, so this and the vector paths' vcvtph2ps give the same bits.

#pragma once

#include <cstdint>
#include <cstring>

namespace sj_fp16 {

// The little-endian fp16 at p, widened.
inline float to_float(const uint8_t* p) {
  const uint32_t h = p[0] | (uint32_t(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t mm = man;
    do {
      ++e;
      mm <<= 1;
    } while ((mm & 0x400u) == 0);
    bits = sign | (uint32_t(112 - e) << 23) | ((mm & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace sj_fp16
