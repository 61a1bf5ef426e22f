// TensorFlow ops that read byte ranges of files through the core's engine, so that a
// tf.data pipeline reads without Python: TensorferryReadStrings (whole files or
// TFRecord records, tf.string) and TensorferryReadRecords (fixed-length records,
// uint8[n, record_bytes]). Loaded with tf.load_op_library.
//
// Built against TensorFlow's stable C API (kernels.h, ops.h), declared below rather
// than included: the build must not need TensorFlow installed, and these functions
// and the tstring layout are the ABI that TensorFlow keeps for plugins and custom
// ops. The symbols resolve at load time against libtensorflow_framework.so.2.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>

#include "crc32c.hpp"
#include "engine.hpp"

extern "C" {
struct TF_Status;
struct TF_Tensor;
struct TF_KernelBuilder;
struct TF_OpKernelConstruction;
struct TF_OpKernelContext;
struct TF_OpDefinitionBuilder;
struct TF_ShapeInferenceContext;
typedef int TF_DataType;
typedef int TF_Code;
typedef unsigned char TF_Bool;

TF_Status *TF_NewStatus(void);
void TF_DeleteStatus(TF_Status *);
void TF_SetStatus(TF_Status *s, TF_Code code, const char *msg);
TF_Code TF_GetCode(const TF_Status *s);

void *TF_TensorData(const TF_Tensor *);
int64_t TF_TensorElementCount(const TF_Tensor *tensor);
int TF_NumDims(const TF_Tensor *);
int64_t TF_Dim(const TF_Tensor *tensor, int dim_index);
void TF_DeleteTensor(TF_Tensor *);

TF_KernelBuilder *TF_NewKernelBuilder(const char *op_name, const char *device_name,
                                      void *(*create_func)(TF_OpKernelConstruction *),
                                      void (*compute_func)(void *, TF_OpKernelContext *),
                                      void (*delete_func)(void *));
void TF_RegisterKernelBuilder(const char *kernel_name, TF_KernelBuilder *builder, TF_Status *status);
void TF_GetInput(TF_OpKernelContext *ctx, int i, TF_Tensor **tensor, TF_Status *status);
TF_Tensor *TF_AllocateOutput(TF_OpKernelContext *context, int index, TF_DataType dtype, const int64_t *dims,
                             int num_dims, size_t len, TF_Status *status);
void TF_OpKernelContext_Failure(TF_OpKernelContext *ctx, TF_Status *status);
void TF_OpKernelConstruction_Failure(TF_OpKernelConstruction *ctx, TF_Status *status);
void TF_OpKernelConstruction_GetAttrInt64(TF_OpKernelConstruction *ctx, const char *attr_name, int64_t *val,
                                          TF_Status *status);
void TF_OpKernelConstruction_GetAttrBool(TF_OpKernelConstruction *ctx, const char *attr_name, TF_Bool *val,
                                         TF_Status *status);
void TF_OpKernelConstruction_GetAttrString(TF_OpKernelConstruction *ctx, const char *attr_name, char *val,
                                           size_t max_length, TF_Status *status);

TF_OpDefinitionBuilder *TF_NewOpDefinitionBuilder(const char *op_name);
void TF_OpDefinitionBuilderAddInput(TF_OpDefinitionBuilder *builder, const char *input_spec);
void TF_OpDefinitionBuilderAddOutput(TF_OpDefinitionBuilder *builder, const char *output_spec);
void TF_OpDefinitionBuilderAddAttr(TF_OpDefinitionBuilder *builder, const char *attr_spec);
void TF_OpDefinitionBuilderSetShapeInferenceFunction(TF_OpDefinitionBuilder *builder,
                                                     void (*fn)(TF_ShapeInferenceContext *, TF_Status *));
void TF_RegisterOpDefinition(TF_OpDefinitionBuilder *builder, TF_Status *status);
void TF_ShapeInferenceContextSetUnknownShape(TF_ShapeInferenceContext *ctx, TF_Status *status);
}

