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
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>

#include "crc32c.hpp"
#include "engine.hpp"
#include "tfrecord.hpp"

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
TF_Tensor *TF_NewTensor(TF_DataType dtype, const int64_t *dims, int num_dims, void *data, size_t len,
                        void (*deallocator)(void *data, size_t len, void *arg), void *deallocator_arg);
void TF_SetOutput(TF_OpKernelContext *ctx, int i, const TF_Tensor *tensor, TF_Status *status);
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

constexpr TF_DataType kUint8 = 4, kString = 7, kInt64 = 9;
constexpr TF_Code kInvalidArgument = 3, kNotFound = 5, kPermissionDenied = 7, kResourceExhausted = 8,
                  kFailedPrecondition = 9, kInternal = 13, kDataLoss = 15, kUnknown = 2;
constexpr uint64_t kTfrecordFooter = 4;  // masked crc32c of the record's data
// A range's length that stands for the rest of its file as it is when read: whole files
// are read as tf.io.read_file reads them, new bytes and all, not cut to an old size.
constexpr int64_t kWholeFile = -1;
// A TFRecord range's length that stands for the damaged record at its offset (cut short, or
// a bad length CRC), where the framing scan stopped: its item fails with DataLossError, as
// and where TFRecordDataset raises it. make_dataset's DAMAGED.
constexpr int64_t kDamagedRecord = -2;

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

void set_size(TString &s, size_t size) {
  s.large.size = (size << 2) | 1;
  s.large.ptr[size] = '\0';
}

std::string_view tstring_view(const TString &s) {
  switch (s.small.size & 3) {
    case 0: return {s.small.str, static_cast<size_t>(s.small.size >> 2)};
    case 1: return {s.large.ptr, s.large.size >> 2};
    case 2: return {reinterpret_cast<const char *>(&s) + s.offset.offset, s.offset.size >> 2};
    default: return {s.view.ptr, s.view.size >> 2};
  }
}

// Gives `s` (freshly constructed: empty and small) `size` bytes of uninitialised
// memory, or adopts `memory` (from malloc or posix_memalign, at least size + 1 bytes):
// TensorFlow frees a large tstring's memory with free().
char *tstring_allocate(TString &s, size_t size, char *memory = nullptr) {
  if (!memory) memory = static_cast<char *>(malloc(size + 1));
  if (!memory) return nullptr;
  s.large.ptr = memory;
  s.large.cap = size;
  set_size(s, size);
  return memory;
}

TF_Code code_for_errno(int err) {
  switch (err) {
    case ENOENT: case ENOTDIR: return kNotFound;
    case EACCES: case EPERM: return kPermissionDenied;
    case ENOMEM: case EMFILE: case ENFILE: return kResourceExhausted;
    case EISDIR: return kFailedPrecondition;  // as tf.io.read_file reports a directory
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

// The length of the valid UTF-8 sequence at text[i], 0 if there is none (overlong forms,
// surrogates and code points past U+10FFFF are not valid).
size_t utf8_sequence_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char first = byte(i);
  if (first < 0x80) return 1;
  size_t n = 0;
  unsigned char low = 0x80, high = 0xbf;  // the second byte's range
  if (first >= 0xc2 && first <= 0xdf) {
    n = 2;
  } else if (first >= 0xe0 && first <= 0xef) {
    n = 3;
    if (first == 0xe0) low = 0xa0;   // overlong
    if (first == 0xed) high = 0x9f;  // surrogates
  } else if (first >= 0xf0 && first <= 0xf4) {
    n = 4;
    if (first == 0xf0) low = 0x90;   // overlong
    if (first == 0xf4) high = 0x8f;  // past U+10FFFF
  }
  if (n == 0 || i + n > text.size() || byte(i + 1) < low || byte(i + 1) > high) return 0;
  for (size_t k = i + 2; k < i + n; ++k)
    if (byte(k) < 0x80 || byte(k) > 0xbf) return 0;
  return n;
}

// The message with each byte that is not part of valid UTF-8 written \xNN, as Python's
// "backslashreplace" writes it. TensorFlow decodes messages as strict UTF-8: a file name
// that is not made the error a UnicodeDecodeError, which no except tf.errors.OpError caught.
std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (const size_t n = utf8_sequence_length(text, i)) {
      out.append(text.substr(i, n));
      i += n;
      continue;
    }
    constexpr char kHex[] = "0123456789abcdef";
    const unsigned char b = static_cast<unsigned char>(text[i++]);
    out += {'\\', 'x', kHex[b >> 4], kHex[b & 15]};
  }
  return out;
}

void fail(TF_OpKernelContext *ctx, TF_Code code, const std::string &message) {
  Status status;
  TF_SetStatus(status.get(), code, printable(message).c_str());
  TF_OpKernelContext_Failure(ctx, status.get());
}

// Memory that reads land in, shared by the items of neighbouring ranges: huge pages,
// reused from read to read. Never given back while a read may still write into it.
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
    if (free_.size() < kKeep) return free_.push_back(region);
    munmap(region.first, region.second);
  }

 private:
  static constexpr size_t kKeep = 64;
  std::mutex mu_;
  std::vector<std::pair<char *, uint64_t>> free_;
};

// Memory for fixed-length records that become TensorFlow's tensors uncopied: slots of
// one size carved from huge-page slabs, each given back when TensorFlow frees its
// tensor. A slot per record, not a buffer per batch, so that a record held (in a
// shuffle buffer, say) holds nothing else; a slot in huge pages, as fresh 4 KiB pages
// cost a fault each and split a 1 MiB read in two on a virtio disk. Slabs are kept
// until the last tensor and the dataset are gone: the memory held is the most records
// ever out at once.
class RecordSlots {
 public:
  explicit RecordSlots(uint64_t slot_bytes) : slot_bytes_(slot_bytes) {}
  RecordSlots(const RecordSlots &) = delete;
  RecordSlots &operator=(const RecordSlots &) = delete;
  ~RecordSlots() {
    for (auto &[ptr, size] : slabs_) munmap(ptr, size);
  }
  uint64_t slot_bytes() const { return slot_bytes_; }
  char *take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) {
      uint64_t mapped = 0;  // at least 8 slots a slab, in whole huge pages; a batch's large slot alone
      const uint64_t slab_bytes = slot_bytes_ >= (4u << 20) ? slot_bytes_ : std::max<uint64_t>(8 * slot_bytes_, 2u << 20);
      char *slab = static_cast<char *>(tf::map_transfer_memory(slab_bytes, &mapped));
      slabs_.emplace_back(slab, mapped);
      for (uint64_t at = 0; at + slot_bytes_ <= mapped; at += slot_bytes_) free_.push_back(slab + at);
    }
    char *slot = free_.back();
    free_.pop_back();
    return slot;
  }
  void give(char *slot) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(slot);
  }

 private:
  const uint64_t slot_bytes_;
  std::mutex mu_;
  std::vector<std::pair<char *, uint64_t>> slabs_;
  std::vector<char *> free_;
};

