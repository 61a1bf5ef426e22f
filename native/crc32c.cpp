#include "crc32c.hpp"

#include <array>
#include <cstring>

namespace tf {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // reflected Castagnoli

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPolynomial & (0u - (c & 1)));
    table[i] = c;
  }
  return table;
}

uint32_t crc32c_table(uint32_t crc, const unsigned char *p, size_t n) {
  static const std::array<uint32_t, 256> table = make_table();
  while (n--) crc = table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char *p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n; --n) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

}  // namespace

uint32_t crc32c(const void *data, size_t size) {
  const auto *p = static_cast<const unsigned char *>(data);
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) return ~crc32c_sse42(~0u, p, size);
#endif
  return ~crc32c_table(~0u, p, size);
}

}  // namespace tf