namespace {

constexpr TF_DataType kUint8 = 4, kString = 7;
constexpr TF_Code kInvalidArgument = 3, kNotFound = 5, kPermissionDenied = 7, kResourceExhausted = 8,
                  kInternal = 13, kDataLoss = 15, kUnknown = 2;
constexpr uint64_t kTfrecordFooter = 4;  // masked crc32c of the record's data

// tensorflow::tstring's C layout (tsl/platform/ctstring_internal.h), little-endian:
// 24 bytes; the low two bits of the first byte give the representation.
union TString {
  struct { size_t size; size_t cap; char *ptr; } large;               // type 1
  struct { uint8_t size; char str[23]; } small;                        // type 0
  struct { uint32_t size; uint32_t offset; uint32_t count; } offset;   // type 2
  struct { size_t size; const char *ptr; void *owner; } view;          // type 3
};
static_assert(sizeof(TString) == 24, "tstring is 24 bytes");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the tstring layout above is the little-endian one");

std::string_view tstring_view(const TString &s) {
  switch (s.small.size & 3) {
    case 0: return {s.small.str, static_cast<size_t>(s.small.size >> 2)};
    case 1: return {s.large.ptr, s.large.size >> 2};
    case 2: return {reinterpret_cast<const char *>(&s) + s.offset.offset, s.offset.size >> 2};
    default: return {s.view.ptr, s.view.size >> 2};
  }
}

// Gives `s` (freshly constructed: empty and small) `size` bytes of uninitialised
// memory that TensorFlow frees with free(): aligned for O_DIRECT so the engine reads
// straight into it, and in huge pages when large (the virtio disk here splits a 1 MiB
// transfer through 4 KiB pages into two requests). set_size() may shrink it later.
char *tstring_allocate(TString &s, size_t size) {
  const size_t huge = 2u << 20;
  const size_t align = size >= (4u << 20) ? huge : 4096;
  void *p = nullptr;
  if (posix_memalign(&p, align, size + 1) != 0) return nullptr;
  if (align == huge) madvise(p, size + 1, MADV_HUGEPAGE);
  s.large.ptr = static_cast<char *>(p);
  s.large.cap = size;
  s.large.size = (size << 2) | 1;
  s.large.ptr[size] = '\0';
  return s.large.ptr;
}

void set_size(TString &s, size_t size) {
  s.large.size = (size << 2) | 1;
  s.large.ptr[size] = '\0';
}

TF_Code code_for_errno(int err) {
  switch (err) {
    case ENOENT: case ENOTDIR: return kNotFound;
    case EACCES: case EPERM: return kPermissionDenied;
    case ENOMEM: return kResourceExhausted;
    case ENODATA: case EIO: return kDataLoss;
    default: return kUnknown;
  }
}

// Words errors like tensorferry.TensorferryIOError: the file, what failed, where, errno.
std::string describe(const std::string &path, const std::string &what, int err, uint64_t offset,
                     uint64_t length) {
  std::string message = path + ": " + what;
  if (length) message += " at offset " + std::to_string(offset) + " (" + std::to_string(length) + " bytes)";
  return message + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

class Status {
 public:
  Status() : s_(TF_NewStatus()) {}
  ~Status() { TF_DeleteStatus(s_); }
  Status(const Status &) = delete;
  Status &operator=(const Status &) = delete;
  TF_Status *get() const { return s_; }
  bool ok() const { return TF_GetCode(s_) == 0; }

 private:
  TF_Status *s_;
};

void fail(TF_OpKernelContext *ctx, TF_Code code, const std::string &message) {
  Status status;
  TF_SetStatus(status.get(), code, message.c_str());
  TF_OpKernelContext_Failure(ctx, status.get());
}

// One read a call makes: [offset, offset + size) of a file into dest.
struct Read {
  std::shared_ptr<tf::File> file;
  uint64_t offset, size;
  char *dest;
};

// What one call of an op holds while its reads run: its inputs, its output, the
// file of each range and the reads.
struct Call {
  TF_OpKernelContext *ctx;
  std::vector<TF_Tensor *> tensors;  // inputs, then the output
  std::vector<std::string_view> paths;
  const int64_t *offsets = nullptr;
  const int64_t *lengths = nullptr;
  std::vector<std::shared_ptr<tf::File>> files;  // of each range
  std::vector<Read> reads;

  ~Call() {
    for (TF_Tensor *t : tensors) TF_DeleteTensor(t);
  }
  uint64_t end(size_t i) const { return offsets[i] + lengths[i]; }
};

// Page-aligned memory in huge pages, reused from call to call.
class StagingPool {
 public:
  StagingPool() = default;
  StagingPool(const StagingPool &) = delete;
  StagingPool &operator=(const StagingPool &) = delete;
  ~StagingPool() {
    for (auto &[ptr, size] : free_) munmap(ptr, size);
  }
  std::pair<char *, uint64_t> take(uint64_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].second >= nbytes) {
          auto region = free_[i];
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return region;
        }
      }
    }
    uint64_t mapped = 0;
    char *ptr = static_cast<char *>(tf::map_transfer_memory(nbytes, &mapped));
    return {ptr, mapped};
  }
  void give(std::pair<char *, uint64_t> region) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(region);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<char *, uint64_t>> free_;
};