// Descriptors of the files that reads in flight hold open, across all datasets of the
// process. A start call opens the files of its items (two descriptors each with O_DIRECT)
// and they stay open until its reads end; tf.data runs many calls ahead, so thousands of
// small files ran out of descriptors (EMFILE at the usual soft limit of 1024). A call that
// would go past the budget first waits for the reads of the oldest calls, which end
// without TensorFlow's threads. Counted down when a later call comes and finds reads over.
class DescriptorBudget {
 public:
  // Half the soft limit, the rest left to the process (TensorFlow's own, sockets, ...);
  // at most 4096: more reads in flight gain nothing, the engine runs queue_depth at once.
  // Less once the process's other descriptors left less room than that (see relieve).
  int64_t budget() const {
    struct rlimit limit {};
    const uint64_t soft = getrlimit(RLIMIT_NOFILE, &limit) == 0 ? limit.rlim_cur : 1024;
    return std::min(static_cast<int64_t>(std::clamp<uint64_t>(soft / 2, 16, 4096)), cap_.load());
  }

  // Waits until n more descriptors fit, or until none are held: a call needs its files.
  void reserve(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    forget_finished();
    while (held_ > 0 && held_ + n > budget()) {
      if (calls_.empty()) {  // those held belong to calls still opening their files
        changed_.wait(lock);
        continue;
      }
      Call oldest = std::move(calls_.front());
      calls_.pop_front();
      lock.unlock();
      for (auto &r : oldest.requests) r->wait(-1);  // a finished request has closed its file
      lock.lock();
      held_ -= oldest.descriptors;
      changed_.notify_all();
    }
    held_ += n;
  }

  // The reads of a call that reserved n descriptors: they count until those reads end.
  void hold(int64_t n, std::vector<std::shared_ptr<tf::Request>> requests) {
    std::lock_guard<std::mutex> lock(mu_);
    forget_finished();
    calls_.push_back({n, std::move(requests)});
    changed_.notify_all();
  }

  // An open of a call that reserved n descriptors failed with EMFILE or ENFILE: the
  // process's other descriptors (a thousand sockets, another library's files) leave less
  // room than the budget. The call gives its n back, and the budget drops to half of what
  // reads held then, so that calls wait for older reads to close their files, down to one
  // call at a time. For good: raised again, reads would fill the descriptors anew, and the
  // process's other opens (TensorFlow's, the program's) would fail. False where waiting
  // cannot help: a call of one file, the only one holding any.
  bool relieve(int64_t n, bool one_file) {
    std::lock_guard<std::mutex> lock(mu_);
    forget_finished();
    const int64_t held = held_;
    held_ -= n;
    changed_.notify_all();
    if (one_file && held_ == 0) return false;
    cap_ = std::max<int64_t>(1, std::min(budget(), held) / 2);
    return true;
  }

 private:
  struct Call {
    int64_t descriptors;
    std::vector<std::shared_ptr<tf::Request>> requests;
  };

  // Lets go of the calls whose reads are over. Kept until room was needed, their requests
  // (small allocations among the items' freed memory) kept the heap from giving that back:
  // 600 MiB more resident after 60 abandoned passes over 64 KiB records, against 10-30.
  void forget_finished() {
    const auto over = [](const Call &call) {
      return std::all_of(call.requests.begin(), call.requests.end(), [](const auto &r) { return r->done(); });
    };
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (!over(*it)) {
        ++it;
        continue;
      }
      held_ -= it->descriptors;
      it = calls_.erase(it);
    }
  }
  std::mutex mu_;
  std::condition_variable changed_;
  int64_t held_ = 0;
  std::atomic<int64_t> cap_{INT64_MAX};
  std::deque<Call> calls_;
};

// An open of a call's part ran out of descriptors: the part is tried again, with fewer files.
struct OutOfDescriptors {};

DescriptorBudget &descriptor_budget() {
  static auto *budget = new DescriptorBudget;  // never destroyed: reads may end after exit begins
  return *budget;
}

// One read in flight and the memory it fills: a staging region that the items it
// covers share, an item's own memory (free()-able: it becomes a string's), or a
// record's slot.
struct Landing {
  StagingPool *pool = nullptr;
  std::pair<char *, uint64_t> region{nullptr, 0};
  char *own = nullptr;
  std::shared_ptr<RecordSlots> slots;
  char *slot = nullptr;
  bool batch = false;  // the slot holds a call's records in order (a batch_size dataset's)
  std::vector<std::shared_ptr<tf::Request>> requests;  // a batch's reads: one per file

  Landing() = default;
  Landing(const Landing &) = delete;
  Landing &operator=(const Landing &) = delete;
  ~Landing() {
    for (auto &r : requests) r->wait(-1);  // the drive may still be writing into this memory
    if (region.first) pool->give(region);
    if (slot) slots->give(slot);
    free(own);
  }
  char *memory() const { return slot ? slot : own ? own : region.first; }
};

// An item whose read has started, until a take op claims it.
struct Pending {
  std::shared_ptr<Landing> landing;
  std::shared_ptr<tf::Request> request;  // the read that fills it
  char *data = nullptr;  // where the item's bytes start, inside the landing's memory
  uint64_t length = 0;
  std::string path;
  uint64_t offset = 0;
  int64_t asked = 0;  // the length asked for: kWholeFile for the rest of the file, however long it is then
  TF_Code code = 0;  // failed before its read started: reported when it is taken
  std::string error;
};

