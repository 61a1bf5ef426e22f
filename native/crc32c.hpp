// CRC-32C (Castagnoli), as TFRecord framing uses it: with SSE 4.2 where the CPU has
// it, else a table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tf {

uint32_t crc32c(const void *data, size_t size);

// Copies `size` bytes from `source` to `dest` and returns their CRC-32C, computed from
// each chunk just copied while it is still in the cache: one pass over memory, not two.
uint32_t crc32c_copy(void *dest, const void *source, size_t size);

// TFRecord's masked form: rotated right by 15 bits plus a constant.
inline uint32_t mask_crc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

inline uint32_t masked_crc32c(const void *data, size_t size) { return mask_crc32c(crc32c(data, size)); }

}  // namespace tf