// One kernel per op in a graph; tf.data calls it from several threads at once. The
// kernels are synchronous: TensorFlow's C API for asynchronous kernels hands over a
// pointer to its done callback that dangles once the call returns, so a call cannot
// end later, from the engine's threads. Reads in flight are therefore the items of
// one call (its batch) times the calls that run at once.
class Reader {
 public:
  Reader(const tf::Config &config, bool direct) : engine_(config), direct_(direct) {}

  // Opens the file of every range (each once). False: the op's error is set.
  bool open(Call &call) const {
    std::unordered_map<std::string_view, std::shared_ptr<tf::File>> opened;
    try {
      for (std::string_view path : call.paths) {
        auto &file = opened[path];
        if (!file) file = std::make_shared<tf::File>(std::string(path), "r", direct_);
        call.files.push_back(file);
      }
    } catch (const tf::IOError &e) {
      fail(call.ctx, code_for_errno(e.err), describe(e.path, e.what, e.err, e.offset, e.length));
      return false;
    }
    return true;
  }

  // Runs the call's reads, one request for reads that continue each other in file
  // and in memory. False: the op's error is set, the first failed read's.
  bool read(Call &call) const {
    std::vector<std::shared_ptr<tf::Request>> requests;
    const auto &reads = call.reads;
    for (size_t i = 0, n = reads.size(); i < n;) {
      size_t j = i + 1;
      uint64_t size = reads[i].size;
      while (j < n && reads[j].file == reads[i].file && reads[j].offset == reads[i].offset + size &&
             reads[j].dest == reads[i].dest + size)
        size += reads[j++].size;
      if (size) requests.push_back(engine_.submit(reads[i].file, false, reads[i].dest, size, reads[i].offset));
      i = j;
    }
    std::string error;
    TF_Code code = kUnknown;
    for (auto &r : requests) {  // each writes into memory of the call's: all are waited for, even after an error
      r->wait(-1);
      if (r->failed() && error.empty()) {
        code = code_for_errno(r->error());
        error = describe(r->file().path(), r->error_what(), r->error(), r->error_offset(), r->error_length());
      }
    }
    if (!error.empty()) fail(call.ctx, code, error);
    return error.empty();
  }

  bool tfrecord = false;
  int64_t record_bytes = 0;
  mutable StagingPool staging;

 private:
  mutable tf::Engine engine_;
  bool direct_;
};

