// Python binding of the native core. Memory crosses as (address, length) pairs that the
// Python layer takes from buffer-protocol or DLPack objects it keeps alive meanwhile.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "crc32c.hpp"
#include "engine.hpp"
#include "tfrecord.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// The Python exception type for I/O failures (tensorferry.TensorferryIOError), set by
// the Python package at import so that native errors arrive as the public type.
nb::object io_error_type;

// A path as Python spells it (os.fsdecode): a name that is not UTF-8 comes back with the
// surrogate escapes os.listdir gave it, not as a UnicodeDecodeError.
nb::object fs_str(const std::string &path) {
  PyObject *text = PyUnicode_DecodeFSDefaultAndSize(path.data(), static_cast<Py_ssize_t>(path.size()));
  if (text == nullptr) throw nb::python_error();
  return nb::steal(text);
}

// A path from Python, as os.fsencode gives it: bytes, since a name need not be UTF-8.
std::string fs_path(const nb::bytes &path) {
  std::string out(path.c_str(), path.size());
  if (out.find('\0') != std::string::npos) throw nb::value_error("a path must not contain a NUL byte");
  return out;
}

// The Python exception for a native IOError.
nb::object io_error(const tf::IOError &e) {
  const std::string message = e.what + ": " + std::strerror(e.err);
  nb::object path = e.path.empty() ? nb::none() : fs_str(e.path);
  return io_error_type.is_valid() ? io_error_type(e.err, message, path, e.offset, e.length)
                                  : nb::module_::import_("builtins").attr("OSError")(e.err, message, path);
}

// Sets the Python error for a native IOError; a translator must set it, not throw.
void set_io_error(const tf::IOError &e) {
  nb::object exc = io_error(e);
  PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
}