// Items of at least this many bytes get memory of their own (2 MiB-aligned, in huge
// pages), read straight in and handed over to their string; smaller ones share
// staging, where the aligned envelopes of neighbouring ranges merge into one read,
// and are copied out when taken.
constexpr uint64_t kOwnMemoryBytes = 4u << 20;
// Items of 64-512 KiB (small images, say) too, in 4 KiB pages: the copy out of staging
// was most of their per-byte cost (128 KiB files: 1.7 -> 1.4 CPU-s/GB, 0.8 -> 1.0 GB/s).
// Not from 512 KiB: a transfer of more than 254 pages is split in two by a virtio disk
// (1 MiB files read at 0.8-1.05 GB/s so, against 1.9-2.4 through huge-page staging).
constexpr uint64_t kOwnSmallFrom = 64u << 10, kOwnSmallTo = 512u << 10;
// Fixed-length records of at least this many bytes (those that make_dataset takes one
// at a time: SMALL_ITEM_BYTES in adapters/tensorflow/data.py) are read into slots and
// handed over uncopied. The copy out of staging into a new tensor cost 0.25 CPU-s/GB
// of 1 MiB records, more than all the rest of their reading.
constexpr uint64_t kSlotRecordBytes = 256u << 10;

// An engine with the dataset's settings. An io_uring engine needs descriptors (a ring and
// an eventfd per thread) that a process at its limit lacks; the threads backend, which needs
// none, reads then, as tf.io.read_file would.
std::shared_ptr<tf::Engine> engine_for(tf::Config config) {
  try {
    return std::make_shared<tf::Engine>(config);
  } catch (const tf::IOError &e) {
    if (config.backend != "io_uring" || (e.err != EMFILE && e.err != ENFILE)) throw;
    config.backend = "threads";
    return std::make_shared<tf::Engine>(config);
  }
}

// Random bits from getrandom, which needs no descriptor: std::random_device opens
// /dev/urandom, and threw (killing the process) where none was left.
uint32_t random_bits() {
  uint32_t bits = 0;
  if (getrandom(&bits, sizeof bits, 0) != sizeof bits)
    bits = static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return bits;
}

// Reads ahead for the take ops. TensorFlow's C API cannot finish an op after its
// call returns (the asynchronous kernel's done callback dies with the call), so a
// read that blocks holds one of the inter-op pool's few threads. Instead the start
// op submits a batch of reads and returns at once with one ticket per item, which
// tf.data keeps running ahead of the take op that waits for each in turn: the queue
// depth is then how far tf.data runs ahead, not the number of threads.
class Prefetcher {
 public:
  Prefetcher(const tf::Config &config, bool direct, int64_t record_bytes, int64_t batch_size, int64_t read_ahead)
      : engine_(engine_for(config)), direct_(direct), record_bytes_(static_cast<uint64_t>(record_bytes)),
        kept_calls_(static_cast<size_t>(2 * (read_ahead > 0 ? read_ahead : kUnknownReadAhead) + kCallsInTransit)),
        slots_(record_bytes >= static_cast<int64_t>(kSlotRecordBytes)
                   ? std::make_shared<RecordSlots>((static_cast<uint64_t>(record_bytes) + 4095) / 4096 * 4096)
                   : nullptr),
        // Records of whole pages, taken a batch per call: read in order into one slot
        // that becomes the batch's tensor. Copied out of staging, a batch of 1 MiB
        // records cost 0.45-0.54 CPU-s/GB, 0.30-0.35 without the copy.
        batch_slots_(record_bytes > 0 && record_bytes % 4096 == 0 && batch_size > 1
                         ? std::make_shared<RecordSlots>(static_cast<uint64_t>(record_bytes * batch_size))
                         : nullptr) {}

  // Starts the reads of ranges [offsets[i], + lengths[i]) of paths[i] (kWholeFile: to the file's end);
  // returns their tickets, held until taken or, a call's reads not taken, until they are
  // among the oldest past kept_calls_ (see keep).
  void start(const std::vector<std::string_view> &paths, const int64_t *offsets, const int64_t *lengths,
             int64_t *tickets) {
    keep(read(paths, offsets, lengths), tickets);
  }