Reader *create_reader(TF_OpKernelConstruction *ctx) {
  Status status;
  tf::Config config;
  char backend[32] = {0};
  int64_t value = 0;
  TF_Bool direct = 0;
  TF_OpKernelConstruction_GetAttrString(ctx, "backend", backend, sizeof backend - 1, status.get());
  if (status.ok()) config.backend = backend;
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "block_size", &value, status.get());
  if (status.ok()) config.block_size = static_cast<uint64_t>(value);
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "queue_depth", &value, status.get());
  if (status.ok()) config.queue_depth = static_cast<int>(value);
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "threads", &value, status.get());
  if (status.ok()) config.threads = static_cast<int>(value);
  if (status.ok()) TF_OpKernelConstruction_GetAttrBool(ctx, "direct", &direct, status.get());
  if (!status.ok()) {
    TF_OpKernelConstruction_Failure(ctx, status.get());
    return nullptr;
  }
  try {
    return new Reader(config, direct);
  } catch (const tf::IOError &e) {
    TF_SetStatus(status.get(), kInternal, describe(e.path, e.what, e.err, e.offset, e.length).c_str());
    TF_OpKernelConstruction_Failure(ctx, status.get());
    return nullptr;
  }
}

void *create_string_reader(TF_OpKernelConstruction *ctx) {
  Reader *reader = create_reader(ctx);
  if (!reader) return nullptr;
  Status status;
  TF_Bool flag = 0;
  TF_OpKernelConstruction_GetAttrBool(ctx, "tfrecord", &flag, status.get());
  if (!status.ok()) {
    TF_OpKernelConstruction_Failure(ctx, status.get());
    delete reader;
    return nullptr;
  }
  reader->tfrecord = flag;
  return reader;
}

void *create_record_reader(TF_OpKernelConstruction *ctx) {
  Reader *reader = create_reader(ctx);
  if (!reader) return nullptr;
  Status status;
  TF_OpKernelConstruction_GetAttrInt64(ctx, "record_bytes", &reader->record_bytes, status.get());
  if (!status.ok() || reader->record_bytes <= 0) {
    if (status.ok()) TF_SetStatus(status.get(), kInvalidArgument, "record_bytes must be positive");
    TF_OpKernelConstruction_Failure(ctx, status.get());
    delete reader;
    return nullptr;
  }
  return reader;
}

void delete_reader(void *reader) { delete static_cast<Reader *>(reader); }

// Takes the inputs every read op has: paths (string, any shape), offsets (int64, the
// same shape) and, for variable-length reads, lengths (likewise). False: the call has
// its error set.
bool take_inputs(Call &call, int count, const int64_t **lengths, std::vector<int64_t> &shape) {
  Status status;
  for (int i = 0; i < count; ++i) {
    TF_Tensor *t = nullptr;
    TF_GetInput(call.ctx, i, &t, status.get());
    if (!status.ok()) {
      TF_OpKernelContext_Failure(call.ctx, status.get());
      return false;
    }
    call.tensors.push_back(t);
  }
  const int64_t n = TF_TensorElementCount(call.tensors[0]);
  for (int i = 1; i < count; ++i) {
    if (TF_TensorElementCount(call.tensors[i]) != n) {
      fail(call.ctx, kInvalidArgument, "paths, offsets and lengths must have the same number of elements");
      return false;
    }
  }
  for (int d = 0; d < TF_NumDims(call.tensors[0]); ++d) shape.push_back(TF_Dim(call.tensors[0], d));
  const auto *strings = static_cast<const TString *>(TF_TensorData(call.tensors[0]));
  for (int64_t i = 0; i < n; ++i) call.paths.push_back(tstring_view(strings[i]));
  call.offsets = static_cast<const int64_t *>(TF_TensorData(call.tensors[1]));
  if (lengths) *lengths = static_cast<const int64_t *>(TF_TensorData(call.tensors[2]));
  for (int64_t i = 0; i < n; ++i) {
    if (call.offsets[i] < 0 || (lengths && (*lengths)[i] < 0)) {
      fail(call.ctx, kInvalidArgument, std::string(call.paths[i]) + ": negative offset or length");
      return false;
    }
  }
  return true;
}

