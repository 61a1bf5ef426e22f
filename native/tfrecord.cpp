#include "tfrecord.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <unistd.h>

#include "crc32c.hpp"
#include "engine.hpp"

namespace tf {
namespace {

constexpr uint64_t kHeader = 12, kFooter = 4;
// Headers are read through a window of the file: small records come many to a read.
// After a record longer than the window, the next header lies beyond it anyway: one
// page is read for it, not a window of data (2048 records of 1 MiB: 137 MiB read,
// 0.20-0.27 s cold, to find their headers).
constexpr uint64_t kWindow = 64 << 10, kPage = 4096;

// What a file whose first header fails its CRC may be instead: TFRecordWriter's GZIP
// and ZLIB options write a compressed stream, which these ops do not read.
std::string compression_hint(const unsigned char *start, uint64_t offset) {
  if (offset != 0) return "";
  const char *kind = nullptr;
  if (start[0] == 0x1f && start[1] == 0x8b) kind = "GZIP";
  else if ((start[0] & 0x0f) == 8 && (start[0] * 256 + start[1]) % 31 == 0) kind = "ZLIB";
  if (kind == nullptr) return "";
  return std::string(" (it starts as a ") + kind +
         " stream: these ops read uncompressed TFRecord files; tf.data.TFRecordDataset(files, "
         "compression_type='" + kind + "') reads compressed ones)";
}

// Why the record whose header (kHeader bytes) is at `offset` of a file of `size` bytes
// cannot be read; empty if it can.
std::string header_damage(const std::string &path, const unsigned char *header, uint64_t offset, uint64_t size) {
  uint64_t length;
  uint32_t length_crc;
  std::memcpy(&length, header, 8);
  std::memcpy(&length_crc, header + 8, 4);
  if (masked_crc32c(header, 8) != length_crc)
    return path + ": bad length CRC at offset " + std::to_string(offset) + ": not a TFRecord file, or corrupt" +
           compression_hint(header, offset);
  if (length > size || offset + kHeader + length + kFooter > size)
    return path + ": truncated record at offset " + std::to_string(offset) + ": its " + std::to_string(length) +
           " bytes run past the end of the file (" + std::to_string(size) + " bytes)";
  return "";
}

}  // namespace

TfrecordRanges scan_tfrecord(const std::string &path) {
  const File file(path, "r", /*want_direct=*/false);  // headers are small: the page cache serves them
  const uint64_t size = file.size();
  std::vector<unsigned char> window(kWindow);
  uint64_t window_start = 0, window_len = 0, next_window = kWindow;
  TfrecordRanges ranges;
  for (uint64_t offset = 0; offset + kHeader <= size;) {  // a partial header at the end is no record
    if (offset < window_start || offset + kHeader > window_start + window_len) {
      window_start = offset;
      window_len = 0;
      const uint64_t want = std::min<uint64_t>(next_window, size - offset);
      while (window_len < want) {
        const ssize_t n = pread(file.buffered_fd(), window.data() + window_len, want - window_len,
                                static_cast<off_t>(offset + window_len));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw IOError{errno, path, "pread", offset + window_len, want - window_len};
        if (n == 0) throw IOError{ENODATA, path, "read past end of file", offset + window_len, want - window_len};
        window_len += static_cast<uint64_t>(n);
      }
    }
    const unsigned char *header = window.data() + (offset - window_start);
    ranges.damage = header_damage(path, header, offset, size);
    if (!ranges.damage.empty()) {
      ranges.damage_offset = offset;
      break;
    }
    uint64_t length;
    std::memcpy(&length, header, 8);
    ranges.offsets.push_back(offset + kHeader);
    ranges.lengths.push_back(length + kFooter);
    offset += kHeader + length + kFooter;
    next_window = length >= kWindow ? kPage : kWindow;
  }
  return ranges;
}

std::string tfrecord_damage(const std::string &path, uint64_t offset) {
  const File file(path, "r", /*want_direct=*/false);
  const uint64_t size = file.size();
  unsigned char header[kHeader];
  ssize_t n;
  do n = pread(file.buffered_fd(), header, kHeader, static_cast<off_t>(offset));
  while (n < 0 && errno == EINTR);
  if (n < 0) throw IOError{errno, path, "pread", offset, kHeader};
  std::string damage = static_cast<uint64_t>(n) == kHeader ? header_damage(path, header, offset, size) : "";
  if (damage.empty())  // the file changed since it was scanned
    damage = path + ": the record at offset " + std::to_string(offset) +
             " was cut short or had a bad length CRC when the dataset was made";
  return damage;
}

}  // namespace tf