  // Waits for the read of a ticket, of paths[i]'s range [offset, + length). A ticket
  // this prefetcher does not hold for that range (one restored with an iterator's
  // checkpoint: started in another process, taken already, or let go by keep) is read now.
  void take(int64_t ticket, std::string_view path, int64_t offset, int64_t length, Pending &item) {
    bool held = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(ticket);
      if (it != pending_.end() && it->second.path == path && it->second.offset == static_cast<uint64_t>(offset) &&
          it->second.asked == length) {
        item = std::move(it->second);
        pending_.erase(it);
        held = true;
      }
    }
    if (!held) item = std::move(read({path}, &offset, &length)[0]);
    if (item.error.empty() && item.request) {
      tf::Request &r = *item.request;
      r.wait(-1);
      if (r.failed()) {
        item.code = code_for_errno(r.error());
        item.error = describe(r.path(), r.error_what(), r.error(), r.error_offset(), r.error_length());
      }
    }
  }

  // The items whose reads were started and not yet taken (nor let go).
  int64_t held_reads() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(pending_.size());
  }

 private:
  // Calls that iterators hold started and not yet taken beyond their read-ahead (the start
  // map's num_parallel_calls): those being taken or unbatched, and handed between the maps.
  static constexpr int64_t kCallsInTransit = 4;
  // An op of a graph made without read_ahead (0) runs as make_dataset's most (AUTOTUNE's cap).
  static constexpr int64_t kUnknownReadAhead = 64;

  // The items of ranges [offsets[i], + lengths[i]) of paths[i], their reads started. Items of more
  // files than a quarter of the descriptor budget are started in parts, each part's files open
  // only until its reads end. A part whose files cannot all be opened (EMFILE, ENFILE) is
  // tried again with fewer, once older reads have closed theirs; a file that cannot be opened
  // even alone, with nothing else of ours open, is opened once more without O_DIRECT (one
  // descriptor, as tf.io.read_file takes) before its items fail.
  std::vector<Pending> read(const std::vector<std::string_view> &paths, const int64_t *offsets,
                            const int64_t *lengths) {
    std::vector<Pending> items;
    bool last_try = false;
    for (size_t begin = 0, end = 0; begin < paths.size(); begin = end) {
      const int64_t per_file = direct_ && !last_try ? 2 : 1;
      const size_t most_files =
          last_try ? 1 : static_cast<size_t>(std::max<int64_t>(1, descriptor_budget().budget() / 4 / per_file));
      std::unordered_set<std::string_view> files;
      for (end = begin; end < paths.size() && (files.count(paths[end]) || files.size() < most_files); ++end)
        files.insert(paths[end]);
      const std::vector<std::string_view> part(paths.begin() + begin, paths.begin() + end);
      const int64_t descriptors = static_cast<int64_t>(files.size()) * per_file;
      descriptor_budget().reserve(descriptors);
      std::vector<std::shared_ptr<tf::Request>> requests;
      try {
        requests = start_part(part, offsets + begin, lengths + begin, items, last_try);
      } catch (const OutOfDescriptors &) {
        last_try = !descriptor_budget().relieve(descriptors, files.size() == 1) && !switch_to_threads();
        end = begin;
        continue;
      } catch (...) {
        descriptor_budget().hold(descriptors, {});
        throw;
      }
      descriptor_budget().hold(descriptors, std::move(requests));
      last_try = false;
    }
    return items;
  }

  // Trades an io_uring engine for one of threads, whose reads need no descriptors of its own:
  // its rings and eventfds may be those that a file lacks. False where it reads with threads.
  // The old engine goes once the calls that took it have submitted, and waits for their reads.
  bool switch_to_threads() {
    std::shared_ptr<tf::Engine> old;  // let go unlocked
    std::lock_guard<std::mutex> lock(engine_mu_);
    if (std::string_view(engine_->backend_name()) != "io_uring") return false;
    tf::Config config = engine_->config();
    config.backend = "threads";
    old = std::exchange(engine_, std::make_shared<tf::Engine>(config));
    return true;
  }

  // A file of a part, open for reading. Out of descriptors, it throws OutOfDescriptors for
  // the part to be tried again, but on the last try (one descriptor: no O_DIRECT), where the
  // IOError becomes its items' error.
  std::shared_ptr<tf::File> open(const std::string &path, bool last_try) const {
    try {
      return std::make_shared<tf::File>(path, "r", direct_ && !last_try);
    } catch (const tf::IOError &e) {
      if (!last_try && (e.err == EMFILE || e.err == ENFILE)) throw OutOfDescriptors{};
      throw;
    }
  }

  // read() for items whose files may all be open at once: appends them to `all`; returns the reads started.
  std::vector<std::shared_ptr<tf::Request>> start_part(const std::vector<std::string_view> &paths,
                                                       const int64_t *offsets, const int64_t *lengths,
                                                       std::vector<Pending> &all, bool last_try) {
    const size_t n = paths.size();
    std::vector<Pending> items(n);
    std::unordered_map<std::string_view, std::shared_ptr<tf::File>> files;
    std::vector<std::shared_ptr<tf::File>> file_of(n);
    // Staged ranges: merged envelopes, in order: (file, start, end) and the items in each.
    struct Span {
      std::shared_ptr<tf::File> file;
      uint64_t start, end;
      std::vector<size_t> items;
    };
    std::vector<Span> spans;
    std::vector<Queued> queued;  // reads to start, all together once laid out
    if (start_batch(paths, offsets, lengths, items, queued, last_try)) return submit_and_add(items, queued, all);
    for (size_t i = 0; i < n; ++i) {
      Pending &item = items[i];
      item.path = std::string(paths[i]);
      item.offset = static_cast<uint64_t>(offsets[i]);
      item.asked = lengths[i];
      if (item.asked == kDamagedRecord) {
        try {
          item.code = kDataLoss;
          item.error = tf::tfrecord_damage(item.path, item.offset);
        } catch (const tf::IOError &e) {
          item.code = code_for_errno(e.err);
          item.error = describe(e.path, e.what, e.err, e.offset, e.length);
        }
        continue;
      }
      try {
        auto &file = files[paths[i]];
        if (!file) file = open(item.path, last_try);
        file_of[i] = file;
        const uint64_t size = item.asked == kWholeFile ? file->size() : 0;
        item.length = item.asked == kWholeFile ? size - std::min(size, item.offset) : static_cast<uint64_t>(item.asked);
      } catch (const tf::IOError &e) {
        item.code = code_for_errno(e.err);
        item.error = describe(e.path, e.what, e.err, e.offset, e.length);
        continue;
      }
      if (!item.length) continue;
      const tf::File &file = *file_of[i];
      const uint64_t align = file.direct() ? file.offset_align() : 1, end = item.offset + item.length;
      const uint64_t env_start = item.offset - item.offset % align;
      // Not past the end of the file; a range that is keeps its own end, so its read fails and says so.
      const uint64_t env_end = std::max(end, std::min(file.size(), (end + align - 1) / align * align));
      if (slots_ && env_end - env_start <= slots_->slot_bytes()) {  // a record, aligned in its file
        auto landing = std::make_shared<Landing>();
        landing->slots = slots_;
        try {
          landing->slot = slots_->take();
        } catch (const tf::IOError &e) {
          item.code = kResourceExhausted;
          item.error = describe("record slots", e.what, e.err, e.offset, e.length);
          continue;
        }
        item.data = landing->slot + (item.offset - env_start);
        item.landing = landing;
        queued.push_back({landing, file_of[i], {{landing->memory(), env_end - env_start, env_start}}, {i}});
        continue;
      }
      if (item.length >= kOwnMemoryBytes || (item.length >= kOwnSmallFrom && item.length < kOwnSmallTo)) {
        auto landing = std::make_shared<Landing>();
        landing->own = own_memory(env_end - env_start);
        if (!landing->own) {
          item.code = kResourceExhausted;
          item.error = item.path + ": no memory for " + std::to_string(item.length) + " bytes";
          continue;
        }
        item.data = landing->own + (item.offset - env_start);
        item.landing = landing;
        queued.push_back({landing, file_of[i], {{landing->memory(), env_end - env_start, env_start}}, {i}});
        continue;
      }
      Span *last = spans.empty() ? nullptr : &spans.back();
      if (last && last->file == file_of[i] && env_start >= last->start && env_start <= last->end) {
        last->end = std::max(last->end, env_end);
        last->items.push_back(i);
      } else {
        spans.push_back({file_of[i], env_start, env_end, {i}});
      }
    }
    for (Span &span : spans) {
      auto landing = std::make_shared<Landing>();
      landing->pool = &pool_;
      try {
        landing->region = pool_.take(span.end - span.start);
      } catch (const tf::IOError &e) {
        for (size_t i : span.items) {
          items[i].code = kResourceExhausted;
          items[i].error = describe("staging", e.what, e.err, e.offset, e.length);
        }
        continue;
      }
      for (size_t i : span.items) {
        items[i].data = landing->region.first + (items[i].offset - span.start);
        items[i].landing = landing;
      }
      queued.push_back({landing, span.file, {{landing->memory(), span.end - span.start, span.start}}, span.items});
    }
    return submit_and_add(items, queued, all);
  }

  static char *own_memory(uint64_t size) {
    constexpr uint64_t kHuge = 2u << 20;
    void *p = nullptr;
    if (posix_memalign(&p, size >= kHuge ? kHuge : 4096, size + 1) != 0) return nullptr;
    if (size >= kHuge) madvise(p, size + 1, MADV_HUGEPAGE);
    return static_cast<char *>(p);
  }

  // A read laid out, to start: of one file, into a landing's memory, for the items it holds.
  struct Queued {
    std::shared_ptr<Landing> landing;
    std::shared_ptr<tf::File> file;
    std::vector<tf::Engine::Segment> segments;
    std::vector<size_t> items;
  };

  // Starts the queued reads and appends their items to `all`; returns the reads.
  std::vector<std::shared_ptr<tf::Request>> submit_and_add(std::vector<Pending> &items, std::vector<Queued> &queued,
                                                           std::vector<Pending> &all) {
    auto requests = submit_all(queued, items);
    for (Pending &item : items) all.push_back(std::move(item));
    return requests;
  }

  // Holds a call's items until taken, a ticket each. Reads that no take will claim (those
  // started ahead by an iterator stopped early: take(k).repeat(), a loop left by break) are
  // let go once past the newest kept_calls_ calls, else they were held (and their memory) as
  // long as the dataset, growing each epoch. A bound by calls, not bytes: what an iterator
  // holds ahead is its read-ahead in calls, whatever their items' sizes (whole files vary),
  // so a live iterator, or two read in turn (zip, a checkpoint's restored copy), never has
  // its reads let go and read twice; the memory held is then about twice the read-ahead
  // asked for. Taking a ticket let go reads its item again (as a checkpoint's are), so an
  // iterator left paused while others run many calls still gets its items.
  void keep(std::vector<Pending> items, int64_t *tickets) {
    std::vector<Pending> let_go;  // destroyed unlocked: a Landing waits for a read still in flight
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t first = next_ticket_;
    for (size_t i = 0; i < items.size(); ++i) {
      tickets[i] = next_ticket_++;
      pending_.emplace(tickets[i], std::move(items[i]));
    }
    calls_.emplace_back(first, next_ticket_);
    for (; calls_.size() > kept_calls_; calls_.pop_front()) {
      for (int64_t ticket = calls_.front().first; ticket < calls_.front().second; ++ticket) {
        auto it = pending_.find(ticket);
        if (it == pending_.end()) continue;  // taken
        let_go.push_back(std::move(it->second));
        pending_.erase(it);
      }
    }
  }

  // Lays out a call's records in order in one batch slot (neighbours in a file read
  // as one segment, a request per file); false where this call is not such a batch.
  bool start_batch(const std::vector<std::string_view> &paths, const int64_t *offsets, const int64_t *lengths,
                   std::vector<Pending> &items, std::vector<Queued> &queued, bool last_try) {
    const size_t n = paths.size();
    if (!batch_slots_ || n < 2 || n * record_bytes_ > batch_slots_->slot_bytes()) return false;
    for (size_t i = 0; i < n; ++i)
      if (static_cast<uint64_t>(lengths[i]) != record_bytes_) return false;
    auto landing = std::make_shared<Landing>();
    landing->slots = batch_slots_;
    landing->batch = true;
    try {
      landing->slot = batch_slots_->take();
    } catch (const tf::IOError &) {
      return false;  // staged instead, where the failure is reported per item
    }
    std::unordered_map<std::string_view, size_t> read_of;  // a file's entry in queued
    for (size_t i = 0; i < n; ++i) {
      Pending &item = items[i];
      item.path = std::string(paths[i]);
      item.offset = static_cast<uint64_t>(offsets[i]);
      item.length = record_bytes_;
      item.asked = lengths[i];
      item.data = landing->slot + i * record_bytes_;
      auto found = read_of.find(paths[i]);
      if (found == read_of.end()) {
        try {
          queued.push_back({landing, open(item.path, last_try), {}, {}});
        } catch (const tf::IOError &e) {
          item.code = code_for_errno(e.err);
          item.error = describe(e.path, e.what, e.err, e.offset, e.length);
          continue;
        }
        found = read_of.emplace(paths[i], queued.size() - 1).first;
      }
      Queued &read = queued[found->second];
      auto &last = read.segments;
      if (!last.empty() && last.back().offset + last.back().nbytes == item.offset &&
          last.back().ptr + last.back().nbytes == item.data) {
        last.back().nbytes += record_bytes_;
      } else {
        last.push_back({item.data, record_bytes_, item.offset});
      }
      read.items.push_back(i);
      item.landing = landing;
    }
    return true;
  }

  // Starts the queued reads together: one wake-up of the engine for a call's batch, not
  // one per file (batches of small files). An error that stops them is each item's,
  // reported when it is taken.
  std::vector<std::shared_ptr<tf::Request>> submit_all(std::vector<Queued> &queued, std::vector<Pending> &items) {
    if (queued.empty()) return {};
    std::vector<std::shared_ptr<tf::File>> files;
    std::vector<std::vector<tf::Engine::Segment>> segments;
    for (const Queued &q : queued) {
      files.push_back(q.file);
      segments.push_back(q.segments);
    }
    try {
      std::shared_ptr<tf::Engine> engine;
      {
        std::lock_guard<std::mutex> lock(engine_mu_);
        engine = engine_;
      }
      auto requests = engine->submit_reads(files, segments);
      for (size_t k = 0; k < queued.size(); ++k) {
        queued[k].landing->requests.push_back(requests[k]);
        for (size_t i : queued[k].items) items[i].request = requests[k];
      }
      return requests;
    } catch (const tf::IOError &e) {
      for (const Queued &q : queued) {
        for (size_t i : q.items) {
          items[i].code = code_for_errno(e.err);
          items[i].error = describe(e.path, e.what, e.err, e.offset, e.length);
          items[i].landing.reset();
        }
      }
      return {};
    }
  }

  // Destroyed in reverse: pending reads wait (into memory from the pool) before the
  // pool goes, and the engine outlives both.
  std::mutex engine_mu_;
  std::shared_ptr<tf::Engine> engine_;  // replaced by one of threads where descriptors run out
  bool direct_;
  uint64_t record_bytes_;
  size_t kept_calls_;  // the newest start calls whose reads are held until taken (see keep)
  std::shared_ptr<RecordSlots> slots_;  // for a dataset of records from kSlotRecordBytes on
  std::shared_ptr<RecordSlots> batch_slots_;  // for a batch_size dataset of page-multiple records
  StagingPool pool_;
  std::mutex mu_;
  std::unordered_map<int64_t, Pending> pending_;
  std::deque<std::pair<int64_t, int64_t>> calls_;  // the tickets [first, end) of the newest calls, oldest first
  // Tickets outlive the process in an iterator's checkpoint: numbered from a random
  // start, a restored one is not mistaken for one of this process's (and take checks
  // the range too).
  int64_t next_ticket_ = static_cast<int64_t>(random_bits() & 0x3fffffffu) << 31;
};