// Output 0 of the call's op, kept by the call.
char *allocate_output(Call &call, TF_DataType dtype, const std::vector<int64_t> &shape, size_t nbytes) {
  Status status;
  TF_Tensor *out = TF_AllocateOutput(call.ctx, 0, dtype, shape.data(), static_cast<int>(shape.size()), nbytes,
                                     status.get());
  if (!status.ok()) {
    TF_OpKernelContext_Failure(call.ctx, status.get());
    return nullptr;
  }
  call.tensors.push_back(out);
  return static_cast<char *>(TF_TensorData(out));
}

// Ranges of at least this many bytes are read straight into their string's own
// memory (2 MiB-aligned, in huge pages); smaller ones through the reader's staging,
// where the aligned envelopes of neighbouring ranges merge into one read: huge
// pages for the drive, no small reads of shared edge blocks, and one copy into a
// string that malloc sizes exactly.
constexpr uint64_t kOwnMemoryBytes = 4u << 20;

// The aligned envelope of range i, ending no further than the end of its file (a
// range past the end keeps its own end, so that the read fails and says so).
std::pair<uint64_t, uint64_t> envelope(const Call &call, size_t i) {
  const tf::File &file = *call.files[i];
  const uint64_t align = file.direct() ? file.offset_align() : 1;
  const uint64_t start = call.offsets[i] - call.offsets[i] % align;
  const uint64_t end = std::max(call.end(i), std::min(file.size(), (call.end(i) + align - 1) / align * align));
  return {start, end};
}

void compute_strings(void *kernel, TF_OpKernelContext *ctx) {
  const auto &reader = *static_cast<Reader *>(kernel);
  Call call;
  call.ctx = ctx;
  std::vector<int64_t> shape;
  if (!take_inputs(call, 3, &call.lengths, shape) || !reader.open(call)) return;
  const size_t n = call.paths.size();
  auto *strings = reinterpret_cast<TString *>(allocate_output(call, kString, shape, n * sizeof(TString)));
  if (!strings) return;
  // Where each range's bytes land: its string's memory, or staging + offset.
  std::vector<char *> own(n, nullptr);
  std::vector<uint64_t> staged_at(n, 0);
  uint64_t staged = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t length = call.lengths[i];
    if (reader.tfrecord && length < kTfrecordFooter)
      return fail(ctx, kDataLoss, std::string(call.paths[i]) + ": TFRecord range shorter than its CRC");
    if (!length) continue;
    auto [start, end] = envelope(call, i);
    if (length >= kOwnMemoryBytes) {
      own[i] = tstring_allocate(strings[i], end - start);
      if (!own[i]) return fail(ctx, kResourceExhausted, "no memory for " + std::to_string(length) + " bytes");
      call.reads.push_back({call.files[i], start, end - start, own[i]});
      continue;
    }
    // Staged: continue the previous staged read if this envelope meets or overlaps it.
    Read *last = call.reads.empty() || call.reads.back().dest ? nullptr : &call.reads.back();
    if (last && last->file == call.files[i] && start <= last->offset + last->size && start >= last->offset) {
      const uint64_t last_end = last->offset + last->size;
      staged_at[i] = staged - last->size + (call.offsets[i] - last->offset);
      if (end > last_end) {
        last->size = end - last->offset;
        staged += end - last_end;
      }
    } else {
      staged = (staged + 4095) / 4096 * 4096;
      staged_at[i] = staged + (call.offsets[i] - start);
      call.reads.push_back({call.files[i], start, end - start, nullptr});
      staged += end - start;
    }
  }
  // Staged reads got no memory yet (dest null) so that their sizes could grow; their
  // offsets in staging follow the same sequence as above.
  std::pair<char *, uint64_t> region;
  try {
    region = reader.staging.take(std::max<uint64_t>(staged, 1));
  } catch (const tf::IOError &e) {
    return fail(ctx, kResourceExhausted, describe("staging", e.what, e.err, e.offset, e.length));
  }
  struct GiveBack {
    const Reader &r;
    std::pair<char *, uint64_t> region;
    ~GiveBack() { r.staging.give(region); }
  } give_back{reader, region};
  uint64_t at = 0;
  for (Read &r : call.reads) {
    if (r.dest) continue;
    at = (at + 4095) / 4096 * 4096;
    r.dest = region.first + at;
    at += r.size;
  }
  if (!reader.read(call)) return;
  for (size_t i = 0; i < n; ++i) {
    uint64_t size = call.lengths[i];
    if (!size) continue;
    char *data = own[i];
    if (data) {
      const uint64_t head = call.offsets[i] % (call.files[i]->direct() ? call.files[i]->offset_align() : 1);
      if (head) std::memmove(data, data + head, size);
    } else {
      data = tstring_allocate(strings[i], size);
      if (!data) return fail(ctx, kResourceExhausted, "no memory for " + std::to_string(size) + " bytes");
      std::memcpy(data, region.first + staged_at[i], size);
    }
    if (reader.tfrecord) {
      size -= kTfrecordFooter;
      uint32_t stored;
      std::memcpy(&stored, data + size, sizeof stored);
      if (tf::masked_crc32c(data, size) != stored)
        return fail(ctx, kDataLoss, std::string(call.paths[i]) + ": bad data CRC in the record at offset " +
                                        std::to_string(call.offsets[i] - 12));  // the 12-byte header precedes the data
    }
    set_size(strings[i], size);
  }
}

