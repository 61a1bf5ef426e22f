// CRC-32C (Castagnoli), as TFRecord framing uses it: with SSE 4.2 where the CPU has
// it, else a table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tf {

uint32_t crc32c(const void *data, size_t size);

// TFRecord's masked form: rotated right by 15 bits plus a constant.
inline uint32_t masked_crc32c(const void *data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

}  // namespace tf