// The prefetchers of the datasets whose kernels live, by key.
struct Prefetchers {
  std::mutex mu;
  std::unordered_map<int64_t, std::weak_ptr<Prefetcher>> live;
};

Prefetchers &prefetchers() {
  static Prefetchers all;
  return all;
}

// The prefetcher of a dataset, shared by its start and take kernels (by the key attr).
std::shared_ptr<Prefetcher> prefetcher_for(int64_t key, const tf::Config &config, bool direct, int64_t record_bytes,
                                           int64_t batch_size, int64_t read_ahead) {
  auto &[mu, live] = prefetchers();
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = live.begin(); it != live.end();)  // datasets whose kernels are gone
    it = it->second.expired() ? live.erase(it) : std::next(it);
  auto &slot = live[key];
  auto shared = slot.lock();
  if (!shared) {
    shared = std::make_shared<Prefetcher>(config, direct, record_bytes, batch_size, read_ahead);
    slot = shared;
  }
  return shared;
}

// The reads held by the prefetcher of a dataset (none where it has none).
int64_t held_reads(int64_t key) {
  std::shared_ptr<Prefetcher> prefetcher;
  {
    auto &[mu, live] = prefetchers();
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(key);
    if (it != live.end()) prefetcher = it->second.lock();
  }
  return prefetcher ? prefetcher->held_reads() : 0;
}