double clock_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Waits for `request` (up to `timeout` seconds; a negative one, without limit) in slices
// with the GIL released, checking for signals between them: Ctrl-C raises KeyboardInterrupt
// here within a slice, not once a long request is over. Only the wait stops; the I/O goes
// on into the memory that the future keeps alive.
bool wait_interruptibly(tf::Request &request, double timeout) {
  constexpr double kSlice = 0.05;
  const bool limited = timeout >= 0;
  const double deadline = limited ? clock_seconds() + timeout : 0;  // infinite for an infinite timeout
  for (;;) {
    const double slice = limited ? std::clamp(deadline - clock_seconds(), 0.0, kSlice) : kSlice;
    {
      nb::gil_scoped_release unlocked;
      if (request.wait(slice)) return true;
    }
    if (limited && clock_seconds() >= deadline) return false;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  }
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "tensorferry native I/O core";

  nb::register_exception_translator([](const std::exception_ptr &p, void *) {
    try {
      std::rethrow_exception(p);
    } catch (const tf::IOError &e) {
      set_io_error(e);
    }
  });

  m.def("set_io_error_type", [](nb::object type) { io_error_type = type; });
  m.def("io_uring_probe", [] {
    std::string why;
    const bool ok = tf::uring_available(&why);
    return std::make_tuple(ok, why);
  }, "Returns (usable, reason): whether io_uring works in this kernel and sandbox.");

  nb::class_<tf::File>(m, "File")
      // Opens without the GIL: an open waits out a lease break (up to 45 s) or a slow NFS or
      // FUSE server, and every Python thread would wait with it.
      .def(nb::new_([](const nb::bytes &path, const std::string &mode, bool direct) {
             const std::string name = fs_path(path);
             nb::gil_scoped_release unlocked;
             return std::make_shared<tf::File>(name, mode, direct);
           }), "path"_a, "mode"_a, "direct"_a)
      .def(nb::new_([](int fd, const nb::bytes &label) {
             const std::string name = fs_path(label);
             nb::gil_scoped_release unlocked;
             return std::make_shared<tf::File>(fd, name);
           }), "fd"_a, "label"_a)
      .def("close", &tf::File::close)
      .def("fsync", &tf::File::fsync, nb::call_guard<nb::gil_scoped_release>())
      .def("truncate", &tf::File::truncate, "size"_a)
      .def("reserve", [](tf::File &f, uint64_t size) { f.reserve(0, size); }, "size"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("size", &tf::File::size)
      .def_prop_ro("path", [](const tf::File &f) { return fs_str(f.path()); })
      .def_prop_ro("closed", &tf::File::is_closed)
      .def_prop_ro("direct", &tf::File::direct)
      .def_prop_ro("direct_refused", &tf::File::direct_refused)
      .def_prop_ro("offset_align", &tf::File::offset_align)
      .def_prop_ro("mem_align", &tf::File::mem_align)
      .def_prop_ro("fileno", &tf::File::buffered_fd);

  nb::class_<tf::Request>(m, "Request")
      .def("wait", &wait_interruptibly, "timeout"_a)
      .def("done", &tf::Request::done)
      .def("cancel", &tf::Request::cancel)
      .def_prop_ro("failed", &tf::Request::failed)
      .def_prop_ro("bytes_done", &tf::Request::bytes_done)
      .def_prop_ro("nbytes", &tf::Request::nbytes)
      .def_prop_ro("offset", &tf::Request::offset)
      .def_prop_ro("error", [](const tf::Request &r) {
        return std::make_tuple(r.error(), r.error_what(), r.error_offset(), r.error_length());
      });

  nb::class_<tf::Engine>(m, "Engine")
      .def("__init__",
           [](tf::Engine *self, const std::string &backend, uint64_t block_size, int queue_depth, int threads) {
             tf::Config c;
             c.backend = backend;
             c.block_size = block_size;
             c.queue_depth = queue_depth;
             c.threads = threads;
             new (self) tf::Engine(c);
           },
           "backend"_a, "block_size"_a, "queue_depth"_a, "threads"_a)
      .def("submit",
           [](tf::Engine &e, std::shared_ptr<tf::File> file, bool is_write, uintptr_t address, uint64_t nbytes,
              uint64_t offset) {
             return e.submit(std::move(file), is_write, reinterpret_cast<char *>(address), nbytes, offset);
           },
           "file"_a, "is_write"_a, "address"_a, "nbytes"_a, "offset"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("submit_many",
           [](tf::Engine &e, std::shared_ptr<tf::File> file, bool is_write,
              const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t>> &segments) {
             std::vector<tf::Engine::Segment> parts;
             parts.reserve(segments.size());
             for (const auto &[address, nbytes, offset] : segments)
               parts.push_back({reinterpret_cast<char *>(address), nbytes, offset});
             nb::gil_scoped_release unlocked;
             return e.submit_many(std::move(file), is_write, parts);
           },
           "file"_a, "is_write"_a, "segments"_a)
      .def("submit_reads",
           [](tf::Engine &e, const std::vector<nb::bytes> &encoded_paths, bool direct,
              const std::vector<std::vector<std::tuple<uintptr_t, uint64_t, uint64_t>>> &segments) {
             // Opens the files and starts their reads with the GIL released: for a batch
             // of small files, a Python call and file object each cost more than the read.
             // Returns per file (request, direct_refused) or (the error that stopped it, False).
             const size_t n = encoded_paths.size();
             std::vector<std::string> paths;
             for (const auto &path : encoded_paths) paths.push_back(fs_path(path));
             if (segments.size() != n) throw tf::IOError{EINVAL, "", "submit_reads: a list of segments per path"};
             std::vector<std::shared_ptr<tf::File>> files;
             std::vector<std::vector<tf::Engine::Segment>> parts;
             std::vector<size_t> opened;
             std::vector<std::pair<size_t, tf::IOError>> failed;
             std::vector<std::shared_ptr<tf::Request>> requests;
             {
               nb::gil_scoped_release unlocked;
               for (size_t i = 0; i < n; ++i) {
                 try {
                   files.push_back(std::make_shared<tf::File>(paths[i], "r", direct));
                 } catch (const tf::IOError &err) {
                   failed.emplace_back(i, err);
                   continue;
                 }
                 opened.push_back(i);
                 auto &file_parts = parts.emplace_back();
                 for (const auto &[address, nbytes, offset] : segments[i])
                   file_parts.push_back({reinterpret_cast<char *>(address), nbytes, offset});
               }
               requests = e.submit_reads(files, parts);
             }
             nb::list out;
             for (size_t i = 0; i < n; ++i) out.append(nb::none());
             for (size_t k = 0; k < opened.size(); ++k)
               out[opened[k]] = nb::make_tuple(requests[k], files[k]->direct_refused());
             for (const auto &[i, err] : failed) out[i] = nb::make_tuple(io_error(err), false);
             return out;
           },
           "paths"_a, "direct"_a, "segments"_a)
      .def("close", &tf::Engine::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("backend", &tf::Engine::backend_name);

  m.def("_inject_uring_enter_failures", &tf::inject_uring_enter_failures, "count"_a, "err"_a,
        "Makes the next `count` io_uring_enter calls fail with errno `err`: for tests of the recovery.");
  m.def("_inject_uring_results", &tf::inject_uring_results, "count"_a, "res"_a,
        "Makes the next `count` io_uring read/write completions report `res` (-errno): for tests of the retries.");

  m.def("populate", [](uintptr_t address, uint64_t nbytes) {
    tf::populate_for_write(reinterpret_cast<char *>(address), nbytes);
  }, "address"_a, "nbytes"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Faults in memory that a read is about to fill.");

  m.def("populate_read", [](uintptr_t address, uint64_t nbytes) {
    return tf::populate_for_read(reinterpret_cast<char *>(address), nbytes);
  }, "address"_a, "nbytes"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Reads in the pages of a file mapping (page-aligned range): 0, or the errno.");

  m.def("copy_out", [](uintptr_t dest, uintptr_t source, uint64_t nbytes) {
    tf::copy_out(reinterpret_cast<char *>(dest), reinterpret_cast<const char *>(source), nbytes);
  }, "dest"_a, "source"_a, "nbytes"_a, nb::call_guard<nb::gil_scoped_release>(),
        "Copies bytes that will not be read again soon: streaming stores, no cache lines read for ownership.");

  m.def("masked_crc32c", [](uintptr_t address, uint64_t nbytes) {
    return tf::masked_crc32c(reinterpret_cast<const void *>(address), nbytes);
  }, "address"_a, "nbytes"_a, nb::call_guard<nb::gil_scoped_release>(),
        "TFRecord's masked CRC-32C of a memory range.");

  m.def("tfrecord_ranges", [](const nb::bytes &path) {
    tf::TfrecordRanges ranges;
    {
      nb::gil_scoped_release unlocked;
      ranges = tf::scan_tfrecord(fs_path(path));
    }
    // The message names the file, which need not be UTF-8: decoded as os.fsdecode would.
    nb::object damage = nb::none();
    if (!ranges.damage.empty()) damage = nb::make_tuple(ranges.damage_offset, fs_str(ranges.damage));
    return nb::make_tuple(ranges.offsets, ranges.lengths, damage);
  }, "path"_a,
        "(offsets, lengths, damage) of the records of a TFRecord file: each record's data and its CRC "
        "footer, up to the first damaged record (cut short, or a bad length CRC), and None or the "
        "(offset, why) of that one. Raises OSError if unreadable.");

  m.def("alloc_pinned", [](uint64_t nbytes, bool lock) {
    const tf::PinnedAllocation a = tf::pinned_alloc(nbytes, lock);
    auto *owned = new tf::PinnedAllocation(a);
    nb::capsule owner(owned, [](void *p) noexcept {
      auto *alloc = static_cast<tf::PinnedAllocation *>(p);
      tf::pinned_free(*alloc);
      delete alloc;
    });
    const size_t shape[1] = {static_cast<size_t>(nbytes)};
    auto array = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(a.ptr, 1, shape, owner);
    return std::make_tuple(array, a.locked);
  }, "nbytes"_a, "lock"_a = true,
        "Page-aligned host memory in huge pages where it spans one, its own mapping (unmapped when "
        "the array goes), mlocked if asked and RLIMIT_MEMLOCK allows: (uint8 array, locked).");
}
