#include "crc32c.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace tf {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // reflected Castagnoli

using ByteTable = std::array<uint32_t, 256>;

ByteTable make_table() {
  ByteTable table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPolynomial & (0u - (c & 1)));
    table[i] = c;
  }
  return table;
}

const ByteTable &byte_table() {
  static const ByteTable table = make_table();
  return table;
}

// The CRC register (no pre- or post-inversion) after n more bytes.
uint32_t crc32c_table(uint32_t crc, const unsigned char *p, size_t n) {
  const ByteTable &table = byte_table();
  while (n--) crc = table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// Appending n zero bytes to a message maps its CRC register linearly; as four byte
// tables, that map combines CRCs computed apart: crc(A B) = shift_|B|(crc(A)) ^ crc0(B).
struct ZerosOperator {
  std::array<ByteTable, 4> tables;
  explicit ZerosOperator(size_t n) {
    std::array<uint32_t, 32> basis;
    const std::array<unsigned char, 1> zero{0};
    for (int b = 0; b < 32; ++b) {
      uint32_t crc = 1u << b;
      for (size_t i = 0; i < n; ++i) crc = crc32c_table(crc, zero.data(), 1);
      basis[b] = crc;
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t v = i << (8 * k), r = 0;
        for (int b = 0; v; ++b, v >>= 1)
          if (v & 1) r ^= basis[b];
        tables[k][i] = r;
      }
    }
  }
  uint32_t operator()(uint32_t crc) const {
    return tables[0][crc & 0xFF] ^ tables[1][(crc >> 8) & 0xFF] ^ tables[2][(crc >> 16) & 0xFF] ^
           tables[3][crc >> 24];
  }
};

constexpr size_t kLong = 8192, kShort = 256;

__attribute__((target("sse4.2"))) uint64_t step(uint64_t crc, const unsigned char *p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return __builtin_ia32_crc32di(crc, word);
}

// Three streams at once: the crc32 instruction takes 3 cycles but can start every cycle.
template <size_t kBlock>
__attribute__((target("sse4.2"))) uint32_t three_way(uint32_t crc, const unsigned char *&p, size_t &n,
                                                     const ZerosOperator &shift) {
  while (n >= 3 * kBlock) {
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      c0 = step(c0, p + i);
      c1 = step(c1, p + kBlock + i);
      c2 = step(c2, p + 2 * kBlock + i);
    }
    crc = shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    crc = shift(crc) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char *p, size_t n) {
  static const ZerosOperator shift_long(kLong), shift_short(kShort);
  crc = three_way<kLong>(crc, p, n, shift_long);
  crc = three_way<kShort>(crc, p, n, shift_short);
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) c = step(c, p);
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n; --n) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

// The CRC register after n more bytes, by the fastest means this CPU has.
uint32_t extend(uint32_t crc, const unsigned char *p, size_t n) {
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) return crc32c_sse42(crc, p, n);
#endif
  return crc32c_table(crc, p, n);
}

}  // namespace

uint32_t crc32c(const void *data, size_t size) {
  return ~extend(~0u, static_cast<const unsigned char *>(data), size);
}

uint32_t crc32c_copy(void *dest, const void *source, size_t size) {
  constexpr size_t kChunk = 64 << 10;  // copied, then summed from L2
  auto *to = static_cast<unsigned char *>(dest);
  const auto *from = static_cast<const unsigned char *>(source);
  uint32_t crc = ~0u;
  for (size_t done = 0, n; done < size; done += n) {
    n = std::min(kChunk, size - done);
    std::memcpy(to + done, from + done, n);
    crc = extend(crc, to + done, n);
  }
  return ~crc;
}

}  // namespace tf