struct Kernel {
  std::shared_ptr<Prefetcher> prefetcher;
  bool tfrecord = false;
  int64_t record_bytes = 0;
};

void *create_kernel(TF_OpKernelConstruction *ctx) {
  Status status;
  tf::Config config;
  char backend[32] = {0};
  int64_t value = 0, key = 0;
  TF_Bool direct = 0;
  auto kernel = std::make_unique<Kernel>();
  TF_OpKernelConstruction_GetAttrString(ctx, "backend", backend, sizeof backend - 1, status.get());
  if (status.ok()) config.backend = backend;
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "block_size", &value, status.get());
  if (status.ok()) config.block_size = static_cast<uint64_t>(value);
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "queue_depth", &value, status.get());
  if (status.ok()) config.queue_depth = static_cast<int>(value);
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "threads", &value, status.get());
  if (status.ok()) config.threads = static_cast<int>(value);
  if (status.ok()) TF_OpKernelConstruction_GetAttrBool(ctx, "direct", &direct, status.get());
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "key", &key, status.get());
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "record_bytes", &kernel->record_bytes, status.get());
  int64_t batch_size = 0, read_ahead = 0;
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "batch_size", &batch_size, status.get());
  if (status.ok()) TF_OpKernelConstruction_GetAttrInt64(ctx, "read_ahead", &read_ahead, status.get());
  TF_Bool tfrecord = 0;
  if (status.ok()) TF_OpKernelConstruction_GetAttrBool(ctx, "tfrecord", &tfrecord, status.get());
  kernel->tfrecord = tfrecord;
  if (status.ok()) {
    try {
      kernel->prefetcher = prefetcher_for(key, config, direct, kernel->record_bytes, batch_size, read_ahead);
    } catch (const tf::IOError &e) {
      TF_SetStatus(status.get(), kInternal, printable(describe(e.path, e.what, e.err, e.offset, e.length)).c_str());
    }
  }
  if (!status.ok()) {
    TF_OpKernelConstruction_Failure(ctx, status.get());
    return nullptr;
  }
  return kernel.release();
}

void delete_kernel(void *kernel) { delete static_cast<Kernel *>(kernel); }

// Input i of the op; deleted with the returned holder.
using TensorHolder = std::unique_ptr<TF_Tensor, void (*)(TF_Tensor *)>;
TensorHolder input(TF_OpKernelContext *ctx, int i) {
  Status status;
  TF_Tensor *t = nullptr;
  TF_GetInput(ctx, i, &t, status.get());
  if (!status.ok()) TF_OpKernelContext_Failure(ctx, status.get());
  return TensorHolder(status.ok() ? t : nullptr, TF_DeleteTensor);
}

TensorHolder output(TF_OpKernelContext *ctx, TF_DataType dtype, const std::vector<int64_t> &shape, size_t nbytes) {
  Status status;
  TF_Tensor *out =
      TF_AllocateOutput(ctx, 0, dtype, shape.data(), static_cast<int>(shape.size()), nbytes, status.get());
  if (!status.ok()) TF_OpKernelContext_Failure(ctx, status.get());
  return TensorHolder(status.ok() ? out : nullptr, TF_DeleteTensor);
}

// False, with the op's error set, for a range no item can have.
bool range_is_valid(const Kernel &k, TF_OpKernelContext *ctx, std::string_view path, int64_t offset, int64_t length) {
  const bool damaged = k.tfrecord && length == kDamagedRecord;
  if (offset < 0 || (length < kWholeFile && !damaged)) {
    fail(ctx, kInvalidArgument, std::string(path) + ": negative offset or length");
    return false;
  }
  if (length == kWholeFile && (k.tfrecord || k.record_bytes)) {
    fail(ctx, kInvalidArgument, std::string(path) + ": a whole file is read as a string, not as records");
    return false;
  }
  if (k.tfrecord && !damaged && static_cast<uint64_t>(length) < kTfrecordFooter) {
    fail(ctx, kDataLoss, std::string(path) + ": TFRecord range shorter than its CRC");
    return false;
  }
  return true;
}