void compute_records(void *kernel, TF_OpKernelContext *ctx) {
  const auto &reader = *static_cast<Reader *>(kernel);
  Call call;
  call.ctx = ctx;
  std::vector<int64_t> shape;
  if (!take_inputs(call, 2, nullptr, shape) || !reader.open(call)) return;
  const size_t n = call.paths.size();
  shape.push_back(reader.record_bytes);
  char *data = allocate_output(call, kUint8, shape, n * reader.record_bytes);
  if (!data) return;
  for (size_t i = 0; i < n; ++i)
    call.reads.push_back({call.files[i], static_cast<uint64_t>(call.offsets[i]),
                          static_cast<uint64_t>(reader.record_bytes), data + i * reader.record_bytes});
  reader.read(call);
}

void unknown_shape(TF_ShapeInferenceContext *ctx, TF_Status *status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

void add_engine_attrs(TF_OpDefinitionBuilder *op) {
  TF_OpDefinitionBuilderAddAttr(op, "backend: string");
  TF_OpDefinitionBuilderAddAttr(op, "block_size: int");
  TF_OpDefinitionBuilderAddAttr(op, "queue_depth: int");
  TF_OpDefinitionBuilderAddAttr(op, "threads: int");
  TF_OpDefinitionBuilderAddAttr(op, "direct: bool");
}

void register_op(const char *name, bool with_lengths, const char *attr, const char *output,
                 void *(*create)(TF_OpKernelConstruction *), void (*compute)(void *, TF_OpKernelContext *)) {
  Status status;
  TF_OpDefinitionBuilder *op = TF_NewOpDefinitionBuilder(name);
  TF_OpDefinitionBuilderAddInput(op, "paths: string");
  TF_OpDefinitionBuilderAddInput(op, "offsets: int64");
  if (with_lengths) TF_OpDefinitionBuilderAddInput(op, "lengths: int64");
  TF_OpDefinitionBuilderAddOutput(op, output);
  TF_OpDefinitionBuilderAddAttr(op, attr);
  add_engine_attrs(op);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, unknown_shape);
  TF_RegisterOpDefinition(op, status.get());
  if (!status.ok()) return;
  TF_KernelBuilder *kernel = TF_NewKernelBuilder(name, "CPU", create, compute, delete_reader);
  TF_RegisterKernelBuilder(name, kernel, status.get());
}

const bool registered = [] {
  register_op("TensorferryReadStrings", true, "tfrecord: bool", "out: string", create_string_reader,
              compute_strings);
  register_op("TensorferryReadRecords", false, "record_bytes: int", "out: uint8", create_record_reader,
              compute_records);
  return true;
}();

}  // namespace
