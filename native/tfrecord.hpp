// TFRecord framing: where each record's data lies, checked before any is read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tf {

struct TfrecordRanges {
  std::vector<uint64_t> offsets;  // of each record's data
  std::vector<uint64_t> lengths;  // of its data and the 4-byte CRC after it
  // Why the records end early, naming the file and damage_offset: a record cut short (its
  // writer stopped mid-record) or a length whose CRC is wrong. Empty where none is damaged.
  std::string damage;
  uint64_t damage_offset = 0;
};

// Reads the headers of a TFRecord file (u64 length, masked CRC-32C of the length) and
// returns the ranges of its records up to the first damaged one, as TFRecordDataset reads
// them (it raises DataLossError there). A partial header at the end ends the file, as it
// does for TFRecordDataset. Throws IOError when the file cannot be read.
TfrecordRanges scan_tfrecord(const std::string &path);

// Why the record whose header is at `offset` cannot be read, worded as scan_tfrecord words
// it (for the ops, which fail with it where the scan found damage). Throws IOError.
std::string tfrecord_damage(const std::string &path, uint64_t offset);

}  // namespace tf