// TensorferryStartReads(paths, offsets, lengths) -> tickets, all of one shape.
void compute_start(void *kernel, TF_OpKernelContext *ctx) {
  auto &k = *static_cast<Kernel *>(kernel);
  TensorHolder paths = input(ctx, 0), offsets = input(ctx, 1), lengths = input(ctx, 2);
  if (!paths || !offsets || !lengths) return;
  const int64_t n = TF_TensorElementCount(paths.get());
  if (TF_TensorElementCount(offsets.get()) != n || TF_TensorElementCount(lengths.get()) != n)
    return fail(ctx, kInvalidArgument, "paths, offsets and lengths must have the same number of elements");
  std::vector<int64_t> shape;
  for (int d = 0; d < TF_NumDims(paths.get()); ++d) shape.push_back(TF_Dim(paths.get(), d));
  const auto *path_strings = static_cast<const TString *>(TF_TensorData(paths.get()));
  const auto *offset_values = static_cast<const int64_t *>(TF_TensorData(offsets.get()));
  const auto *length_values = static_cast<const int64_t *>(TF_TensorData(lengths.get()));
  std::vector<std::string_view> path_views;
  for (int64_t i = 0; i < n; ++i) {
    path_views.push_back(tstring_view(path_strings[i]));
    if (!range_is_valid(k, ctx, path_views.back(), offset_values[i], length_values[i])) return;
  }
  TensorHolder tickets = output(ctx, kInt64, shape, n * sizeof(int64_t));
  if (!tickets) return;
  k.prefetcher->start(path_views, offset_values, length_values, static_cast<int64_t *>(TF_TensorData(tickets.get())));
}

// The items of tickets (a tensor of any shape; inputs 1-3 are their paths, offsets and
// lengths), each waited for. All are taken, so that none stays behind; false, with the
// op's error set (the first failed item's), if any failed.
bool take_items(Kernel &k, TF_OpKernelContext *ctx, std::vector<Pending> &items, std::vector<int64_t> &shape) {
  TensorHolder tickets = input(ctx, 0), paths = input(ctx, 1), offsets = input(ctx, 2), lengths = input(ctx, 3);
  if (!tickets || !paths || !offsets || !lengths) return false;
  const int64_t n = TF_TensorElementCount(tickets.get());
  if (TF_TensorElementCount(paths.get()) != n || TF_TensorElementCount(offsets.get()) != n ||
      TF_TensorElementCount(lengths.get()) != n) {
    fail(ctx, kInvalidArgument, "tickets, paths, offsets and lengths must have the same number of elements");
    return false;
  }
  for (int d = 0; d < TF_NumDims(tickets.get()); ++d) shape.push_back(TF_Dim(tickets.get(), d));
  const auto *ids = static_cast<const int64_t *>(TF_TensorData(tickets.get()));
  const auto *path_strings = static_cast<const TString *>(TF_TensorData(paths.get()));
  const auto *offset_values = static_cast<const int64_t *>(TF_TensorData(offsets.get()));
  const auto *length_values = static_cast<const int64_t *>(TF_TensorData(lengths.get()));
  for (int64_t i = 0; i < n; ++i)
    if (!range_is_valid(k, ctx, tstring_view(path_strings[i]), offset_values[i], length_values[i])) return false;
  items.resize(static_cast<size_t>(n));
  for (size_t i = 0; i < items.size(); ++i)
    k.prefetcher->take(ids[i], tstring_view(path_strings[i]), offset_values[i], length_values[i], items[i]);
  for (const Pending &item : items) {
    if (!item.error.empty()) {
      fail(ctx, item.code, item.error);
      return false;
    }
  }
  return true;
}

// Makes `string` hold the item's bytes (a TFRecord record's data, its CRC checked).
// False, with the op's error set, if the CRC is wrong or memory runs out.
bool fill_string(const Kernel &k, TF_OpKernelContext *ctx, Pending &item, TString &string) {
  if (!item.length) return true;
  uint64_t size = item.length;
  uint32_t stored = 0;
  if (k.tfrecord) {
    size -= kTfrecordFooter;
    std::memcpy(&stored, item.data + size, sizeof stored);
  }
  const auto crc_matches = [&](uint32_t crc) {
    if (tf::mask_crc32c(crc) == stored) return true;
    fail(ctx, kDataLoss, item.path + ": bad data CRC in the record at offset " +
                             std::to_string(item.offset - 12));  // the 12-byte header precedes the data
    return false;
  };
  Landing &landing = *item.landing;
  if (landing.own) {  // an item's own memory (no other item shares it) becomes its string
    if (k.tfrecord && !crc_matches(tf::crc32c(item.data, size))) return false;
    if (item.data != landing.own) std::memmove(landing.own, item.data, size);
    tstring_allocate(string, size, std::exchange(landing.own, nullptr));
    return true;
  }
  char *data = tstring_allocate(string, size);
  if (!data) {
    fail(ctx, kResourceExhausted, "no memory for a string of " + std::to_string(size) + " bytes");
    return false;
  }
  if (!k.tfrecord) {
    std::memcpy(data, item.data, size);
    return true;
  }
  // Checked as it is copied out of staging, from the cache: a pass over memory fewer.
  return crc_matches(tf::crc32c_copy(data, item.data, size));
}

// TensorferryTakeString(tickets) -> the items' bytes, strings of the tickets' shape.
void compute_take_string(void *kernel, TF_OpKernelContext *ctx) {
  auto &k = *static_cast<Kernel *>(kernel);
  std::vector<Pending> items;
  std::vector<int64_t> shape;
  if (!take_items(k, ctx, items, shape)) return;
  TensorHolder out = output(ctx, kString, shape, items.size() * sizeof(TString));
  if (!out) return;
  auto *strings = static_cast<TString *>(TF_TensorData(out.get()));
  for (size_t i = 0; i < items.size(); ++i)
    if (!fill_string(k, ctx, items[i], strings[i])) return;
}

// TensorFlow copies external memory that is not aligned for Eigen (EIGEN_MAX_ALIGN_BYTES).
constexpr uintptr_t kTensorAlignment = 64;

// A slot lent to a tensor, given back when TensorFlow frees the tensor (from any thread,
// after the dataset is gone too: the slots stay alive with it).
struct LentSlot {
  std::shared_ptr<RecordSlots> slots;
  char *slot;
};

void give_back_slot(void *, size_t, void *lent) {
  auto *l = static_cast<LentSlot *>(lent);
  l->slots->give(l->slot);
  delete l;
}

