// TFRecord framing: where each record's data lies, checked before any is read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tf {

struct TfrecordRanges {
  std::vector<uint64_t> offsets;  // of each record's data
  std::vector<uint64_t> lengths;  // of its data and the 4-byte CRC after it
};

// Reads the headers of a TFRecord file (u64 length, masked CRC-32C of the length) and
// returns its records' ranges. Throws IOError when the file cannot be read and
// std::invalid_argument, naming the file and offset, for a truncated header, a bad
// length CRC or a record that runs past the end.
TfrecordRanges scan_tfrecord(const std::string &path);

}  // namespace tf