// Hands a batch slot over as the output tensor, where the items are its records in
// order from its start (a batch that start_batch laid out, taken whole); false otherwise.
bool hand_over_batch(TF_OpKernelContext *ctx, std::vector<Pending> &items, const std::vector<int64_t> &shape,
                     uint64_t record_bytes) {
  Landing *batch = items.size() > 1 && items[0].landing && items[0].landing->batch ? items[0].landing.get() : nullptr;
  if (!batch || !batch->slot) return false;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].landing.get() != batch || items[i].data != batch->slot + i * record_bytes) return false;
  auto *lent = new LentSlot{batch->slots, std::exchange(batch->slot, nullptr)};
  TensorHolder tensor(TF_NewTensor(kUint8, shape.data(), static_cast<int>(shape.size()), lent->slot,
                                   items.size() * record_bytes, give_back_slot, lent),
                      TF_DeleteTensor);
  if (!tensor) {  // TensorFlow refused the memory without taking it
    give_back_slot(nullptr, 0, lent);
    fail(ctx, kResourceExhausted, "no tensor for a batch of " + std::to_string(items.size()) + " records");
    return true;
  }
  Status status;
  TF_SetOutput(ctx, 0, tensor.get(), status.get());
  if (!status.ok()) TF_OpKernelContext_Failure(ctx, status.get());
  return true;
}

// TensorferryTakeRecord(tickets) -> uint8[*tickets' shape, record_bytes].
void compute_take_record(void *kernel, TF_OpKernelContext *ctx) {
  auto &k = *static_cast<Kernel *>(kernel);
  std::vector<Pending> items;
  std::vector<int64_t> shape;
  if (!take_items(k, ctx, items, shape)) return;
  for (const Pending &item : items)
    if (item.length != static_cast<uint64_t>(k.record_bytes))
      return fail(ctx, kInvalidArgument, item.path + ": a record of " + std::to_string(item.length) +
                                             " bytes where record_bytes is " + std::to_string(k.record_bytes));
  shape.push_back(k.record_bytes);
  if (hand_over_batch(ctx, items, shape, static_cast<uint64_t>(k.record_bytes))) return;
  Landing *landing = items.size() == 1 ? items[0].landing.get() : nullptr;
  if (landing && landing->slot && reinterpret_cast<uintptr_t>(items[0].data) % kTensorAlignment == 0) {
    auto *lent = new LentSlot{landing->slots, std::exchange(landing->slot, nullptr)};
    TensorHolder tensor(TF_NewTensor(kUint8, shape.data(), static_cast<int>(shape.size()), items[0].data,
                                     static_cast<size_t>(k.record_bytes), give_back_slot, lent),
                        TF_DeleteTensor);
    if (!tensor) {  // TensorFlow refused the memory without taking it
      give_back_slot(nullptr, 0, lent);
      return fail(ctx, kResourceExhausted, "no tensor for a record of " + std::to_string(k.record_bytes) + " bytes");
    }
    Status status;
    TF_SetOutput(ctx, 0, tensor.get(), status.get());
    if (!status.ok()) TF_OpKernelContext_Failure(ctx, status.get());
    return;
  }
  TensorHolder out = output(ctx, kUint8, shape, items.size() * k.record_bytes);
  if (!out) return;
  char *rows = static_cast<char *>(TF_TensorData(out.get()));
  for (size_t i = 0; i < items.size(); ++i) std::memcpy(rows + i * k.record_bytes, items[i].data, k.record_bytes);
}

void unknown_shape(TF_ShapeInferenceContext *ctx, TF_Status *status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

void register_op(const char *name, std::vector<const char *> inputs, const char *output,
                 void (*compute)(void *, TF_OpKernelContext *)) {
  Status status;
  TF_OpDefinitionBuilder *op = TF_NewOpDefinitionBuilder(name);
  for (const char *spec : inputs) TF_OpDefinitionBuilderAddInput(op, spec);
  TF_OpDefinitionBuilderAddOutput(op, output);
  // Every op names its dataset's prefetcher (key), how that reads, and the start calls
  // that an iterator runs ahead (read_ahead, 0: unknown); the first kernel of a key makes it.
  for (const char *spec : {"key: int", "backend: string", "block_size: int", "queue_depth: int", "threads: int",
                           "direct: bool", "tfrecord: bool = false", "record_bytes: int = 0",
                           "batch_size: int = 0", "read_ahead: int = 0"})
    TF_OpDefinitionBuilderAddAttr(op, spec);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, unknown_shape);
  TF_RegisterOpDefinition(op, status.get());
  if (!status.ok()) return;
  TF_KernelBuilder *kernel = TF_NewKernelBuilder(name, "CPU", create_kernel, compute, delete_kernel);
  TF_RegisterKernelBuilder(name, kernel, status.get());
}

// TensorferryHeldReads() -> the number of items whose reads the prefetcher of the dataset
// `key` started and holds for a take: those an iterator has ahead, and those of iterators
// stopped early that it has not let go yet. For tests.
void *create_held_reads(TF_OpKernelConstruction *ctx) {
  Status status;
  auto key = std::make_unique<int64_t>(0);
  TF_OpKernelConstruction_GetAttrInt64(ctx, "key", key.get(), status.get());
  if (!status.ok()) {
    TF_OpKernelConstruction_Failure(ctx, status.get());
    return nullptr;
  }
  return key.release();
}

void compute_held_reads(void *key, TF_OpKernelContext *ctx) {
  TensorHolder out = output(ctx, kInt64, {}, sizeof(int64_t));
  if (out) *static_cast<int64_t *>(TF_TensorData(out.get())) = held_reads(*static_cast<int64_t *>(key));
}

void delete_held_reads(void *key) { delete static_cast<int64_t *>(key); }

void register_held_reads() {
  Status status;
  TF_OpDefinitionBuilder *op = TF_NewOpDefinitionBuilder("TensorferryHeldReads");
  TF_OpDefinitionBuilderAddOutput(op, "held: int64");
  TF_OpDefinitionBuilderAddAttr(op, "key: int");
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, unknown_shape);
  TF_RegisterOpDefinition(op, status.get());
  if (!status.ok()) return;
  TF_KernelBuilder *kernel =
      TF_NewKernelBuilder("TensorferryHeldReads", "CPU", create_held_reads, compute_held_reads, delete_held_reads);
  TF_RegisterKernelBuilder("TensorferryHeldReads", kernel, status.get());
}

const bool registered = [] {
  register_op("TensorferryStartReads", {"paths: string", "offsets: int64", "lengths: int64"}, "tickets: int64",
              compute_start);
  // The takes get each ticket's range too: an iterator's checkpoint holds tickets
  // whose reads the restoring process never started.
  const std::vector<const char *> taken = {"tickets: int64", "paths: string", "offsets: int64", "lengths: int64"};
  register_op("TensorferryTakeString", taken, "out: string", compute_take_string);
  register_op("TensorferryTakeRecord", taken, "out: uint8", compute_take_record);
  register_held_reads();
  return true;
}();

}  // namespace
